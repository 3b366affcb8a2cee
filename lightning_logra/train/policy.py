"""The policy and its tokenizer, loaded from `model.model`, and what generation needs of them (stop and pad tokens,
prompts as token ids)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_logra.base.waits import waiting_for
from lightning_logra.paths import check_hub_model, model_path
from lightning_logra.train.digests import verify_sums

log = logging.getLogger(__name__)


def load_policy(model: str, dtype: str, gradient_checkpointing: bool) -> tuple[torch.nn.Module, Any]:
    """(policy in training mode, tokenizer) from a local folder (an export of this project's is checked against its
    SHA256SUMS first) or a hub name."""
    path = model_path(model)
    if not Path(path).exists():
        check_hub_model(path)
    elif not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"model.model: {path!r} has no config.json; point it at a save_pretrained folder")
    else:
        verify_sums(Path(path))  # an export of this project's: its files as they were written
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
