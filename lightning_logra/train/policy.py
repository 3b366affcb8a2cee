"""The policy and its tokenizer, loaded from `model.model`, and what generation needs of them (`PromptCodec`: stop and
pad tokens, prompts as token ids)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_logra.base.waits import waiting_for
from lightning_logra.paths import PACKAGE_DIR, check_hub_model, checked_model_path, model_path
from lightning_logra.train.checkpoint import follow_umask
from lightning_logra.train.digests import DamagedCheckpoint, write_sums
from lightning_logra.train.strategies.base import Collectives

log = logging.getLogger(__name__)


def load_policy(model: str, dtype: str, gradient_checkpointing: bool) -> tuple[torch.nn.Module, Any]:
    """(policy in training mode, tokenizer) from a local folder (an export of this project's is checked against its
    SHA256SUMS first) or a hub name."""
    try:
        path = checked_model_path(model)  # an export's or a fetch's folder: its files as they were written
    except (FileNotFoundError, DamagedCheckpoint) as error:
        raise type(error)(f"model.model: {error}") from None
    if not Path(path).exists():
        check_hub_model(path)
    with waiting_for(f"loading the model {model}", log):  # a hub model may download for minutes first
        tokenizer = AutoTokenizer.from_pretrained(path)
        policy = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).train()
    if gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        policy.config.use_cache = False
    return policy, tokenizer


def load_reference(model: str, dtype: str, device: torch.device | str = "cpu") -> torch.nn.Module:
    """π_0: a frozen copy of the starting policy, loaded from the model's files (a resumed run's reference is still
    the run's start, not the checkpoint's weights), in eval mode, no parameter requiring a gradient. It costs one more
    copy of the weights in `dtype` (for a KL penalty or a measurement of the distance travelled)."""
    reference, _ = load_policy(model, dtype, gradient_checkpointing=False)
    reference.eval().requires_grad_(False)
    return reference.to(device)


def pad_token_id(tokenizer: Any) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def stop_token_ids(tokenizer: Any, policy: torch.nn.Module) -> list[int]:
    """The tokenizer's EOS and every EOS the model's generation config names."""
    ids = {tokenizer.eos_token_id}
    eos = getattr(policy.generation_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos])
    return sorted(i for i in ids if i is not None)


def encode_prompts(tokenizer: Any, prompts: list[str] | list[list[dict[str, str]]], chat_template: bool
                   ) -> list[list[int]]:
    """The token ids the rollout engine receives for each prompt. A conversation (a list of {"role", "content"}
    messages, TRL's conversational format) goes through the tokenizer's chat template whole, a system message
    included; a text prompt goes in as it is, or as the one user message of a chat with `chat_template`. A
    conversation that ends with an assistant message is that message begun (an answer prefix): the template renders
    it open, and generation continues it (TRL's `continue_final_message`)."""
    if not chat_template and all(isinstance(p, str) for p in prompts):
        return tokenizer(prompts)["input_ids"]
    if getattr(tokenizer, "chat_template", None) is None:
        # transformers' own error names neither the data nor the setting
        why = "model.chat_template is set" if chat_template else "the prompts are conversations (lists of messages)"
        raise ValueError(f"{why}, but the model's tokenizer has no chat template to format them with: give data.train "
                         f"(and data.val) text prompts, turn model.chat_template off, or use a model whose tokenizer "
                         f"has one (an instruct model's)")
    chats = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
    return [tokenizer.apply_chat_template(chat, add_generation_prompt=not begun, continue_final_message=begun,
                                          tokenize=True, return_dict=False)
            for chat in chats for begun in [chat[-1]["role"] == "assistant"]]


@dataclass(frozen=True)
class PromptCodec:
    """What generation needs of the tokenizer: prompts as token ids (`encode_prompts`), the stop and pad tokens,
    completions as text. The module makes it once the policy is loaded and hands it to where samples come from."""

    tokenizer: Any
    chat_template: bool
    stop_token_ids: list[int]
    pad_token_id: int

    @classmethod
    def of(cls, tokenizer: Any, policy: torch.nn.Module, chat_template: bool) -> PromptCodec:
        return cls(tokenizer, chat_template, stop_token_ids(tokenizer, policy), pad_token_id(tokenizer))

    def encode(self, prompts: list[str] | list[list[dict[str, str]]]) -> list[list[int]]:
        return encode_prompts(self.tokenizer, prompts, self.chat_template)


def completions_table(tokenizer: Any, prompt_ids: torch.Tensor, completion_ids: torch.Tensor,
                      rewards: torch.Tensor) -> str:
    """Prompts, completions and rewards as a markdown table (TensorBoard's Text tab)."""
    prompts = tokenizer.batch_decode(prompt_ids, skip_special_tokens=True)
    completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", "<br>")

    table = ["| prompt | completion | reward |", "|---|---|---|"]
    table += [f"| {cell(p)} | {cell(c)} | {float(r):.3g} |" for p, c, r in zip(prompts, completions, rewards)]
    return "\n".join(table)


def check_penalty_placement(beta: float, collectives: Collectives) -> None:
    """The KL penalty's reference is a whole copy of the weights in every process: refused where the weights are
    sharded (it would undo what sharding saves)."""
    if beta > 0 and collectives.shards_weights:
        raise ValueError(
            f"model.loss.beta={beta}: the KL penalty's reference model would be a whole, unsharded copy of the weights "
            "on every rank under SketchFSDPStrategy; train with SketchDDPStrategy, or set model.loss.beta 0")


def check_model_path(model: str) -> None:
    """`model.model`, refused before anything loads when it names no folder and is no hub id: a hub id is
    "org/name"; anything else that does not exist locally is a mistyped path."""
    if not Path(model_path(model)).exists() and (model.startswith((".", "/", "~")) or model.count("/") > 1):
        raise FileNotFoundError(f"model.model: no such model directory {model!r} (looked for from {Path.cwd()}, "
                                f"and for a `lightning_logra/...` path in the installed package {PACKAGE_DIR})")


def export_policy(policy: torch.nn.Module, tokenizer: Any, path: str | Path,
                  state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Save the policy and tokenizer as a transformers checkpoint (sketched layers keep the original layout);
    `state_dict`: the policy's weights when this process does not hold them whole (gathered from FSDP shards)."""
    policy.save_pretrained(path, state_dict=state_dict)
    tokenizer.save_pretrained(path)
    follow_umask(Path(path))
    write_sums(Path(path))  # checked when a run loads the folder (`load_policy`); `sha256sum -c SHA256SUMS` too
