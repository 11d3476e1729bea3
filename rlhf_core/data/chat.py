"""Chat messages -> prompt/response text: validation, and the ONE plain template used without a tokenizer.

Plain template (used when no tokenizer is given, or the tokenizer has no chat template). Each message
becomes one line `<Label>: <content>` ending in a newline, Label being System / User / Assistant; the
prompt ends with the generation cue `Assistant:`; the response is a space followed by the final
assistant message. For [user "Hi"] -> assistant "Hello!":

    prompt   = "User: Hi\\nAssistant:"
    response = " Hello!"

HH-style dialogues written with this template (or Anthropic's "\\n\\nHuman: ...\\n\\nAssistant: ...")
split at ASSISTANT_TURN_MARKER, so all three input formats yield the same canonical text.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from rlhf_core.data.reasons import QuarantineReason as R
from rlhf_core.data.records import Rejection

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = dict[str, str]

ROLES: tuple[str, ...] = ("system", "user", "assistant")
"""Roles a chat message may have."""
PLAIN_LABELS: dict[str, str] = {"system": "System", "user": "User", "assistant": "Assistant"}
"""Role -> line label in the plain template."""
GENERATION_CUE = "Assistant:"
"""What the plain-template prompt ends with."""
ASSISTANT_TURN_MARKER = "\n" + GENERATION_CUE
"""Turn boundary used to split HH dialogues; also matches Anthropic HH's "\\n\\nAssistant:"."""


def render_plain_prompt(messages: Sequence[Message]) -> str:
    """Plain-template prompt: one `Label: content` line per message, then the generation cue."""
    return "".join(f"{PLAIN_LABELS[m['role']]}: {m['content']}\n" for m in messages) + GENERATION_CUE


def render_plain_response(content: str) -> str:
    """Plain-template response: a space, then the reply (so prompt + response reads naturally)."""
    return " " + content


class ChatRenderer:
    """Renders validated messages with the tokenizer's chat template if it has one, else the plain one."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        has_template = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
        self._tokenizer = tokenizer if has_template else None

    @property
    def uses_tokenizer_template(self) -> bool:
        """Whether the tokenizer's chat template (not the plain one) is in use."""
        return self._tokenizer is not None

    def prompt(self, messages: Sequence[Message]) -> str:
        """The prompt text, ending where the assistant's reply starts."""
        if self._tokenizer is None:
            return render_plain_prompt(messages)
        return self._tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)

    def response(self, messages: Sequence[Message], prompt_text: str, reply: Message) -> str | None:
        """The reply's text as it continues `prompt_text` (TRL convention); None if the template
        does not render the prompt as a prefix of prompt + reply."""
        if self._tokenizer is None:
            return render_plain_response(reply["content"])
        full = self._tokenizer.apply_chat_template([*messages, reply], tokenize=False)
        return full[len(prompt_text) :] if full.startswith(prompt_text) else None


def check_messages(value: object, column: str) -> list[Message] | Rejection:
    """The value as a list of {role, content} messages, or the first reason it is not one.

    A string holding a JSON list (how chat columns look in CSV) is decoded first.
    """
    if value is None:
        return Rejection(R.MISSING_VALUE, column)
    if isinstance(value, float) and math.isnan(value):
        return Rejection(R.NAN_VALUE, column, value)
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except RecursionError:
            return Rejection(R.CHAT_NOT_A_LIST, column, value, "JSON nested too deeply to parse")
        except ValueError as err:
            return Rejection(R.CHAT_NOT_A_LIST, column, value, f"JSON error: {err}")
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        return Rejection(R.CHAT_NOT_A_LIST, column, value, f"got {type(value).__name__}")
    messages: list[Message] = []
    for index, message in enumerate(value):
        checked = _check_message(message, column, index)
        if isinstance(checked, Rejection):
            return checked
        messages.append(checked)
    return messages


def _check_message(message: object, column: str, index: int) -> Message | Rejection:
    if not isinstance(message, Mapping):
        return Rejection(R.CHAT_MALFORMED_MESSAGE, column, message, f"message {index} is {type(message).__name__}")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not isinstance(content, str):
        return Rejection(R.CHAT_MALFORMED_MESSAGE, column, message, f"message {index} lacks string role/content")
    if role not in ROLES:
        return Rejection(R.CHAT_UNKNOWN_ROLE, column, message, f"message {index} role {role!r}; expected {ROLES}")
    return {"role": role, "content": content}
