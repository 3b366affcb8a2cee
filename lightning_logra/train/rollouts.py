"""Where a run's samples come from, and how the engine that draws them stays equal to the trainer.

`Rollouts` holds the rollout engine (the policy itself, or vLLM with weights of its own), the weight sync that keeps
such an engine in step (`lightning_logra.rollout.WeightSync`, the RolloutWeightSync callback), and, with
`model.rollouts.max_staleness` > 0, the overlapped rollouts that generate the next steps while the trainer computes this
one (`rollout.pipeline.RolloutPipeline`). The module asks it for a step's samples (`draw`, `draw_round`, `generate`),
hands it every applied update (`sync`), and saves and restores its part of a checkpoint (`state`, `restore`);
`close` ends a run's use of it. Its life follows the module's hooks: `start_engine` in configure_model, `find_sync`
at the start of fit, `attach` before generation, `start` when training begins.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from lightning_logra.algo.update import Update
from lightning_logra.base.batch import Rollout
from lightning_logra.base.hashing import prompt_seeds
from lightning_logra.base.stop import StopRequested
from lightning_logra.episodes import EpisodeRunner
from lightning_logra.episodes.settings import episode_runner
from lightning_logra.paths import model_path
from lightning_logra.rollout import HFEngine, RolloutEngine, SamplingParams, WeightSync, find_sync
from lightning_logra.rollout.pipeline import EngineLost, RolloutPipeline
from lightning_logra.train.dynamic_sampling import Drawn
from lightning_logra.train.policy import pad_token_id

if TYPE_CHECKING:
    from lightning_logra.train.module import RLVRModule

log = logging.getLogger(__name__)


class Rollouts:
    """A run's rollout engine, its weight sync and its overlapped rollouts (see the module's doc).

    Args:
        module: the RLVRModule it draws for (its settings, tokenizer, policy, Trainer and collectives).
        engine: `model.rollouts.engine` (None: the in-process engine, the policy itself, made by `start_engine`).
    """

    def __init__(self, module: RLVRModule, engine: RolloutEngine | None) -> None:
        self.module = module
        self.engine = engine
        self.weight_sync: WeightSync | None = None  # None: the engine is the policy itself, nothing to sync
        # Generation overlapped with the update, during a fit; and what a checkpoint had in flight, until it starts.
        self.pipeline: RolloutPipeline | None = None
        self._in_flight: list[dict[str, Any]] = []
        # Multi-turn episodes (model.episodes.tools / model.episodes.environment_factory), drawn over the engine; None:
        # one turn
        self.episodes: EpisodeRunner | None = None

    # ---- the engine's life ------------------------------------------------------------------------------------------

    def start_engine(self) -> None:
        """The in-process engine when none is configured; an engine with weights of its own is started from the
        model's files (one per rank, beside that rank's trainer)."""
        module = self.module
        if self.episodes is None:
            hp = module.hparams
            self.episodes = episode_runner(hp.episodes, hp.sampling.max_new_tokens, module.tokenizer,
                                           module.stop_token_ids(), pad_token_id(module.tokenizer))
        if self.episodes is not None and self.engine is None and module.collectives.shards_weights:
            raise ValueError(
                "model.episodes under SketchFSDPStrategy with the in-process engine: each generation step of a sharded "
                "policy is a collective, and the ranks' episodes take different numbers "
                "of turns; set model.rollouts.engine (a VLLMEngine per rank, or engine servers) to draw episodes")
        if self.engine is None:
            self.engine = HFEngine(module.policy, module.stop_token_ids(), pad_token_id(module.tokenizer),
                                   all_finished=module.collectives.all_finished)
        if self.engine.samples_from(module.policy):
            return
        if module._trainer is not None and module.trainer.world_size > 1:
            # Every rank applies the same update (under FSDP to its shards; the engine gets whole factors), so each
            # rank's weight sync keeps its own engine in step (docs/vllm.md).
            self.engine.place(module.global_rank, module.trainer.world_size, module.trainer.strategy.root_device)
        if module._trainer is not None and module.trainer.log_dir is not None:
            self.engine.keep_logs_in(module.trainer.log_dir)
        self.engine.start(model_path(module.hparams.model), pad_token_id(module.tokenizer), module.stop_token_ids())

    def find_sync(self) -> None:
        """The run's weight sync; refused where it would sync nothing, required where the engine has weights of its
        own (it would sample from the model's initial files forever, silently)."""
        self.weight_sync = find_sync(self.module.trainer.callbacks)
        own_weights = not self.engine.samples_from(self.module.policy)
        if self.weight_sync is not None and not own_weights:
            raise ValueError(
                "RolloutWeightSync: the in-process engine generates with the policy's own weights, so there is nothing "
                "to sync; set model.rollouts.engine (e.g. class_path: lightning_logra.rollout.VLLMEngine) or remove "
                "the callback")
        if self.weight_sync is None and own_weights:
            raise ValueError(
                f"model.rollouts.engine: {type(self.engine).__name__} holds weights of its own, and nothing keeps them "
                "equal to the trainer's: add lightning_logra.callbacks.RolloutWeightSync to trainer.callbacks (the "
                "command line adds one unless its config lists one), or set model.rollouts.engine: null to generate "
                "with the policy")

    def attach(self) -> None:
        """Hand the engine to the weight sync, which loads what differs: before the first generation of a stage,
        once the weights are the ones it runs with (a resumed checkpoint's)."""
        if self.weight_sync is not None:
            module = self.module
            self.weight_sync.attach(self.engine, lambda: module.mode.engine_tensors(module.policy),
                                    module.max_over_ranks)

    def start(self) -> None:
        """With model.rollouts.max_staleness > 0 and an engine that runs beside the trainer, generate ahead from now
        on; with the in-process engine, which is the policy itself, the steps stay serial."""
        module = self.module
        k = module.hparams.rollouts.max_staleness
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
        trainer = module.trainer
        self.pipeline = RolloutPipeline(
            k, lambda batch, step: self.engine_call(batch, module.hparams.sampling.num_generations, module.sampling,
                                                    step),
            self.weight_sync.send, reload, iter(trainer.train_dataloader),
            start=module.global_step, last_step=trainer.max_steps - 1 if trainer.max_steps > 0 else None,
            in_flight=self.engine.updates_in_flight())
        self.pipeline.restore(self._in_flight)
        self._in_flight = []

    def finish_queued(self) -> None:
        """Let the engine finish what it was given (an evaluation uses it next)."""
        if self.pipeline is not None:
            self.pipeline.drain()

    def close(self) -> None:
        """What is queued is dropped (a call under way is waited for); an engine with its own processes is stopped
        between runs (the next run's configure_model starts it again)."""
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None
        if self.engine is not None and not self.engine.samples_from(self.module.policy):
            self.engine.close()
        if self.episodes is not None:
            self.episodes.close()  # the environment processes; started again by the next use

    # ---- samples ----------------------------------------------------------------------------------------------------

    def draw(self, batch: dict[str, list[Any]], step: int) -> tuple[Rollout, int, float]:
        """The step's samples, `num_generations` completions of each prompt of `batch`: generated now (the serial
        loop), or taken from what the engine generated ahead. Returns them with the step whose weights drew them and
        the seconds the trainer waited for them."""
        module = self.module
        start = time.perf_counter()
        if self.pipeline is None:
            rollout = self.generate(batch, module.hparams.sampling.num_generations, module.sampling, step)
            return rollout, step, time.perf_counter() - start
        rollout, version, wait_s = self.pipeline.take(batch, step)
        return rollout.to(module.device), version, wait_s

    def draw_round(self, step: int, round: int) -> Drawn:
        """Round `round` ≥ 1 of the step's dynamic sampling: the data module's extra prompts (`extra_batch`),
        generated now with the trainer's weights (with overlapped rollouts, on the engine's worker after what it was
        given: every update so far has reached it), and scored."""
        module = self.module
        n = module.hparams.sampling.num_generations
        batch = module.trainer.datamodule.extra_batch(step, round)
        call = self.engine_call(batch, n, module.sampling, step, round)
        rollout = (call() if self.pipeline is None else self.pipeline.call_now(call, step)).to(module.device)
        rewards, per_reward = module.score(batch, rollout, n)
        return Drawn(batch, rollout, rewards, per_reward, torch.zeros_like(rewards))

    def generate(self, batch: dict[str, list[Any]], n: int, sampling: SamplingParams, step: int) -> Rollout:
        """n completions of each prompt of `batch`, on the module's device (`engine_call`)."""
        return self.engine_call(batch, n, sampling, step)().to(self.module.device)

    def engine_call(self, batch: dict[str, list[Any]], n: int, sampling: SamplingParams, step: int, round: int = 0
                    ) -> Callable[[], Rollout]:
        """The engine call that samples n completions of each prompt of `batch` (the prompts tokenized now, the
        call made by whoever calls it: the overlapped rollouts' worker). Each prompt's sampling depends only on
        (seed, step, its index in the global batch, counting dynamic sampling's earlier rounds): a resumed run, or
        one sharded over several processes, draws what the uninterrupted single-process run would have."""
        module = self.module
        count, rank = len(batch["prompt"]), module.global_rank
        # (a module without a Trainer, evaluating by hand, draws round 0 only)
        first = (round * module.trainer.world_size + rank) * count if round else rank * count
        seeds = prompt_seeds(module.hparams.sampling.seed, step, first, count)
        if self.episodes is not None:  # each episode's first prompt is rendered with the tools it may call
            return partial(self.episodes.run, self.engine, batch, n, sampling, seeds)
        # Token ids come with the batch when the data module tokenized the prompts.
        prompt_ids = batch.get("prompt_ids") or module.encode_prompts(batch["prompt"])
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
        module = self.module
        if module.hparams.rollouts.max_staleness == 0:
            return {}
        tokens = rollout.loss_mask.bool()  # (N, C) the sampled tokens
        rows = staleness.to(module.device)[:, None].expand_as(tokens)[tokens]
        if rollout.in_flight_updates is None:
            ages, newer = rows, torch.zeros_like(rows)
        else:
            landed = rollout.in_flight_updates[tokens].float()
            ages, newer = (rows - landed).clamp(min=0), (landed > 0).float()
        mine = torch.stack([ages.sum(), newer.sum(), torch.tensor(float(ages.numel()), device=module.device)])
        total, fresher, count = module.sum_over_ranks(mine).unbind()
        worst = module.max_over_ranks(ages.amax().view(1) if ages.numel() else ages.new_zeros(1))[0]
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
            world = self.module.trainer.world_size
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
            in_flight, world = saved.get("in_flight", []), self.module.trainer.world_size
            if len(in_flight) == world:
                self._in_flight = in_flight[self.module.global_rank]
            elif in_flight:
                log.warning("the checkpoint's batches in flight were generated by %d processes, this run has %d: "
                            "they are generated again", len(in_flight), world)
        if self.engine is not None and "engine" in saved:
            self.engine.load_state_dict(saved["engine"])
