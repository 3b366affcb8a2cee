"""A model folder's target matrices, read from its safetensors files, and sketched updates of them: one `LowRankDelta`
per matrix, F (d×r) random and A's seed, as `RolloutWeightSync` sends after a LoGRA step (bench.sync, bench.remote,
bench.rollout)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from lightning_logra.sketch.config import DEFAULT_TARGETS
from lightning_logra.sketch.shared import SHARED_INPUTS
from lightning_logra.sketch.update import LowRankDelta


def target_names(model_dir: Path) -> list[str]:
    config = json.loads((model_dir / "config.json").read_text())
    parents = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
    return [f"model.layers.{i}.{parents[t]}.{t}.weight"
            for i in range(config["num_hidden_layers"]) for t in DEFAULT_TARGETS]


def read_tensors(model_dir: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors from the checkpoint's safetensors files (one file or shards), in the order of `names`."""
    found = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in set(f.keys()) & set(names):
                found[key] = f.get_tensor(key)
    missing = [n for n in names if n not in found]
    if missing:
        raise KeyError(f"{model_dir}: no tensors for {missing[:3]}{'…' if len(missing) > 3 else ''}")
    return {n: found[n] for n in names}


def make_payload(shapes: dict[str, torch.Size], rank: int, scale: float, seed: int, dtype: torch.dtype,
                 share_projection: bool = False):
    """One LowRankDelta per matrix: F (d, r) ~ N(0, scale²) (each entry of F·A, A = ±1/√r, then has std `scale`),
    rounded to `dtype`, and A's seed: one per matrix, or with `share_projection` one per input (q/k/v, gate/up)."""
    from lightning_logra.algo.update import Update

    gen = torch.Generator().manual_seed(seed)
    payload = Update()
    seeds: dict[str, int] = {}  # per projection: the matrix's name, or its group's
    for name, (d, k) in shapes.items():
        factor = torch.randn(d, rank, generator=gen) * scale
        projection = _input_group(name) if share_projection else name
        projection_seed = seeds.setdefault(projection, seed * 1_000_003 + len(seeds))
        payload.low_rank[name] = LowRankDelta(factor.to(dtype), projection_seed, "rademacher", k)
    return payload


def _input_group(name: str) -> str:
    """The group of matrices that read the same input as `name` ("<layer>.self_attn.q_proj+k_proj+v_proj"), or
    `name` itself."""
    parent, _, child = name.removesuffix(".weight").rpartition(".")
    for children in SHARED_INPUTS:
        if child in children:
            return f"{parent}.{'+'.join(children)}"
    return name
