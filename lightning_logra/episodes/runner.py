"""Multi-turn episodes on any rollout engine, token in and token out.

Each turn is one `engine.generate` call over the episodes still running (one completion each, seeded by (the
prompt's seed, the sample, the turn)); its sampled ids are appended to the episode's ids as they are, the environment
answers the turn's text (in its processes), and the template's ids for that answer (`TurnTemplate.between_turns`) are
appended after them. The next turn's prompt is the first prompt's ids followed by everything so far: nothing is
decoded and encoded again, so the tokens trained on are the tokens sampled. `sampled_mask` marks the sampled ones
(each turn's stop token included): the loss, its normalizers and every token sum count those alone.

An episode ends when a turn asks for nothing (its answer), when a turn is cut at `max_new_tokens` (no stop token),
when the environment says done or is lost, at `max_turns`, when the next answer would not fit the episode's token
budget, or past its deadline. All its turns are drawn in one engine call after another with the weights the engine
has (overlapped rollouts run the whole episode on their worker; with in-flight updates, each token records how many
landed before it was sampled, as for one turn).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from lightning_logra.base.batch import EPISODE_COLUMNS, Rollout, left_pad
from lightning_logra.base.hashing import stable_seed
from lightning_logra.episodes.environment import tool_schemas
from lightning_logra.episodes.processes import EnvironmentPool, EnvironmentSpec, Reply, spec_tools
from lightning_logra.episodes.template import TurnTemplate, check_template

log = logging.getLogger(__name__)


@dataclass
class _Episode:
    """One episode as it is drawn: its prompt's ids, then everything after them."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)  # 1: the engine sampled the token
    logprobs: list[float] = field(default_factory=list)
    in_flight: list[int] = field(default_factory=list)
    stats: dict[str, float] = field(
        default_factory=lambda: {**dict.fromkeys(EPISODE_COLUMNS, 0.0), "environment_reward": math.nan})
    live: bool = True
    has_environment: bool = True

    def add(self, ids: list[int], sampled: bool, logprobs: list[float] | None = None,
            in_flight: list[int] | None = None) -> None:
        self.ids += ids
        self.sampled += [int(sampled)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        # an answer's tokens: as many updates had landed as before the turn's last sampled token
        landed = self.in_flight[-1] if self.in_flight else 0
        self.in_flight += in_flight if in_flight is not None else [landed] * len(ids)


@dataclass(frozen=True)
class EpisodeLimits:
    """How long an episode may run (`model.episodes`: `max_turns`, `max_tokens`, `tool_timeout_s`, `timeout_s`)."""

    max_turns: int
    max_episode_tokens: int
    tool_timeout_s: float
    episode_timeout_s: float | None


class EpisodeRunner:
    """Draws a batch's episodes (`run`) with an engine, against the environments of `spec` in `workers` processes
    of `memory_gib` GiB each; `close` stops them."""

    def __init__(self, settings: EpisodeLimits, spec: EnvironmentSpec, tokenizer: Any, stop_token_ids: list[int],
                 pad_token_id: int, workers: int, memory_gib: float | None,
                 prompt_limit: tuple[int, str] | None = None) -> None:
        self.settings, self.spec, self.tokenizer = settings, spec, tokenizer
        # The longest first prompt, and where that limit comes from (`train.context.prompt_token_limit`: the model's
        # context less the episode's tokens); None: no limit. Set by the run once its engine has started.
        self.prompt_limit = prompt_limit
        self.stop_token_ids, self.pad_token_id = set(stop_token_ids), pad_token_id
        schemas = tool_schemas(spec_tools(spec),
                               "model.episodes.environment_factory" if spec.kind == "class" else "model.episodes.tools")
        self.template = TurnTemplate(tokenizer, schemas, stop_token_ids)
        self.environment_role = "user" if spec.kind == "gym" else "tool"
        check_template(self.template, self.environment_role)
        self.pool = EnvironmentPool(spec, workers, settings.tool_timeout_s, memory_gib)

    def close(self) -> None:
        self.pool.close()

    def run(self, engine: Any, batch: dict[str, list[Any]], n: int, sampling: Any, seeds: list[int]) -> Rollout:
        """n episodes of each prompt of `batch` (episode i = j·n + s is sample s of prompt j, seeded by seeds[j])."""
        started = time.monotonic()
        deadline = math.inf if self.settings.episode_timeout_s is None else started + self.settings.episode_timeout_s
        rows = [{key: values[j] for key, values in batch.items() if key != "prompt_ids"}
                for j in range(len(batch["prompt"]))]
        count = len(rows) * n
        env_s = 0.0
        t0 = time.monotonic()
        starts = self.pool.call("start", {i: (stable_seed(seeds[i // n], i % n), rows[i // n]) for i in range(count)})
        env_s += time.monotonic() - t0
        firsts = [self._first_prompt(rows[i // n]["prompt"], starts[i]) for i in range(count)]
        prompts = self._within_limit([pieces for pieces, _ in firsts])
        episodes = [_Episode(prompt, has_environment=started) for prompt, (_, started) in zip(prompts, firsts)]
        for turn in range(self.settings.max_turns):
            live = [i for i, episode in enumerate(episodes) if episode.live]
            if not engine.another_turn(bool(live)):
                break
            if not live:  # another rank's episodes go on, on an engine this rank generates with: join its call
                engine.generate([], 1, sampling, [])
                continue
            turn_seeds = [stable_seed(seeds[i // n], i % n, turn) for i in live]
            texts = self._turn(engine, episodes, live, sampling, turn_seeds)
            t0 = time.monotonic()
            replies = self.pool.call("respond", {i: (text,) for i, text in texts.items()})
            env_s += time.monotonic() - t0
            last = turn == self.settings.max_turns - 1 or time.monotonic() >= deadline
            for i, (status, reply) in replies.items():
                self._answer(episodes[i], status, reply, last)
        t0 = time.monotonic()
        finals = self.pool.call("finish", {i: () for i, e in enumerate(episodes) if e.has_environment})
        env_s += time.monotonic() - t0
        failed = []  # one warning for the batch: a reward() that is wrong is wrong in every episode (128 a step)
        for i, (status, value) in finals.items():
            if status == "ok" and value is not None:
                episodes[i].stats["environment_reward"] = value
            elif status == "error":  # reward() raised, or returned what is not a number: no reward of its own
                failed.append(str(value).strip()[-400:])
                episodes[i].stats["tool_errors"] += 1
        if failed:
            log.warning("%d of %d episodes' environments failed at their reward (the first: %s): those episodes have "
                        "no environment reward", len(failed), len(finals), failed[0])
        for episode in episodes:
            episode.stats["environment_s"] = env_s / count  # the batch's, shared out: its sum is the batch's
        return self._rollout(episodes)

    def _first_prompt(self, prompt: str | list[dict[str, str]], started: tuple[str, Any]
                      ) -> tuple[list[list[int]], bool]:
        """The episode's first prompt: the row's prompt (text: one user message), with what the environment's reset
        returned added to its last user message (as text: `TurnTemplate.encode_text`), and the tools shown; as ids in
        pieces (`TurnTemplate.prompt_pieces`), with whether the environment started."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        status, text = started
        if status != "ok":
            log.warning("an environment did not start (%s): its episode has one turn, without tools", text)
        return self.template.prompt_pieces(messages, text if status == "ok" and text else None), status == "ok"

    def _within_limit(self, prompts: list[list[list[int]]]) -> list[list[int]]:
        """Each first prompt's pieces joined, held to `prompt_limit` as the data module holds a dataset's prompts with
        data.overlong_prompts: truncate: the environment's reset text is cut to what fits (its start kept, as every
        environment text is cut); a prompt longer than the limit without it (the prompt and the tools' schemas) keeps
        its last tokens. Past the model's context, generation's memory would grow without bound; every later turn is
        held by the episode's token budget, which the limit leaves room for."""
        limit = None if self.prompt_limit is None else self.prompt_limit[0]
        held, cut_text, cut_prompt = [], 0, 0
        for pieces in prompts:
            ids = [token for piece in pieces for token in piece]
            if limit is not None and len(ids) > limit:
                without = pieces[0] + pieces[-1] if len(pieces) == 3 else ids  # (before, reset text, after)
                if len(without) <= limit:
                    ids = pieces[0] + pieces[1][: limit - len(without)] + pieces[2]
                    cut_text += 1
                else:
                    ids = without[-limit:]
                    cut_prompt += 1
            held.append(ids)
        if cut_text or cut_prompt:
            log.warning("%d of %d episodes' first prompts were longer than %d tokens (%s): %d had the environment's "
                        "reset text cut to fit (its start kept), %d were longer without it (the prompt and the tools' "
                        "schemas) and kept their last %d tokens", cut_text + cut_prompt, len(prompts), limit,
                        self.prompt_limit[1], cut_text, cut_prompt, limit)
        return held

    def _turn(self, engine: Any, episodes: list[_Episode], live: list[int], sampling: Any, seeds: list[int]
              ) -> dict[int, str]:
        """One turn of the live episodes, appended to them; returns the text of each turn the environment answers
        (one that ended with a stop token, of an episode with an environment)."""
        budget = self.settings.max_episode_tokens
        room = {i: budget - len(episodes[i].ids) for i in live}
        longest = max(min(sampling.max_new_tokens, room[i]) for i in live)
        out = engine.generate([episodes[i].prompt + episodes[i].ids for i in live], 1,
                              replace(sampling, max_new_tokens=longest), seeds)
        texts = {}
        for row, i in enumerate(live):
            episode, keep = episodes[i], out.completion_mask[row].bool().cpu()
            ids = out.completion_ids[row].cpu()[keep].tolist()[: room[i]]
            logprobs = out.sampler_logprobs[row].float().cpu()[keep].tolist()[: room[i]]
            in_flight = None if out.in_flight_updates is None else \
                out.in_flight_updates[row].cpu()[keep].tolist()[: room[i]]
            episode.add(ids, True, logprobs, in_flight)
            episode.stats["turns"] += 1
            stopped = bool(ids) and ids[-1] in self.stop_token_ids
            if stopped and episode.has_environment:
                texts[i] = self.tokenizer.decode(ids, skip_special_tokens=True)
            else:  # cut at the token limit, or nothing to answer it
                episode.live = False
        return texts

    def _answer(self, episode: _Episode, status: str, reply: Reply | str, last: bool) -> None:
        """The environment's reply to a turn, appended to the episode if another turn follows."""
        if status != "ok":
            log.warning("an episode's environment failed (%s): the episode ends", str(reply)[-400:])
            episode.has_environment = episode.live = False
            episode.stats["tool_errors"] += 1
            return
        for key, value in (("tool_calls", reply.calls), ("tool_errors", reply.errors),
                           ("invalid_calls", reply.invalid)):
            episode.stats[key] += value
        if reply.done or last:
            episode.live = False
            return
        answer = self.template.between_turns(reply.messages)
        if len(episode.ids) + len(answer) >= self.settings.max_episode_tokens:
            episode.live = False  # no room for the answer and a turn after it: the episode ends here
            return
        episode.add(answer, False)

    def conversations(self, rollout: Rollout) -> list[list[dict[str, str]]]:
        """Each episode after its prompt as messages, TRL's conversational form for the rewards: each turn the model
        sampled an assistant message, each stretch the environment added one of the environment's (its text as the
        template rendered it); the last message is the final turn, the one a reward reads as the answer."""
        conversations = []
        for ids, sampled, present in zip(rollout.completion_ids.cpu(), rollout.loss_mask.cpu(),
                                         rollout.completion_mask.cpu()):
            messages: list[dict[str, str]] = []
            length = int(present.sum())
            ids, sampled = ids[:length].tolist(), sampled[:length].tolist()
            start = 0
            for end in range(1, length + 1):
                if end == length or sampled[end] != sampled[start]:
                    role = "assistant" if sampled[start] else self.environment_role
                    messages.append({"role": role,
                                     "content": self.tokenizer.decode(ids[start:end], skip_special_tokens=True)})
                    start = end
            conversations.append(messages or [{"role": "assistant", "content": ""}])
        return conversations

    def _rollout(self, episodes: list[_Episode]) -> Rollout:
        prompt, prompt_mask = left_pad([e.prompt for e in episodes], self.pad_token_id, "cpu")
        width = max(1, max(len(e.ids) for e in episodes))

        def right(values: list[list], fill: float, dtype: torch.dtype) -> torch.Tensor:
            out = torch.full((len(values), width), fill, dtype=dtype)
            for row, value in enumerate(values):
                out[row, : len(value)] = torch.tensor(value, dtype=dtype)
            return out

        completion = right([e.ids for e in episodes], self.pad_token_id, torch.long)
        present = right([[1] * len(e.ids) for e in episodes], 0, torch.long)
        in_flight = right([e.in_flight for e in episodes], 0, torch.long)
        stats = torch.tensor([[e.stats[key] for key in EPISODE_COLUMNS] for e in episodes], dtype=torch.float32)
        return Rollout(prompt, prompt_mask, completion, present, right([e.logprobs for e in episodes], 0.0,
                                                                        torch.float32),
                       in_flight if any(any(e.in_flight) for e in episodes) else None,
                       right([e.sampled for e in episodes], 0, torch.long), stats)
