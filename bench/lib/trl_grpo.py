"""One run of TRL's GRPOTrainer on the recipe of a lightning-logra config, in a process of its own (the TRL rows of
bench/frameworks.py): `python -m bench.lib.trl_grpo SPEC.json`.

The spec (JSON) holds the run's lightning-logra config (`config`: its data module's prompts, its reward, sampling,
loss, clipping and batch are what TRL gets), `method` ("full": every parameter by AdamW; "lora": a PEFT LoRA adapter
on `targets` at `rank`, merged into the weights at the end), `lr`, `seed`, `steps`, `generation` ("transformers":
transformers' generate; "vllm": TRL's vLLM colocate mode) and `out`, a folder that receives:

- `model/`: the trained model as a transformers folder (the tokenizer beside it), for the one evaluation every row
  gets (`lightning-logra validate` on it);
- `steps.json`: per optimizer step its seconds and their parts (generation: TRL's `_generate`; scoring: its
  `_calculate_rewards`; the update: the rest), the peak resident memory of the process during the step (sampled as
  `MemoryProfiler` samples), the completion and trained token counts, and the mean reward.

TRL's batch is the config's: `data.batch_size` prompts × `model.sampling.num_generations` completions an optimizer
step, generated once (steps_per_generation = gradient_accumulation_steps) and trained in micro-batches of
`model.training.micro_batch_size` completions; one pass over them (num_iterations 1: on-policy, as the config); no KL
penalty (beta 0), a constant learning rate, fp32, AdamW without weight decay, as the dense rows of bench/tasks.py.
Prompts are the data module's training set, as the text whose tokens this project's engine receives (`rendered`), the
reward the config's own object (TRL calls it as this project's trainer does).
"""

from __future__ import annotations

import json
import sys
import time
from importlib import import_module
from pathlib import Path

import torch
from transformers import TrainerCallback

from lightning_logra.base.resident import process_rss_reader
from lightning_logra.callbacks.memory import StepSampler
from lightning_logra.paths import model_path
from lightning_logra.train.policy import encode_prompts


def built(value: dict):
    """A config's {class_path, init_args} as the object it names."""
    module, _, name = value["class_path"].rpartition(".")
    return getattr(import_module(module), name)(**(value.get("init_args") or {}))


def rendered(tokenizer, prompt: str | list[dict[str, str]]) -> str:
    """A prompt as the text whose tokens this project's engine receives (`policy.encode_prompts`): TRL 1.16 renders a
    conversation with a generation prompt, closing an answer begun in its last (assistant) message and starting
    another turn, where this project continues that message; as text, TRL tokenizes it as it stands."""
    if isinstance(prompt, str):
        return prompt
    begun = prompt[-1]["role"] == "assistant"
    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=not begun, continue_final_message=begun,
                                         tokenize=False)
    if tokenizer(text)["input_ids"] != encode_prompts(tokenizer, [prompt], False)[0]:
        raise SystemExit("trl_grpo: the rendered prompt's tokens differ from what this project's engine receives")
    return text


def reward_function(reward, seconds: list[float]):
    """The config's reward as TRL calls a reward function (TRL names it by `__name__`); its seconds added up."""

    def reasoning_gym(prompts, completions, **columns):
        start = time.perf_counter()
        try:
            return reward(prompts, completions, **columns)
        finally:
            seconds.append(time.perf_counter() - start)

    return reasoning_gym


def main(spec_path: str) -> None:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    config, out = spec["config"], Path(spec["out"])
    model_cfg = config["model"]
    sampling, training, loss = model_cfg["sampling"], model_cfg.get("training") or {}, model_cfg.get("loss") or {}
    datamodule, reward = built(config["data"]), built(model_cfg["reward"])
    rows = datamodule.make_train_set()
    path = model_path(model_cfg["model"])
    tokenizer = AutoTokenizer.from_pretrained(path)
    # the entry as JSON text: arrow would give every task's metadata one schema
    dataset = Dataset.from_list([{"prompt": rendered(tokenizer, row["prompt"]), "task": row["task"],
                                  "entry": json.dumps(row["entry"])} for row in (rows[i] for i in range(len(rows)))])
    n = sampling["num_generations"]
    completions_per_step = datamodule.batch_size * n
    micro = min(training.get("micro_batch_size", completions_per_step), completions_per_step)
    args = GRPOConfig(
        output_dir=str(out / "trl"), seed=spec["seed"], data_seed=spec["seed"], max_steps=spec["steps"],
        per_device_train_batch_size=micro, gradient_accumulation_steps=completions_per_step // micro,
        num_generations=n, max_completion_length=sampling["max_new_tokens"], temperature=sampling["temperature"],
        top_p=sampling.get("top_p", 1.0), top_k=0, loss_type=loss.get("type", "dapo"), beta=0.0, num_iterations=1,
        epsilon=loss.get("epsilon", 0.2), scale_rewards=loss.get("scale_rewards", "group"),
        mask_truncated_completions=loss.get("mask_truncated_completions", False),
        max_grad_norm=training.get("max_grad_norm", 1.0), learning_rate=spec["lr"], lr_scheduler_type="constant",
        warmup_steps=0, optim="adamw_torch", weight_decay=0.0, bf16=False, fp16=False, use_cpu=True,
        use_vllm=spec["generation"] == "vllm", vllm_mode="colocate", vllm_gpu_memory_utilization=0.2,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    peft = None
    if spec["method"] == "lora":
        peft = LoraConfig(r=spec["rank"], lora_alpha=2 * spec["rank"], lora_dropout=0.0,
                          target_modules=spec["targets"], task_type="CAUSAL_LM")
    scoring: list[float] = []
    trainer = GRPOTrainer(model=model, reward_funcs=reward_function(reward, scoring), args=args,
                          train_dataset=dataset, processing_class=tokenizer, peft_config=peft)
    generating: list[float] = []
    generate = trainer._generate

    def timed_generate(prompts):
        start = time.perf_counter()
        try:
            return generate(prompts)
        finally:
            generating.append(time.perf_counter() - start)

    trainer._generate = timed_generate
    steps: list[dict] = []
    trainer.add_callback(StepRecord(steps, generating, scoring))
    trainer.train()
    trained = trainer.model.merge_and_unload() if peft is not None else trainer.model
    trained.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    (out / "steps.json").write_text(json.dumps(steps))


class StepRecord(TrainerCallback):
    """Each optimizer step's seconds, their parts (what `generating` and `scoring` collected during it) and the
    process's peak resident memory, appended to `steps`; TRL's logged means (reward, completion length, tokens seen)
    added once it logs them."""

    def __init__(self, steps: list[dict], generating: list[float], scoring: list[float]) -> None:
        self.steps, self.generating, self.scoring = steps, generating, scoring

    def on_step_begin(self, args, state, control, **kwargs):
        self.generating.clear()
        self.scoring.clear()
        self.sampler = StepSampler(process_rss_reader())
        self.sampler.start()
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        seconds = time.perf_counter() - self.start
        _, peak = self.sampler.stop()
        generation, score = sum(self.generating), sum(self.scoring)
        self.steps.append({"step_s": seconds, "generation_s": generation, "score_s": score,
                           "update_s": seconds - generation - score, "peak_gib": peak / 2**30})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and self.steps and "reward" in logs:
            self.steps[-1].update(reward=logs["reward"], completion_length=logs.get("completions/mean_length"),
                                  num_tokens=logs.get("num_tokens"))


if __name__ == "__main__":
    main(sys.argv[1])
