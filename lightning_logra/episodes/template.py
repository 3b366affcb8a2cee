"""The chat template's token ids between turns: an episode is carried as token ids, never re-rendered.

The next turn's prompt is the previous prompt's ids, the ids the engine sampled (the turn's stop token included),
and the ids the template puts after that stop token: the environment's messages (tool answers in the template's own
format) and the next assistant header. Those last ids come from rendering a stand-in conversation twice, without and
with the environment's messages, and taking what the second adds after the assistant's stop token; the tokens of the
real conversation are never rendered again, so what is trained is exactly what was sampled.

That only holds for a template that renders a conversation as a prefix of the same conversation with more turns:
one that rewrites an earlier turn when a later one follows (drops an earlier turn's reasoning, as Qwen3's does for
`<think>` blocks; re-renders an assistant turn) would train the model on tokens its next turn did not see. Such a
template is refused at set-up (`check_template`), naming what differs.
"""

from __future__ import annotations

from typing import Any

_STANDIN = "LOGRA-STANDIN-ANSWER"  # an assistant turn's content, found again in the rendered text
_REASONING = "<think>\nweighing the question\n</think>\n\n"  # how reasoning models write theirs


class TurnTemplate:
    """A tokenizer's chat template as an episode uses it: the first prompt's ids (tools shown), and the ids between
    turns. `stop_token_ids`: the tokens that end a turn (the engine's stop tokens)."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None, stop_token_ids: list[int]) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("model.episodes: episodes are rendered with the model's chat template, and "
                             "its tokenizer has none; use an instruct model's tokenizer (one with a chat template)")
        self.tokenizer, self.tools = tokenizer, tools or None
        self.stop_texts = [tokenizer.decode([token]) for token in stop_token_ids]

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The first turn's prompt: the conversation with the tools shown, and the assistant header."""
        return self.encode(self.render(messages, generation_prompt=True))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def between_turns(self, messages: list[dict[str, Any]]) -> list[int]:
        """The ids after an assistant turn's stop token: `messages` (the environment's) and the next assistant
        header, as the template renders them after a turn."""
        before, cut = self._turn()
        after = self.render([*before, *messages], generation_prompt=True)
        return self.encode(after[cut:])

    def _turn(self, content: str = _STANDIN) -> tuple[list[dict[str, Any]], int]:
        """A stand-in conversation ending with an assistant turn, and where in its text that turn's stop token ends."""
        conversation = [{"role": "user", "content": "question"}, {"role": "assistant", "content": content}]
        text = self.render(conversation, generation_prompt=False)
        end = text.rindex(_STANDIN) + len(_STANDIN)
        for stop in self.stop_texts:
            if text.startswith(stop, end):
                return conversation, end + len(stop)
        raise ValueError("model.episodes: the chat template does not end an assistant turn with a stop "
                         f"token (it renders {text[end:end + 40]!r} after the turn's text; the stop tokens are "
                         f"{self.stop_texts}), so a sampled turn cannot be continued token for token")


def check_template(template: TurnTemplate, later_role: str) -> None:
    """Refuses a chat template that is not prefix-preserving for episodes: the first prompt followed by a sampled turn
    must be the rendered conversation, and a turn (with reasoning) must render the same once the environment's
    messages (of `later_role`: "tool" answers, or a "user" observation) follow."""
    question = [{"role": "user", "content": "question"}]
    prompt = template.render(question, generation_prompt=True)
    for content in (_STANDIN, _REASONING + _STANDIN):
        conversation, cut = template._turn(content)
        turn = template.render(conversation, generation_prompt=False)
        if not turn.startswith(prompt):
            raise ValueError(
                "model.episodes: the chat template renders an assistant turn differently from how its "
                f"generation prompt begins it (the prompt ends {prompt[-40:]!r}, the turn reads "
                f"{turn[len(prompt) - 40:][:80]!r}), so the sampled ids would not be the conversation's; use a "
                "template whose generation prompt is the start of the assistant turn")
        message = {"role": later_role, "content": "more"} | ({"name": "tool"} if later_role == "tool" else {})
        later = template.render([*conversation, message], generation_prompt=True)
        if not later.startswith(turn[:cut]):
            what = "drops the earlier turn's reasoning" if content != _STANDIN else "re-renders the earlier turn"
            raise ValueError(
                f"model.episodes: the chat template {what} once a later turn follows (the turn read "
                f"{turn[len(prompt):cut]!r}, and with a later turn {later[len(prompt):cut]!r}), so the next turn would "
                "not see what was sampled; use a template that keeps every turn as it was (for Qwen3, one that keeps "
                "earlier <think> blocks), or model.episodes.max_turns: 1")
