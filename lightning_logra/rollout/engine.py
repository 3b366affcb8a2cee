"""The rollout engine interface: prompts in, sampled completions (and the sampler's log-probs) out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_logra.algo.update import Update
from lightning_logra.base.batch import Rollout


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    max_new_tokens: int = 256


class RolloutEngine(ABC):
    """Generates completions. An engine with its own copy of the weights (vLLM) is kept equal to the trainer's by
    `RolloutWeightSync` through the four weight methods; all take and give the trainer's parameter names."""

    restarts = 0  # how many times the engine was restarted after its process died
    _reload: Callable[[], object] | None = None

    def reload_after_restart(self, load: Callable[[], object] | None) -> Callable[[], object] | None:
        """What a restarted engine calls to get the trainer's weights back (the weight sync's full load; None:
        nothing), before it retries the call its predecessor died in. Returns what it called until now."""
        previous, self._reload = self._reload, load
        return previous

    def place(self, rank: int, world_size: int, device: torch.device) -> None:
        """Called before `start` in a run of `world_size` processes: this is rank `rank`'s engine, beside its trainer
        on `device`. Each rank starts its own engine; a no-op for an engine without processes of its own."""

    def keep_logs_in(self, folder: str) -> None:
        """Where the run keeps its files (the trainer's log_dir), called before `start`: an engine that launches
        processes of its own writes their logs there. A no-op for the others."""

    def expect(self, sequences: int) -> None:
        """Called before `start`: the most sequences one generation call of the run asks for on this rank (a training
        step's prompts times their completions each). An engine that reserves memory per sequence (vLLM's KV cache)
        sizes itself by it; a no-op for the others."""

    def start(self, model: str, pad_token_id: int, stop_token_ids: list[int]) -> None:
        """Load `model` (a local directory) if the engine keeps its own copy; a no-op when already running."""

    @abstractmethod
    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingParams, seeds: list[int]) -> Rollout:
        """Sample n completions for each tokenized prompt; prompt j's completions depend only on seeds[j]."""

    @abstractmethod
    def load_weights(self, tensors: dict[str, torch.Tensor]) -> int:
        """Overwrite the named tensors with full copies; returns the bytes sent."""

    @abstractmethod
    def apply_update(self, update: Update) -> int:
        """Merge low-rank deltas (W −= F·A, A regenerated from its seed) and dense tensors; returns the bytes sent."""

    def read_trainer_tensors(self, tensors: Callable[[], dict[str, torch.Tensor]]) -> None:
        """Where the trainer's whole tensors are (what a full load sends), for an engine in the trainer's process
        that can read them in place of a copy of its own (VLLMEngine on the CPU backend); others ignore it."""

    @abstractmethod
    def fingerprints(self, names: list[str], seed: int) -> dict[str, torch.Tensor]:
        """`sync.fingerprint(W, seed)` of each named tensor, as the engine holds it."""

    @abstractmethod
    def weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Full copies of the named tensors as the engine holds them (for checks and tests: moves d·k numbers)."""

    def max_model_len(self) -> int | None:
        """The longest prompt + completion the engine takes, when it sets one of its own (None: the model's)."""
        return None

    def memory_bytes(self) -> int | None:
        """Memory the engine holds outside the trainer's process (None: none of its own, e.g. the in-process engine,
        whose memory is the trainer's)."""
        return None

    def runs_alongside(self) -> bool:
        """Whether `generate` may run on another thread while the trainer computes (overlapped rollouts): the engine
        computes in processes of its own, and its calls touch nothing of the trainer's."""
        return False

    def updates_in_flight(self) -> bool:
        """Whether, with overlapped rollouts, an update may reach the engine while it generates (between decoding
        steps, the completions under way kept) instead of after its generations: RemoteEngine(in_flight=True)."""
        return False

    def another_turn(self, live: bool) -> bool:
        """Whether episodes take another turn, this rank's being `live` (some still going): an engine whose ranks
        generate together (a tensor-parallel engine in the trainer's ranks) goes on while any rank's are, and a rank
        with none left calls `generate` with no prompts, so that every rank makes as many calls."""
        return live

    def samples_from(self, policy) -> bool:
        """Whether the engine samples from `policy`'s own weights; if not, they must be kept in step (synced)."""
        return False

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the engine, besides the trainer's weights ({}: nothing). RemoteEngine keeps its
        run id and weight version, with which a resumed run finds where its servers stand."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's `state_dict`, after `start` (the engine is up) and before the weight sync attaches."""

    def close(self) -> None:
        """Release the engine's processes and memory."""
