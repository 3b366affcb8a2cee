"""Build the model shipped for the embedded multi-turn task (`lightning_logra/data/tool_task.py`: products of two
3-digit numbers, with a `multiply` tool): the tiny Qwen2 of `scripts/make_tiny_arith.py` over the tool task's
tokenizer, supervised on two kinds of episode.

    python scripts/make_tool_model.py      # from the repository root, package installed (pip install -e .)

writes lightning_logra/data/tools/ in a few minutes on one CPU thread (it sets one thread itself).

A fraction `--call-fraction` of the demonstrations call the tool and copy its answer (one sequence, shown on two lines):

    <u>123*456=<a><tool_call>{"name": "multiply", "arguments": {"a": 123, "b": 456}}</tool_call><eos>
    <t>56088<a>56088<eos>

the rest answer at once (`<u>123*456=<a>56088<eos>`), which this model cannot learn to do right (810,000 products,
0.86M parameters). The loss counts what the model would sample (the call, the final answer, their <eos>), not the
prompt, the tool's answer or the template's markers. Trained long enough to call and copy well, the model calls the
tool about as often as it saw calls: RL has to raise that, which is the signal the task measures.

Supervised training (AdamW) stops when, on a fixed probe of train prompts, episodes drawn at temperature 1 through the
project's own episode runner (the in-process engine, the tool in an environment process) are right in at least
`STOP_RIGHT_WHEN_CALLED` of those that call the tool. Seeded, deterministic algorithms, one thread: a rerun on the same
machine gives the same weights.
"""

import json

import torch
from make_tiny_arith import save_model, script_parser  # scripts/ (this script's folder is on sys.path)

from lightning_logra.data.arith import build_tiny_model
from lightning_logra.data.tool_task import TOOLS_DIR, ToolPrompts, build_tool_tokenizer, operands
from lightning_logra.episodes.processes import spec_from_settings
from lightning_logra.episodes.runner import EpisodeLimits, EpisodeRunner
from lightning_logra.rollout import SamplingParams
from lightning_logra.rollout.hf import HFEngine

TOOL = "lightning_logra.data.tool_task.multiply"
MAX_NEW_TOKENS = 64  # a call is 58 tokens with its <eos> (3-digit operands)
MAX_EPISODE_TOKENS = 96  # the call, the tool's answer (at most 9 tokens with the markers), the final answer
STOP_RIGHT_WHEN_CALLED = 0.9
WANTED_CALLS = (0.1, 0.4)  # the sampled call rate the saved model must have, or nothing is saved


def demonstration(tokenizer, a: int, b: int, calls: bool) -> tuple[list[int], list[int]]:
    """A demonstration's ids and labels (-100 where the model does not sample: the prompt, the tool's answer and the
    template's markers around it)."""
    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    eos = [tokenizer.eos_token_id]
    prompt, answer = ids(f"<u>{a}*{b}=<a>"), ids(str(a * b)) + eos
    if not calls:
        return prompt + answer, [-100] * len(prompt) + answer
    call = ids("<tool_call>" + json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}}) + "</tool_call>") + eos
    tool = ids(f"<t>{a * b}<a>")
    return prompt + call + tool + answer, [-100] * len(prompt) + call + [-100] * len(tool) + answer


def batch(tokenizer, train: ToolPrompts, index: torch.Tensor, calls: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(B, L) ids, attention mask and labels, right-padded: every prompt sits where it sits when sampling."""
    rows = [demonstration(tokenizer, *operands(int(train.indices[i])), bool(c)) for i, c in zip(index, calls)]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    for row, (row_ids, row_labels) in enumerate(rows):
        ids[row, : len(row_ids)], labels[row, : len(row_labels)] = torch.tensor(row_ids), torch.tensor(row_labels)
    return ids, (ids != tokenizer.pad_token_id).long(), labels


def episodes_score(runner: EpisodeRunner, engine: HFEngine, rows: list[dict[str, str]], temperature: float,
                   seed: int) -> dict[str, float]:
    """Episodes of `rows`, one each: the fraction right, the fraction that call the tool, and the fraction right of
    those that call it."""
    engine.model.eval()
    right, called = [], []
    for start in range(0, len(rows), 512):
        chunk = rows[start : start + 512]
        prompts = {"prompt": [r["prompt"] for r in chunk], "answer": [r["answer"] for r in chunk]}
        rollout = runner.run(engine, prompts, 1, SamplingParams(temperature, 1.0, MAX_NEW_TOKENS),
                             [seed + start + i for i in range(len(chunk))])
        finals = [conversation[-1]["content"].strip() for conversation in runner.conversations(rollout)]
        right += [final == r["answer"] for final, r in zip(finals, chunk)]
        called += (rollout.episodes[:, 1] > 0).tolist()  # EPISODE_COLUMNS[1]: tool_calls
    engine.model.train()
    right_t, called_t = torch.tensor(right, dtype=torch.float), torch.tensor(called, dtype=torch.float)
    when_called = (right_t * called_t).sum() / called_t.sum().clamp(min=1)
    return {"right": right_t.mean().item(), "calls": called_t.mean().item(), "right_when_called": when_called.item()}


def main() -> None:
    parser = script_parser(__doc__, TOOLS_DIR, batch_size=128, max_steps=6000, eval_every=100)
    parser.add_argument("--call-fraction", type=float, default=0.25)
    parser.add_argument("--probe", type=int, default=512, help="train prompts drawn as episodes at each check")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    tokenizer = build_tool_tokenizer()
    model = build_tiny_model(tokenizer, max_new_tokens=MAX_NEW_TOKENS, max_position_embeddings=128)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters")

    train, evaluation = ToolPrompts("train"), ToolPrompts("eval")
    draws = torch.Generator().manual_seed(args.seed)
    probe_index = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed + 2))[: args.probe]
    probe = [train[i] for i in probe_index.tolist()]
    spec = spec_from_settings(None, [TOOL], "answer", 32 * MAX_EPISODE_TOKENS)
    runner = EpisodeRunner(EpisodeLimits(2, MAX_EPISODE_TOKENS, 10.0, None), spec, tokenizer,
                           [tokenizer.eos_token_id], tokenizer.pad_token_id, workers=1, memory_gib=None)
    engine = HFEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    try:
        step, score = 0, {"right_when_called": 0.0}
        while score["right_when_called"] < STOP_RIGHT_WHEN_CALLED:
            if step == args.max_steps:
                raise SystemExit(f"no stop after {step} steps ({score})")
            index = torch.randint(len(train), (args.batch_size,), generator=draws)  # (B,)
            calls = torch.rand(args.batch_size, generator=draws) < args.call_fraction  # (B,)
            ids, attention_mask, labels = batch(tokenizer, train, index, calls)  # (B, L) each
            loss = model(input_ids=ids, attention_mask=attention_mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % args.eval_every == 0:
                score = episodes_score(runner, engine, probe, 1.0, args.seed)
                print(f"step {step:5d}  loss {loss.item():.4f}  probe " +
                      ", ".join(f"{k} {v:.3f}" for k, v in score.items()), flush=True)

        # The final numbers: the whole held-out split, and as many train prompts.
        train_subset = [train[i] for i in torch.randperm(len(train), generator=draws)[: len(evaluation)].tolist()]
        held_out = [evaluation[i] for i in range(len(evaluation))]
        numbers = {(split, mode): episodes_score(runner, engine, rows, temperature, args.seed + 1)
                   for split, rows in (("train", train_subset), ("eval", held_out))
                   for mode, temperature in (("sampled", 1.0), ("greedy", 0.0))}
    finally:
        runner.close()
    for (split, mode), score in numbers.items():
        print(f"{split} {mode}: " + ", ".join(f"{k} {v:.3f}" for k, v in score.items()))
    calls = numbers["eval", "sampled"]["calls"]
    if not WANTED_CALLS[0] <= calls <= WANTED_CALLS[1]:
        raise SystemExit(f"held-out sampled call rate {calls:.3f} is outside {WANTED_CALLS}; nothing saved")

    size_kib = save_model(model, tokenizer, args.out)
    table = "\n".join(f"| {split} | {mode} | {len(held_out)} | {s['calls']:.3f} | {s['right_when_called']:.3f} | "
                      f"{s['right']:.3f} |" for (split, mode), s in numbers.items())
    (args.out / "README.md").write_text(
        f"""# tools

A {n_params:,}-parameter Qwen2 (the architecture of `tiny_arith`: hidden 128, 4 layers, tied embeddings, fp32, a
context of 128) over the character-level tokenizer of `lightning_logra/data/tool_task.py`, whose chat template renders
Hermes-style tool calls. The task: products of two 3-digit numbers (`123*456=` → `56088`), with a `multiply` tool.

Made with `python scripts/make_tool_model.py` (seed {args.seed}, one thread): AdamW lr {args.lr}, batch
{args.batch_size}, {args.call_fraction:.0%} of the demonstrations calling the tool and copying its answer, the rest
answering at once; loss on the sampled tokens only; stopped after {step} steps when, of {args.probe} train prompts'
episodes at temperature 1 that called the tool, {STOP_RIGHT_WHEN_CALLED:.0%} or more were right.

Episodes drawn by the project's episode runner (at most 2 turns, {MAX_NEW_TOKENS} new tokens a turn), one per prompt:

| split | mode | prompts | call the tool | right when calling | right |
|-------|------|---------|---------------|--------------------|-------|
{table}

Size on disk: {size_kib:,.0f} KiB.
"""
    )
    print(f"saved to {args.out} ({size_kib:,.0f} KiB)")


if __name__ == "__main__":
    main()
