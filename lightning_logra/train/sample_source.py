"""Where a run's samples come from, and how the engine that draws them stays equal to the trainer.

`SampleSource` holds the rollout engine (the policy itself, or vLLM with weights of its own), the weight sync that
keeps such an engine in step (`lightning_logra.rollout.WeightSync`, the RolloutWeightSync callback), and, with
`model.rollouts.max_staleness` > 0, the overlapped rollouts that generate the next steps while the trainer computes this
one (`rollout.pipeline.RolloutPipeline`). It is given values, not the module: the engine and its settings, the prompt
codec, the collectives and where this process stands among the ranks (`bind`). The module asks it for a step's samples
(`draw`, `draw_now`, `generate`), hands it every applied update (`sync`), and saves and restores its part of a
checkpoint (`state`, `restore`); `close` ends a run's use of it. Its life follows the module's hooks: `bind` and
`start_engine` in configure_model, `use_sync` at the start of fit, `attach` before generation, `start` when training
begins.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from lightning_logra.algo.update import Update
from lightning_logra.base.batch import Rollout
from lightning_logra.base.hashing import prompt_seeds
from lightning_logra.base.resident import process_rss_reader
from lightning_logra.base.stop import StopRequested
from lightning_logra.episodes import EpisodeRunner
from lightning_logra.episodes.settings import EpisodeSettings, episode_runner
from lightning_logra.paths import model_path
from lightning_logra.rollout import HFEngine, RolloutEngine, SamplingParams, WeightSync
from lightning_logra.rollout.pipeline import EngineLost, RolloutPipeline
from lightning_logra.train.context import prompt_token_limit
from lightning_logra.train.policy import PromptCodec
from lightning_logra.train.settings import EvalSettings, RolloutSettings, SamplingSettings
from lightning_logra.train.strategies.base import Collectives

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """Where this process stands: its rank among `world_size`, the device its tensors go to, and the folder a
    launched engine keeps its logs in (None: none)."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    log_dir: str | None = None


class SampleSource:
    """A run's rollout engine, its weight sync and its overlapped rollouts (see the module's doc).

    Args:
        engine: `model.rollouts.engine` (None: the in-process engine, the policy itself, made by `start_engine`).
        settings: `model.rollouts`.
        sampling: `model.sampling` (the group size, the seed, the sampling parameters).
        episodes: `model.episodes` (None: one completion per prompt).
    """

    def __init__(self, engine: RolloutEngine | None, settings: RolloutSettings, sampling: SamplingSettings,
                 episodes: EpisodeSettings | None) -> None:
        self.engine = engine
        self.settings, self.episode_settings = settings, episodes
        self.n = sampling.num_generations
        self.seed, self.max_new_tokens = sampling.seed, sampling.max_new_tokens
        self.sampling = SamplingParams(sampling.temperature, sampling.top_p, sampling.max_new_tokens)
        self.codec: PromptCodec | None = None
        self.collectives = Collectives()
        self.placement = Placement()
        self.weight_sync: WeightSync | None = None  # None: the engine is the policy itself, nothing to sync
        # Generation overlapped with the update, during a fit; and what a checkpoint had in flight, until it starts.
        self.pipeline: RolloutPipeline | None = None
        self._in_flight: list[dict[str, Any]] = []
        # Multi-turn episodes (model.episodes), drawn over the engine; None: one turn
        self.episodes: EpisodeRunner | None = None
        self.engine_start_bytes = 0  # what starting an engine with weights of its own added to this process's RSS

    # ---- the engine's life ------------------------------------------------------------------------------------------

    def bind(self, codec: PromptCodec, collectives: Collectives, placement: Placement) -> None:
        """What the run knows once it is set up: the prompt codec, the collectives and this process's place."""
        self.codec, self.collectives, self.placement = codec, collectives, placement

    def start_engine(self, policy: nn.Module, model: str, sequences: int | None = None) -> None:
        """The in-process engine (over `policy`) when none is configured; an engine with weights of its own is started
        from the files of `model` (one per rank, beside that rank's trainer), told the most `sequences` one generation
        call will ask for (None: not known)."""
        codec, place = self.codec, self.placement
        if self.episodes is None:
            self.episodes = episode_runner(self.episode_settings, self.max_new_tokens, codec.tokenizer,
                                           codec.stop_token_ids, codec.pad_token_id)
        if self.episodes is not None and self.engine is None and self.collectives.shards_weights:
            raise ValueError(
                "model.episodes under SketchFSDPStrategy with the in-process engine: each generation step of a sharded "
                "policy is a collective, and the ranks' episodes take different numbers of turns; set "
                "model.rollouts.engine (a VLLMEngine per rank, or engine servers) to draw episodes")
        if self.engine is None:
            self.engine = HFEngine(policy, codec.stop_token_ids, codec.pad_token_id,
                                   all_finished=self.collectives.all_finished)
        if not self.engine.samples_from(policy):
            if place.world_size > 1:
                # Every rank applies the same update (under FSDP to its shards; the engine gets whole factors), so each
                # rank's weight sync keeps its own engine in step (docs/vllm.md).
                self.engine.place(place.rank, place.world_size, place.device)
            if place.log_dir is not None:
                self.engine.keep_logs_in(place.log_dir)
            if sequences is not None:
                self.engine.expect(sequences)
            resident = process_rss_reader()
            before = resident()
            self.engine.start(model_path(model), codec.pad_token_id, codec.stop_token_ids)
            # What the start added to this process (an engine in it: its weights and KV cache), for MemoryProfiler
            self.engine_start_bytes = resident() - before
        if self.episodes is not None:
            # An episode's first prompt is made here (the tools shown, the environment's reset text added): it is held
            # to the room the context leaves beside the episode's tokens, as the data module holds the dataset's
            # prompts (the engine's limit is known once it has started)
            self.episodes.prompt_limit = prompt_token_limit("fit", self.engine, policy, self.max_new_tokens, None,
                                                            self.episodes.settings.max_episode_tokens)

    def use_sync(self, weight_sync: WeightSync | None, policy: nn.Module) -> None:
        """The run's weight sync (the callbacks'); refused where it would sync nothing, required where the engine has
        weights of its own (it would sample from the model's initial files forever, silently)."""
        self.weight_sync = weight_sync
        own_weights = not self.engine.samples_from(policy)
        if weight_sync is not None and not own_weights:
            raise ValueError(
                "RolloutWeightSync: the in-process engine generates with the policy's own weights, so there is nothing "
                "to sync; set model.rollouts.engine (e.g. class_path: lightning_logra.rollout.VLLMEngine) or remove "
                "the callback")
        if weight_sync is None and own_weights:
            raise ValueError(
                f"model.rollouts.engine: {type(self.engine).__name__} holds weights of its own, and nothing keeps them "
                "equal to the trainer's: add lightning_logra.callbacks.RolloutWeightSync to trainer.callbacks (the "
                "command line adds one unless its config lists one), or set model.rollouts.engine: null to generate "
                "with the policy")

    def attach(self, engine_tensors: Callable[[], dict[str, torch.Tensor]]) -> None:
        """Hand the engine to the weight sync, which loads what differs (`engine_tensors`: what a full load sends):
        before the first generation of a stage, once the weights are the ones it runs with (a resumed checkpoint's)."""
        if self.weight_sync is not None:
            self.weight_sync.attach(self.engine, engine_tensors, self.collectives.max_over_ranks)

    def start(self, loader: Callable[[], Iterator[dict[str, list[Any]]]], first_step: int, last_step: int | None
              ) -> None:
        """With model.rollouts.max_staleness > 0 and an engine that runs beside the trainer, generate ahead from now
        on, the prompts of `loader()` (an iterator over the training loader, its batch for `first_step` next, made
        only then); with the in-process engine, which is the policy itself, the steps stay serial."""
        k = self.settings.max_staleness
        if k == 0:
            if self.engine.updates_in_flight():
                raise ValueError("model.rollouts.engine: in_flight updates reach the engine while it generates the "
                                 "steps ahead, and with model.rollouts.max_staleness=0 there are none: set "
                                 "model.rollouts.max_staleness to 1 (or more), or engine in_flight: false")
            return
        if not self.engine.runs_alongside():
            log.warning("model.rollouts.max_staleness=%d: %s cannot generate while the trainer computes (it runs in "
                        "the trainer's process), so the steps stay serial; use VLLMEngine with separate_process: true "
                        "to overlap them", k, type(self.engine).__name__)
            return

        # A restart on the worker cannot load the trainer's weights there (they are newer than what the engine's
        # queue expects): it fails the worker's calls instead, and the pipeline reloads and redraws on this thread.
        def reload_here():
            if self.pipeline is not None and self.pipeline.on_worker():
                raise EngineLost("the rollout engine was restarted during overlapped rollouts")
            return reload()

        reload = self.engine.reload_after_restart(reload_here)  # the sync's full load (or its refusal, sharded)
        self.pipeline = RolloutPipeline(
            k, lambda batch, step: self.engine_call(batch, self.n, self.sampling, step), self.weight_sync.send, reload,
            loader(), start=first_step, last_step=last_step, in_flight=self.engine.updates_in_flight())
        self.pipeline.restore(self._in_flight)
        self._in_flight = []

    def finish_queued(self) -> None:
        """Let the engine finish what it was given (an evaluation uses it next)."""
        if self.pipeline is not None:
            self.pipeline.drain()

    def close(self, policy: nn.Module | None) -> None:
        """What is queued is dropped (a call under way is waited for); an engine with its own processes is stopped
        between runs (the next run's configure_model starts it again)."""
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None
        if self.engine is not None and not self.engine.samples_from(policy):
            self.engine.close()
        if self.episodes is not None:
            self.episodes.close()  # the environment processes; started again by the next use

    # ---- samples ----------------------------------------------------------------------------------------------------

    def draw(self, batch: dict[str, list[Any]], step: int) -> tuple[Rollout, int, float]:
        """The step's samples, `num_generations` completions of each prompt of `batch`: generated now (the serial
        loop), or taken from what the engine generated ahead. Returns them with the step whose weights drew them and
        the seconds the trainer waited for them."""
        start = time.perf_counter()
        if self.pipeline is None:
            rollout = self.generate(batch, self.n, self.sampling, step)
            return rollout, step, time.perf_counter() - start
        rollout, version, wait_s = self.pipeline.take(batch, step)
        return rollout.to(self.placement.device), version, wait_s

    def draw_now(self, batch: dict[str, list[Any]], step: int, round: int) -> Rollout:
        """Round `round` ≥ 1 of the step's dynamic sampling, `batch` the data's extra prompts: generated now with the
        trainer's weights (with overlapped rollouts, on the engine's worker after what it was given: every update so
        far has reached it)."""
        call = self.engine_call(batch, self.n, self.sampling, step, round)
        return (call() if self.pipeline is None else self.pipeline.call_now(call, step)).to(self.placement.device)

    def generate(self, batch: dict[str, list[Any]], n: int, sampling: SamplingParams, step: int) -> Rollout:
        """n completions of each prompt of `batch`, on this process's device (`engine_call`)."""
        return self.engine_call(batch, n, sampling, step)().to(self.placement.device)

    def engine_call(self, batch: dict[str, list[Any]], n: int, sampling: SamplingParams, step: int, round: int = 0
                    ) -> Callable[[], Rollout]:
        """The engine call that samples n completions of each prompt of `batch` (the prompts tokenized now, the
        call made by whoever calls it: the overlapped rollouts' worker). Each prompt's sampling depends only on
        (seed, step, its index in the global batch, counting dynamic sampling's earlier rounds): a resumed run, or
        one sharded over several processes, draws what the uninterrupted single-process run would have."""
        count, place = len(batch["prompt"]), self.placement
        first = (round * place.world_size + place.rank) * count
        seeds = prompt_seeds(self.seed, step, first, count)
        if self.episodes is not None:  # each episode's first prompt is rendered with the tools it may call
            return partial(self.episodes.run, self.engine, batch, n, sampling, seeds)
        # Token ids come with the batch when the data module tokenized the prompts.
        prompt_ids = batch.get("prompt_ids") or self.codec.encode(batch["prompt"])
        return partial(self.engine.generate, prompt_ids, n, sampling, seeds)

    # ---- keeping the engine in step ---------------------------------------------------------------------------------

    def sync(self, update: Update | None, sampler_diff: float, stale: bool) -> dict[str, float]:
        """Send the applied update to an engine with weights of its own (and check it for drift when due); with
        overlapped rollouts, queue it behind the generations already submitted. A stale batch's log-prob
        difference measures the lag, not drift: it does not count towards a drift check."""
        if self.weight_sync is None:
            return {}
        try:
            if self.pipeline is None:
                return self.weight_sync.sync(update, sampler_diff)
            if update:
                self.pipeline.send(self.weight_sync.payload(update, copy=True))
            after = self.weight_sync.after_step(bool(update), math.nan if stale else sampler_diff,
                                                self.pipeline.drain)
            return {**self.pipeline.sent_metrics(), **after}
        except StopRequested as stop:
            # The update is applied: the step finishes, and SaveOnSignal saves it at its end (an exception here would
            # leave a step half done). The engine, killed, is started from the checkpoint's weights on resume.
            log.warning("%s: this step's update did not reach the engine; the step is saved at its end", stop)
            return {}

    def staleness_metrics(self, staleness: torch.Tensor, rollout: Rollout) -> dict[str, torch.Tensor]:
        """`rollout/staleness/mean` and `/max`: how many updates old the weights that drew the step's samples were
        (`staleness` (N,) per row: dynamic sampling's later rounds are drawn with the step's own weights), per token,
        over every rank's samples (a rank whose engine was restarted draws fresher ones). With in-flight updates,
        those drawn after an update landed are fresher, and `rollout/in_flight_tokens` is the share of tokens drawn
        after one."""
        if self.settings.max_staleness == 0:
            return {}
        device = self.placement.device
        tokens = rollout.loss_mask.bool()  # (N, C) the sampled tokens
        rows = staleness.to(device)[:, None].expand_as(tokens)[tokens]
        if rollout.in_flight_updates is None:
            ages, newer = rows, torch.zeros_like(rows)
        else:
            landed = rollout.in_flight_updates[tokens].float()
            ages, newer = (rows - landed).clamp(min=0), (landed > 0).float()
        mine = torch.stack([ages.sum(), newer.sum(), torch.tensor(float(ages.numel()), device=device)])
        total, fresher, count = self.collectives.sum_over_ranks(mine).unbind()
        worst = self.collectives.max_over_ranks(ages.amax().view(1) if ages.numel() else ages.new_zeros(1))[0]
        metrics = {"rollout/staleness/mean": total / count, "rollout/staleness/max": worst}
        if rollout.in_flight_updates is not None:
            metrics["rollout/in_flight_tokens"] = fresher / count
        return metrics

    # ---- checkpoints ------------------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of it: the engine's state (the updates it holds, counted after those queued are
        sent) and, with overlapped rollouts, the batches in flight on every rank."""
        state: dict[str, Any] = {}
        if self.engine is not None and self.engine.state_dict():
            try:
                self.finish_queued()
                state["engine"] = self.engine.state_dict()
            except StopRequested:
                pass  # updates left unsent: without the engine's state a resumed run loads its servers in full
        if self.pipeline is not None:
            # The batches in flight, finished (tokens, the sampler's log-probs, the step that drew them): every
            # rank's, which differ (each rank generates its slice of the batch); a resumed run trains on them.
            mine = self.pipeline.state()
            world = self.placement.world_size
            if world > 1:
                everyone: list = [None] * world
                torch.distributed.all_gather_object(everyone, mine)
            else:
                everyone = [mine]
            state["in_flight"] = everyone
        return state

    def restore(self, saved: dict[str, Any], fitting: bool) -> None:
        """A checkpoint's part (`state`): the engine's state, and when fitting, this rank's batches in flight (a
        resumed run trains on them first; generated again when the checkpoint had another number of ranks)."""
        if fitting:
            in_flight, world = saved.get("in_flight", []), self.placement.world_size
            if len(in_flight) == world:
                self._in_flight = in_flight[self.placement.rank]
            elif in_flight:
                log.warning("the checkpoint's batches in flight were generated by %d processes, this run has %d: "
                            "they are generated again", len(in_flight), world)
        if self.engine is not None and "engine" in saved:
            self.engine.load_state_dict(saved["engine"])


def sequences_per_call(trainer, sampling: SamplingSettings, evaluation: EvalSettings, fitting: bool) -> int | None:
    """The most sequences one generation call asks of the engine on this rank, which sizes vLLM's KV cache: a
    training step's prompts × model.sampling.num_generations when fitting, an evaluation batch's ×
    model.evaluation.num_samples otherwise (an evaluation during fit waits for room in the cache instead). None when
    there is no data module, or it does not say its batch."""
    data = getattr(trainer, "datamodule", None)
    prompts, n = ((getattr(data, "batch_size", None), sampling.num_generations) if fitting
                  else (getattr(data, "eval_batch_size", None), evaluation.num_samples))
    if isinstance(prompts, bool) or not isinstance(prompts, int) or prompts < 1:
        return None
    return -(-prompts // trainer.world_size) * n
