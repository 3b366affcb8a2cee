"""A training checkpoint as a transformers folder, without re-running training:

    python -m lightning_logra.export --ckpt_path runs/tiny_arith/version_0/checkpoints/last.ckpt --out exported/

The folder (weights in the dtype they were trained in, config, generation config, tokenizer) loads with
`AutoModelForCausalLM.from_pretrained` and with vLLM. A sketch-trained checkpoint needs nothing sketch-specific:
sketched layers keep the original parameter names and shapes, and the sketch carriers are not in state_dicts.

A LoRA-trained checkpoint (`lightning_logra.train.strategies.LoRAStrategy`) exports merged by default: each adapted
matrix
becomes W₀ + s·B·A under its own name, so the folder is a plain transformers model like any other. `--adapter`
writes the adapters alone instead, as peft saves them (`adapter_config.json`, `adapter_model.safetensors`; load with
`PeftModel.from_pretrained(base, folder)` on the base model the run started from), plus the tokenizer.
A sharded checkpoint (a folder, written by `SketchFSDPStrategy`) is consolidated first, in this one process.

The checkpoint is loaded without running code from it and checked against the sha256 digests it records
(`lightning_logra.train.safe_load`, `lightning_logra.train.digests`). `--out` must not exist or be an empty folder;
`--overwrite` replaces a folder that is not empty, whole: the export is written into a new folder beside it, with a
`SHA256SUMS` of its files, and moved into place once complete, so a failed export leaves `--out` as it was.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch

from lightning_logra.train.checkpoint import KEY, follow_umask, load_verified, replace_folder
from lightning_logra.train.digests import verify_sums, write_sums
from lightning_logra.train.safe_load import load_sharded_whole


def export_checkpoint(ckpt_path: str | Path, out: str | Path, adapter: bool = False, overwrite: bool = False) -> Path:
    """Write the policy of `ckpt_path` (a Lightning checkpoint of an RLVRModule: a file, or a sharded folder) to the
    folder `out` with save_pretrained; `adapter`: a LoRA checkpoint's adapters alone, in peft's format; `overwrite`:
    replace `out` if it is a folder that is not empty (it is never merged into)."""
    # Followed once: a run started meanwhile moves `runs/<name>/latest` to its own, still empty, folder.
    ckpt_path, out = Path(ckpt_path).resolve(), Path(out)
    _check_out(out, overwrite, ckpt_path)
    checkpoint = _load(ckpt_path)
    if "model" not in (checkpoint.get("hyper_parameters") or {}):
        raise ValueError(f"--ckpt_path: {str(ckpt_path)!r} records no model (its hyper_parameters have no 'model'): "
                         "it was not written by `lightning-logra fit`, which exports need to know the base model; "
                         "export a checkpoint of a run of this project's")
    _check_not_the_base(out, checkpoint["hyper_parameters"]["model"])
    lora_settings = checkpoint.get(KEY, {}).get("lora")
    if adapter and lora_settings is None:
        raise ValueError(f"--adapter: {str(ckpt_path)!r} was not trained with LoRA adapters (there are none to "
                         "export); export it without --adapter")
    tmp = out.parent / f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    tmp.mkdir(parents=True)  # mode 0777 less the umask, as every other folder the run writes
    try:
        _write(checkpoint, tmp, lora_settings, adapter)
        replace_folder(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _check_out(out: Path, overwrite: bool, ckpt_path: Path) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out: {str(out)!r} is a file; name a folder to write the model into")
    # Whatever --overwrite says: replacing a folder that holds the checkpoint, or any run's checkpoints or logs,
    # would delete them (`--out` set to the checkpoint's own folder took the checkpoint, every version and the
    # TensorBoard files with it).
    if out.resolve() == ckpt_path.resolve() or out.resolve() in ckpt_path.resolve().parents:
        raise FileExistsError(f"--out: {str(out)!r} holds the checkpoint it would export ({str(ckpt_path)!r}), "
                              "which writing the export there would delete; name another folder")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"--out: the folder {str(out)!r} is not empty; name a new folder, or pass "
                                  "--overwrite to replace it and everything in it")
        kept = next((p for pattern in ("*.ckpt", "events.out.tfevents.*", "hparams.yaml")
                     for p in out.rglob(pattern)), None)
        if kept is not None:
            raise FileExistsError(f"--out: {str(out)!r} holds a run's checkpoints or logs ({str(kept)!r}), which "
                                  "--overwrite would delete with it; name another folder (an export's own folder, or a "
                                  "new one)")


def _check_not_the_base(out: Path, model: str) -> None:
    """An export is written over `out`: not over the base model the checkpoint records, which it reads its config and
    tokenizer from (and without which the checkpoint could no longer be exported or resumed)."""
    from lightning_logra.paths import model_path

    base = Path(model_path(model))
    if base.is_dir() and (out.resolve() == base.resolve() or out.resolve() in base.resolve().parents):
        raise FileExistsError(f"--out: {str(out)!r} holds the run's base model ({str(base)!r}), which the checkpoint "
                              "needs to be exported or resumed, and which writing the export there would delete; name "
                              "another folder")


def _load(ckpt_path: Path) -> dict[str, Any]:
    """The checkpoint at `ckpt_path` (a sharded folder consolidated in this process), checked for damage and loaded
    without running code from it."""
    if ckpt_path.is_dir():
        verify_sums(ckpt_path)
        return load_sharded_whole(ckpt_path)
    if not ckpt_path.is_file():
        raise FileNotFoundError(f"--ckpt_path: no such checkpoint {str(ckpt_path)!r}")
    return load_verified(ckpt_path, map_location="cpu")


def _write(checkpoint: dict[str, Any], out: Path, lora_settings: dict | None, adapter: bool) -> None:
    """The checkpoint's policy into the (empty) folder `out`: the base model the run trained (its config and
    tokenizer, from the path the checkpoint records) takes the checkpoint's weights, strictly, in the dtype it was
    trained in. The reward and every other setting are not needed to export."""
    from lightning_logra.paths import model_path
    from lightning_logra.train import lora
    from lightning_logra.train.module import RLVRModule
    from lightning_logra.train.policy import export_policy

    hparams = checkpoint["hyper_parameters"]
    module = RLVRModule(model=hparams["model"], dtype=hparams.get("dtype", "float32"), reward="exact_match",
                        scoring={"timeout_s": None})
    module.configure_model()
    if lora_settings is not None:
        config = lora.LoRAConfig(**lora_settings)
        config.install(module.policy)
    module.load_state_dict(checkpoint["state_dict"])
    dtype = checkpoint.get(KEY, {}).get("weights_dtype")  # format 1 has no record: the module's dtype
    if dtype is not None:
        module.policy.to(getattr(torch, dtype))
    if adapter:
        lora.save_adapter(module.policy, config, model_path(module.hparams.model), out)
        module.tokenizer.save_pretrained(out)
        follow_umask(out)
        write_sums(out)
        return
    if lora_settings is not None:
        lora.merge_adapters_(module.policy)  # each adapted matrix becomes W₀ + s·B·A under its own name
    export_policy(module.policy, module.tokenizer, out)  # with its SHA256SUMS, its files following the umask


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning-logra export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt_path", required=True, help="a checkpoint written by `fit` (e.g. .../last.ckpt)")
    parser.add_argument("--out", required=True, help="the folder to write the transformers model into (new or empty)")
    parser.add_argument("--adapter", action="store_true",
                        help="a LoRA checkpoint: write its adapters alone, as peft saves them (default: merged)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out, and everything in it, if it is a folder that is not empty")
    args = parser.parse_args(argv)
    print(f"exported {args.ckpt_path} to {export_checkpoint(args.ckpt_path, args.out, args.adapter, args.overwrite)}")


if __name__ == "__main__":
    main()
