"""A training checkpoint as a transformers folder, without re-running training:

    python -m lightning_logra.export --ckpt_path runs/tiny_arith/version_0/checkpoints/last.ckpt --out exported/

The folder (weights in the dtype they were trained in, config, generation config, tokenizer) loads with
`AutoModelForCausalLM.from_pretrained` and with vLLM. A sketch-trained checkpoint needs nothing sketch-specific:
sketched layers keep the original parameter names and shapes, and the sketch carriers are not in state_dicts.
A sharded checkpoint (a folder, written by `SketchFSDPStrategy`) is consolidated first, in this one process.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from lightning.fabric.utilities.consolidate_checkpoint import _load_distributed_checkpoint

from lightning_logra.checkpoint import KEY


def export_checkpoint(ckpt_path: str | Path, out: str | Path) -> Path:
    """Write the policy of `ckpt_path` (a Lightning checkpoint of an RLVRModule) to `out` with save_pretrained."""
    from lightning_logra.module import RLVRModule

    ckpt_path, out = Path(ckpt_path), Path(out)
    if ckpt_path.is_dir():
        with tempfile.TemporaryDirectory() as folder:
            # The shards as one ordinary checkpoint (the whole tensors, in this process), then exported as any other.
            whole = Path(folder) / "consolidated.ckpt"
            torch.save(_load_distributed_checkpoint(ckpt_path), whole)
            return export_checkpoint(whole, out)
    if not ckpt_path.is_file():
        raise FileNotFoundError(f"--ckpt_path: no such checkpoint {str(ckpt_path)!r}")
    checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    # The base model (config, tokenizer) comes from the path the run trained; the reward is not needed to export.
    # weights_only=False: the checkpoint's hyperparameters hold the run's own objects (an LRSchedule, say), and it is
    # the user's own checkpoint (loaded in full just above).
    module = RLVRModule.load_from_checkpoint(ckpt_path, map_location="cpu", weights_only=False, reward="exact_match",
                                             reward_timeout_s=None)
    dtype = checkpoint.get(KEY, {}).get("weights_dtype")  # format 1 has no record: the module's dtype
    if dtype is not None:
        module.policy.to(getattr(torch, dtype))
    module.export(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning-logra export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt_path", required=True, help="a checkpoint written by `fit` (e.g. .../last.ckpt)")
    parser.add_argument("--out", required=True, help="the folder to write the transformers model into")
    args = parser.parse_args(argv)
    print(f"exported {args.ckpt_path} to {export_checkpoint(args.ckpt_path, args.out)}")


if __name__ == "__main__":
    main()
