"""Build the tiny model the project ships: a small Qwen2 trained part of the way on the embedded arithmetic task.

    python scripts/make_tiny_arith.py      # from the repository root, package installed (pip install -e .)

writes lightning_logra/data/tiny_arith/ in about a minute on 2 CPU cores.

Supervised fine-tuning (AdamW, loss on the answer and <eos> tokens only) runs on the train split and stops as soon
as the mean exact-match reward of completions *sampled* at temperature 1.0 reaches ``STOP_REWARD``. A model that is
already right most of the time would leave RL nothing to show, and one that is never right gives it no signal
(every sample in a group has reward 0, so every advantage is 0); a partially trained one lets a laptop run watch
the reward climb. The stop sits low in the wanted range [0.25, 0.45] because a lower start leaves RL more room:
the model learns the task abruptly (at lr 1e-3 the sampled reward went from 0.05 to 0.65 within about 150 steps),
so stopping early in that rise gives a model whose greedy answers are already right about half the time, and RL
lifts both.

The run is seeded and uses deterministic algorithms, so reruns on one machine give the same weights.
"""

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from lightning_logra.data.arith import (
    MAX_NEW_TOKENS,
    TINY_ARITH_DIR,
    build_tiny_model,
    build_tokenizer,
    make_examples,
)

PROMPT_LEN = 6  # "12+34=" — every prompt has this length, so prompts never need padding

# The sampled train reward at which SFT stops. Evaluations are noisy (a subset, sampled completions) and the reward
# rises by a few points between two evaluations, so the stop keeps a margin above the low end of the wanted range;
# the final reward, measured on the whole train split, must land inside it or nothing is saved.
STOP_REWARD = 0.28
WANTED_RANGE = (0.25, 0.45)


def encode_sft(tokenizer: PreTrainedTokenizerFast, examples: list[dict[str, str]],
               prompt_len: int = PROMPT_LEN) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of ``prompt + answer + <eos>`` padded on the right, and labels that keep only the answer and
    <eos> (-100 elsewhere). Right padding keeps every prompt at positions 0..prompt_len-1, exactly where it sits when
    sampling; the pads come after <eos>, so the causal mask already hides them from every labelled position.
    (scripts/make_add3.py uses it too, with its own prompt length.)"""
    texts = [ex["prompt"] + ex["answer"] + tokenizer.eos_token for ex in examples]
    ids = tokenizer(texts, padding="longest", padding_side="right", return_tensors="pt").input_ids  # (N, 10)
    labels = ids.clone()  # (N, 10)
    labels[:, :prompt_len] = -100
    labels[ids == tokenizer.pad_token_id] = -100
    return ids, labels


@torch.no_grad()
def exact_match_rate(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    examples: list[dict[str, str]],
    temperature: float,
    generator: torch.Generator,
    batch_size: int = 1024,
    prompt_len: int = PROMPT_LEN,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> float:
    """Mean exact-match reward of one completion per prompt: sampled at ``temperature`` (top_p 1.0), or greedy when
    it is 0. Sequences are at most 10 tokens, so recomputing the whole prefix each step is cheaper than a KV cache."""
    model.eval()
    correct = 0
    for start in range(0, len(examples), batch_size):
        batch = examples[start : start + batch_size]
        ids = tokenizer([ex["prompt"] for ex in batch], return_tensors="pt").input_ids  # (B, 6)
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids).logits[:, -1]  # (B, V)
            if temperature == 0.0:
                next_ids = logits.argmax(dim=-1)  # (B,)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                next_ids = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # (B,)
            ids = torch.cat([ids, next_ids[:, None]], dim=1)  # (B, 6 + step + 1)
        for row, ex in zip(ids[:, prompt_len:].tolist(), batch):
            # Stop at the first <eos>; a row without one is judged on all its tokens (and fails the match).
            completion = row[: row.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in row else row
            correct += tokenizer.decode(completion).strip() == ex["answer"]
    model.train()
    return correct / len(examples)


def script_parser(doc: str, out: Path, batch_size: int, max_steps: int, eval_every: int) -> argparse.ArgumentParser:
    """The options every model-making script takes (add3's and the tool task's too)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=out)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-steps", type=int, default=max_steps)
    parser.add_argument("--eval-every", type=int, default=eval_every)
    return parser


def save_model(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path) -> float:
    """The model and tokenizer in `out` (safetensors); returns the folder's size in KiB."""
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # transformers 5 records its class as TokenizersBackend, a name transformers 4 cannot resolve; 4 reads this one
    # as "load tokenizer.json". (5 ignores the name for qwen2 folders and builds a Qwen2Tokenizer from the vocab.)
    tokenizer_config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return sum(f.stat().st_size for f in out.iterdir() if f.is_file()) / 1024


def main() -> None:
    parser = script_parser(__doc__, TINY_ARITH_DIR, batch_size=64, max_steps=6000, eval_every=5)
    parser.add_argument("--eval-prompts", type=int, default=512, help="train prompts sampled at each evaluation")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters")

    train, evaluation = make_examples("train"), make_examples("eval")
    ids, labels = encode_sft(tokenizer, train)  # (N, 10) each
    attention_mask = (ids != tokenizer.pad_token_id).long()  # (N, 10)
    batches = torch.Generator().manual_seed(args.seed)
    sampling = torch.Generator().manual_seed(args.seed + 1)
    # A fixed subset keeps each evaluation cheap and makes successive evaluations comparable.
    probe_index = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed + 2))
    probe = [train[i] for i in probe_index[: args.eval_prompts].tolist()]

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    start = time.perf_counter()
    step, reward = 0, 0.0
    while reward < STOP_REWARD:
        if step == args.max_steps:
            raise SystemExit(f"no stop after {step} steps (sampled reward {reward:.3f} < {STOP_REWARD})")
        index = torch.randint(len(train), (args.batch_size,), generator=batches)  # (B,)
        loss = model(input_ids=ids[index], attention_mask=attention_mask[index], labels=labels[index]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % args.eval_every == 0:
            reward = exact_match_rate(model, tokenizer, probe, 1.0, sampling)
            seconds = time.perf_counter() - start
            print(f"step {step:5d}  loss {loss.item():.4f}  sampled reward {reward:.3f}  {seconds:.0f}s")
    sft_seconds = time.perf_counter() - start

    # The final numbers use every prompt of each split, not the probe subset.
    train_sampled = exact_match_rate(model, tokenizer, train, 1.0, sampling)
    train_greedy = exact_match_rate(model, tokenizer, train, 0.0, sampling)
    eval_sampled = exact_match_rate(model, tokenizer, evaluation, 1.0, sampling)
    eval_greedy = exact_match_rate(model, tokenizer, evaluation, 0.0, sampling)
    print(f"stopped after {step} steps, {sft_seconds:.0f}s")
    print(f"train: sampled (T=1.0) {train_sampled:.3f}  greedy {train_greedy:.3f}")
    print(f"eval:  sampled (T=1.0) {eval_sampled:.3f}  greedy {eval_greedy:.3f}")
    if not WANTED_RANGE[0] <= train_sampled <= WANTED_RANGE[1]:
        raise SystemExit(f"sampled train reward {train_sampled:.3f} is outside {WANTED_RANGE}; nothing saved")

    size_kib = save_model(model, tokenizer, args.out)
    (args.out / "README.md").write_text(
        f"""# tiny_arith

A {n_params:,}-parameter Qwen2 (hidden 128, 4 layers, 2 heads of dim 64, MLP 384, tied embeddings, fp32) with a
character-level tokenizer, for the embedded task in `lightning_logra/data/arith.py` (2-digit addition, answer
reversed: `12+34=` → `64`). It is trained only part of the way on purpose, so that RL starts from a partial reward.

Made with `python scripts/make_tiny_arith.py` (seed {args.seed}): AdamW lr {args.lr}, batch {args.batch_size},
loss on the answer and `<eos>` only, stopped after {step} steps ({sft_seconds:.0f} s on 2 CPU cores) when the
sampled reward on {args.eval_prompts} train prompts reached {STOP_REWARD}.

Exact-match reward, one completion per prompt, at most {MAX_NEW_TOKENS} new tokens, stop on `<eos>`:

| split | prompts | sampled (T=1.0, top_p 1.0) | greedy |
|-------|---------|----------------------------|--------|
| train | {len(train)} | {train_sampled:.3f} | {train_greedy:.3f} |
| eval  | {len(evaluation)} | {eval_sampled:.3f} | {eval_greedy:.3f} |

Size on disk: {size_kib:,.0f} KiB.
"""
    )
    print(f"saved to {args.out} ({size_kib:,.0f} KiB)")


if __name__ == "__main__":
    main()
