"""Observation tokens from the tokenizer's own chat template, rendered incrementally and
checked against the full render.

The trajectory's text so far (prompt + the model's sampled tokens + earlier observations,
decoded with special tokens) must be a prefix of the chat template's render of the whole
conversation with the new observation messages and the generation prompt; the observation's
tokens are the rest of that render, tokenised on their own. Rendering the conversation with
its full context (not message by message) keeps what the template does across messages,
e.g. Qwen's one user turn around consecutive ``tool`` messages.

When the prefix does not hold (a template that renders earlier turns differently once later
messages exist, e.g. dropping reasoning from past assistant turns; a model turn the template
would not produce), the event is counted and named (:class:`TemplateMismatch`), never
silent; the observation is then rendered after a stand-in assistant message (the way verl
and miles render observations) so the trajectory still keeps exactly its sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_async.types import Tokenizer


@dataclass
class TemplateMismatch:
    """Where the incremental render and the full render of the conversation part.

    Attributes:
        at: character index of the first difference in the trajectory's text.
        have: up to 60 characters of the trajectory's text from there.
        want: the same span of the full render.
        where: ``"observation"`` (before an observation was appended) or ``"final"``.
    """

    at: int
    have: str
    want: str
    where: str

    def describe(self) -> str:
        return (f"chat template mismatch ({self.where}) at char {self.at}: trajectory has {self.have!r}, "
                f"full render has {self.want!r}")


def first_difference(a: str, b: str) -> int:
    """Index of the first character where ``a`` and ``b`` differ (``min(len)`` when one is a
    prefix of the other)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class ChatRenderer:
    """Renders conversations with ``tokenizer.apply_chat_template`` (text, then tokenised with
    ``add_special_tokens=False``); ``tools``: OpenAI function schemas passed to the template."""

    def __init__(self, tokenizer: Tokenizer, tools: list[dict] | None = None):
        self.tokenizer = tokenizer
        self.tools = tools or None

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        if not isinstance(text, str):
            raise TypeError(f"the tokenizer's chat template gave {type(text).__name__}, not the text (tokenize=False)")
        return text

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The initial conversation with the generation prompt, as token ids."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def observation_ids(self, messages: list[dict], observations: list[dict],
                        trajectory_ids: list[int], last_turn_ids: list[int]) -> tuple[list[int], TemplateMismatch | None]:
        """Token ids to append after ``trajectory_ids`` for ``observations`` (chat messages),
        where ``messages`` is the conversation so far ending with the assistant turn whose
        sampled ids are ``last_turn_ids``. Returns ``(ids, None)``, or ``(ids, mismatch)`` when
        the trajectory's text is not a prefix of the full render (module docstring)."""
        have = self.decode(trajectory_ids)
        full = self.render(messages + observations, add_generation_prompt=True)
        if full.startswith(have):
            return self.encode(full[len(have):]), None
        at = first_difference(have, full)
        mm = TemplateMismatch(at=at, have=have[at:at + 60], want=full[at:at + 60], where="observation")
        return self.encode(self._local_suffix(messages, observations, last_turn_ids)), mm

    _MARK = "moe-async-turn-end-7f3a"

    def _local_suffix(self, messages: list[dict], observations: list[dict], last_turn_ids: list[int]) -> str:
        """The observation's text rendered after a stand-in assistant message (with the
        conversation's first system/user messages, as templates want one): what follows the
        stand-in's content, less the part the model already sampled (its end-of-turn token)."""
        firsts = [m for m in messages[:-1] if m.get("role") in ("system", "user")][:2]
        local = self.render(firsts + [{"role": "assistant", "content": self._MARK}] + observations,
                            add_generation_prompt=True)
        tail = local[local.rindex(self._MARK) + len(self._MARK):]
        sampled = self.decode(last_turn_ids)
        for k in range(min(len(sampled), len(tail)), 0, -1):  # drop what the model already wrote
            if sampled.endswith(tail[:k]):
                return tail[k:]
        return tail

    def final_check(self, messages: list[dict], trajectory_ids: list[int]) -> TemplateMismatch | None:
        """The finished trajectory against the full render of its conversation (without a
        generation prompt): the trajectory's text must be a prefix of it (what the template
        appends after the last model token, e.g. a newline after the end-of-turn token, is
        allowed to be missing)."""
        have = self.decode(trajectory_ids)
        full = self.render(messages, add_generation_prompt=False)
        if full.startswith(have):
            return None
        at = first_difference(have, full)
        return TemplateMismatch(at=at, have=have[at:at + 60], want=full[at:at + 60], where="final")
