"""What the reward-model tests score with: a sequence classifier trained on the fly on the embedded task (it learns
that a right answer ends where it should, and a completion with "+" after it is wrong), and a local stand-in for an
OpenAI-compatible judge on 127.0.0.1 (it says YES when the student's answer is the reference answer)."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

from lightning_logra.data.arith import ArithPrompts
from lightning_logra.paths import model_path


def train_reward_classifier(path: Path, steps: int = 60) -> Path:
    """A 1-label Qwen2 classifier over the embedded model's tokenizer, trained until right completions score above
    wrong ones, saved (with the tokenizer) to `path`."""
    tokenizer = AutoTokenizer.from_pretrained(model_path("lightning_logra/data/tiny_arith"))
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    model = Qwen2ForSequenceClassification(config)
    rows = [ArithPrompts("train")[i] for i in range(64)]
    texts = [r["prompt"] + r["answer"] for r in rows] + [r["prompt"] + r["answer"] + "+" for r in rows]
    labels = torch.tensor([1.0] * len(rows) + [0.0] * len(rows))
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        logits = model(**inputs).logits[:, 0]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class _Judge(BaseHTTPRequestHandler):
    """POST /v1/chat/completions: YES when the student's answer equals the reference; the server's `failures` first
    requests answer 500, and a content of "slow" waits past any deadline."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        with server.lock:
            server.requests.append(body)
            fail = server.failures > 0
            server.failures -= fail
        if fail or self.path != "/v1/chat/completions":
            self.send_response(500 if fail else 404)
            self.end_headers()
            return
        content = body["messages"][0]["content"]
        reference = re.search(r"Reference answer: (.*)", content).group(1).strip()
        student = re.search(r"<student_answer>\n(.*?)\n</student_answer>", content, re.S).group(1).strip()
        if student == "slow":
            threading.Event().wait(1)
        reply = "garbled" if student == "garble" else f"Verdict: {'YES' if student == reference else 'NO'}"
        answer = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up on a slow answer

    def log_message(self, *args) -> None:
        pass


def start_judge(failures: int = 0) -> ThreadingHTTPServer:
    """The stub judge on a free port of 127.0.0.1, serving on a daemon thread (`server.url`; `.shutdown()`)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    server.lock, server.requests, server.failures = threading.Lock(), [], failures
    server.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
