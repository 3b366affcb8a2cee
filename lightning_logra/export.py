"""A training checkpoint as a transformers folder, without re-running training:

    python -m lightning_logra.export --ckpt_path runs/tiny_arith/version_0/checkpoints/last.ckpt --out exported/

The folder (weights in the dtype they were trained in, config, generation config, tokenizer) loads with
`AutoModelForCausalLM.from_pretrained` and with vLLM. A sketch-trained checkpoint needs nothing sketch-specific:
sketched layers keep the original parameter names and shapes, and the sketch carriers are not in state_dicts.

A LoRA-trained checkpoint (`lightning_logra.lora.LoRAStrategy`) exports merged by default: each adapted matrix
becomes W₀ + s·B·A under its own name, so the folder is a plain transformers model like any other. `--adapter`
writes the adapters alone instead, as peft saves them (`adapter_config.json`, `adapter_model.safetensors`; load with
`PeftModel.from_pretrained(base, folder)` on the base model the run started from), plus the tokenizer.
A sharded checkpoint (a folder, written by `SketchFSDPStrategy`) is consolidated first, in this one process.
"""

from __future__ import annotations

import argparse
import inspect
import tempfile
from pathlib import Path

import torch
from lightning.fabric.utilities.consolidate_checkpoint import _load_distributed_checkpoint

from lightning_logra.checkpoint import KEY


def export_checkpoint(ckpt_path: str | Path, out: str | Path, adapter: bool = False) -> Path:
    """Write the policy of `ckpt_path` (a Lightning checkpoint of an RLVRModule) to `out` with save_pretrained;
    `adapter`: a LoRA checkpoint's adapters alone, in peft's format."""
    from lightning_logra.module import RLVRModule

    ckpt_path, out = Path(ckpt_path), Path(out)
    if ckpt_path.is_dir():
        with tempfile.TemporaryDirectory() as folder:
            # The shards as one ordinary checkpoint (the whole tensors, in this process), then exported as any other.
            whole = Path(folder) / "consolidated.ckpt"
            torch.save(_load_distributed_checkpoint(ckpt_path), whole)
            return export_checkpoint(whole, out, adapter)
    if not ckpt_path.is_file():
        raise FileNotFoundError(f"--ckpt_path: no such checkpoint {str(ckpt_path)!r}")
    checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    lora_settings = checkpoint.get(KEY, {}).get("lora")
    if adapter and lora_settings is None:
        raise ValueError(f"--adapter: {str(ckpt_path)!r} was not trained with LoRA adapters (there are none to "
                         "export); export it without --adapter")
    if lora_settings is not None:
        return _export_lora(checkpoint, out, lora_settings, adapter)
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


def _export_lora(checkpoint: dict, out: Path, settings: dict, adapter: bool) -> Path:
    """A LoRA checkpoint: the base model with the recorded adapters installed takes the checkpoint's state (strictly:
    every base weight and adapter), then is written merged or as peft's adapter folder."""
    from lightning_logra import lora
    from lightning_logra.module import RLVRModule
    from lightning_logra.paths import model_path

    accepted = inspect.signature(RLVRModule.__init__).parameters  # (LightningCLI adds keys of its own)
    hparams = {k: v for k, v in checkpoint["hyper_parameters"].items() if k in accepted}
    module = RLVRModule(**{**hparams, "reward": "exact_match", "reward_timeout_s": None})
    module.configure_model()
    config = lora.LoRAConfig(**settings)
    config.install(module.policy)
    module.load_state_dict(checkpoint["state_dict"])
    dtype = checkpoint[KEY].get("weights_dtype")
    if dtype is not None:
        module.policy.to(getattr(torch, dtype))
    if adapter:
        lora.save_adapter(module.policy, config, model_path(module.hparams.model), out)
        module.tokenizer.save_pretrained(out)
    else:
        lora.merge_adapters_(module.policy)
        module.export(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning-logra export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt_path", required=True, help="a checkpoint written by `fit` (e.g. .../last.ckpt)")
    parser.add_argument("--out", required=True, help="the folder to write the transformers model into")
    parser.add_argument("--adapter", action="store_true",
                        help="a LoRA checkpoint: write its adapters alone, as peft saves them (default: merged)")
    args = parser.parse_args(argv)
    print(f"exported {args.ckpt_path} to {export_checkpoint(args.ckpt_path, args.out, args.adapter)}")


if __name__ == "__main__":
    main()
