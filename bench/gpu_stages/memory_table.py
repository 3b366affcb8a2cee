"""memory_table: the table users compare, bench.memory with `--device cuda` at the Qwen2.5-1.5B and -7B shapes
in bf16: LoGRA (sketch Adam, the paper's; sketch SGD), dense AdamW (fp32 master weights with bf16 autocast, and bf16
weights with bf16 moments), LoRA; average and peak CUDA memory per GPU and step time, the paper's figures beside
them."""

from __future__ import annotations

from bench.gpu_stages.plan import Plan, Progress
from bench.gpu_stages.rows import measure_rows


def memory_table(plan: Plan, progress: Progress) -> dict:
    """LoGRA (sketch Adam, the paper's; sketch SGD), dense AdamW (fp32 master weights with bf16 autocast; and bf16
    weights with bf16 moments, what the paper's dense figures are), LoRA: memory and step time per shape."""
    return measure_rows(plan, progress, plan.memory_methods)
