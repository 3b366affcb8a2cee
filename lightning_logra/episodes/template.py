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

An environment's text (a tool's answer, an observation, a reset's text) stays text: the template is rendered with a
placeholder where it goes, the template's own text is encoded with its special tokens, and the environment's text
without them (`encode_text`), so an answer that spells `<|im_end|>` or `<|im_start|>system` cannot end a turn or begin
one.
"""

from __future__ import annotations

from typing import Any

_STANDIN = "LOGRA-STANDIN-ANSWER"  # an assistant turn's content, found again in the rendered text
_REASONING = "<think>\nweighing the question\n</think>\n\n"  # how reasoning models write theirs


def _slot(k: int) -> str:
    """Where the k-th environment text goes in a rendering (a template renders a message's content as it is)."""
    return f"[LOGRA-ENVIRONMENT-TEXT-{k}]"


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

    def prompt_pieces(self, messages: list[dict[str, Any]], added: str | None) -> list[list[int]]:
        """The first turn's prompt (the conversation with the tools shown, and the assistant header) as ids in pieces:
        the template's text before `added`, `added` itself (the environment's reset text, at the end of the last user
        message; as text, `encode_text`), and the template's text after it. `added` None: one piece."""
        if added is None:
            return [self.encode(self.render(messages, generation_prompt=True))]
        messages = [dict(m) for m in messages]
        last_user = max(k for k, message in enumerate(messages) if message["role"] == "user")
        messages[last_user]["content"] += _slot(0)
        return self._encode_around(self.render(messages, generation_prompt=True), [added])

    def encode(self, text: str) -> list[int]:
        """The template's own text: its special-token strings are its control tokens."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_text(self, text: str) -> list[int]:
        """An environment's text: a special-token string in it (`<eos>`, `<|im_start|>`) is split into ordinary
        tokens, never the control token it spells."""
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def between_turns(self, messages: list[dict[str, Any]]) -> list[int]:
        """The ids after an assistant turn's stop token: `messages` (the environment's, each content as text) and the
        next assistant header, as the template renders them after a turn."""
        before, cut = self._turn()
        slots = [{**message, "content": _slot(k)} for k, message in enumerate(messages)]
        after = self.render([*before, *slots], generation_prompt=True)
        pieces = self._encode_around(after[cut:], [message["content"] for message in messages])
        return [token for piece in pieces for token in piece]

    def _encode_around(self, rendered: str, texts: list[str]) -> list[list[int]]:
        """`rendered`, in which `_slot(k)` stands for `texts[k]`, as ids in pieces: the template's text before the
        first text, the first text, the template's text between, ..., the template's text after the last."""
        pieces, rest = [], rendered
        for k, text in enumerate(texts):
            if rendered.count(_slot(k)) != 1:
                raise ValueError(
                    "model.episodes: the chat template does not render an environment's message as the text it holds "
                    f"(once, unchanged: {rendered[:200]!r}), so its tokens could not be kept apart from the "
                    "template's; use a template that renders each message's content as it is")
            before, _, rest = rest.partition(_slot(k))
            pieces += [self.encode(before), self.encode_text(text)]
        return [*pieces, self.encode(rest)]

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
    template.between_turns([message])  # an environment's message is rendered as its text (or refused, saying so)
