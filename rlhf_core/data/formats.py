"""The three input formats (TRL, HH, chat), and turning one raw record into prompt/chosen/rejected text.

Which format a file is in is decided in `rlhf_core.data.detect`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from enum import Enum
from typing import NamedTuple

from rlhf_core.data.chat import ASSISTANT_TURN_MARKER, ChatRenderer, Message, check_messages
from rlhf_core.data.reasons import QuarantineReason as R
from rlhf_core.data.records import Rejection
from rlhf_core.data.schema import CHOSEN, PROMPT, REJECTED
from rlhf_core.data.text import check_text


class InputFormat(str, Enum):
    """Layout of a preference file; AUTO detects it per file from its rows' majority (see rlhf_core.data.detect)."""

    AUTO = "auto"
    TRL = "trl"
    """`prompt`, `chosen`, `rejected` text columns (optional `margin`)."""
    HH = "hh"
    """`chosen`, `rejected` full dialogues sharing the prompt as a prefix; no `prompt` column."""
    CHAT = "chat"
    """`chosen`, `rejected` (optional `prompt`) as lists of {role, content} messages."""


class PairText(NamedTuple):
    """Canonical text of one pair: the prompt and the two responses that continue it."""

    prompt: str
    chosen: str
    rejected: str


def record_to_text(values: Mapping[str, object], fmt: InputFormat, renderer: ChatRenderer) -> PairText | Rejection:
    """Prompt/chosen/rejected text of one parsed record in format `fmt` (not AUTO), or why it has none."""
    if fmt is InputFormat.TRL:
        return _trl_record(values)
    if fmt is InputFormat.HH:
        return _hh_record(values)
    if fmt is InputFormat.CHAT:
        return _chat_record(values, renderer)
    raise ValueError(f"record_to_text needs a concrete format, got {fmt}")


def _trl_record(values: Mapping[str, object]) -> PairText | Rejection:
    texts: list[str] = []
    for column in (PROMPT, CHOSEN, REJECTED):
        checked = check_text(values.get(column), column)
        if isinstance(checked, Rejection):
            return checked
        texts.append(checked)
    return PairText(*texts)


def _hh_record(values: Mapping[str, object]) -> PairText | Rejection:
    chosen = check_text(values.get(CHOSEN), CHOSEN)
    if isinstance(chosen, Rejection):
        return chosen
    rejected = check_text(values.get(REJECTED), REJECTED)
    if isinstance(rejected, Rejection):
        return rejected
    return split_dialogues(chosen, rejected)


def split_dialogues(chosen: str, rejected: str) -> PairText | Rejection:
    """Split two full dialogues at their longest shared prefix.

    The cut is just after the last ASSISTANT_TURN_MARKER inside the shared prefix when there is one,
    else at the prefix's last whitespace (which then starts both responses).
    """
    if chosen == rejected:
        return Rejection(R.IDENTICAL_PAIR, REJECTED, rejected)
    common = os.path.commonprefix([chosen, rejected])
    marker = common.rfind(ASSISTANT_TURN_MARKER)
    if marker >= 0:
        cut = marker + len(ASSISTANT_TURN_MARKER)
    else:
        cut = max((i for i, ch in enumerate(common) if ch.isspace()), default=0)
    if not chosen[:cut].strip():
        return Rejection(R.HH_NO_SHARED_PREFIX, CHOSEN, chosen, f"shared prefix {common[:40]!r}")
    for column, text in ((CHOSEN, chosen), (REJECTED, rejected)):
        if not text[cut:].strip():
            return Rejection(R.EMPTY_RESPONSE, column, text, "nothing follows the shared prompt")
    return PairText(chosen[:cut], chosen[cut:], rejected[cut:])


def _chat_record(values: Mapping[str, object], renderer: ChatRenderer) -> PairText | Rejection:
    conversations: list[list[Message]] = []
    for column in (CHOSEN, REJECTED):
        messages = check_messages(values.get(column), column)
        if isinstance(messages, Rejection):
            return messages
        if not messages or messages[-1]["role"] != "assistant":
            return Rejection(R.CHAT_NO_FINAL_ASSISTANT, column, messages)
        if not messages[-1]["content"].strip():
            return Rejection(R.EMPTY_RESPONSE, column, messages[-1], "the final assistant message is blank")
        conversations.append(messages)
    chosen, rejected = conversations
    if chosen[:-1] != rejected[:-1]:
        return Rejection(R.CHAT_PROMPT_MISMATCH, REJECTED, rejected[:-1])
    prefix = _chat_prompt_prefix(values.get(PROMPT))
    if isinstance(prefix, Rejection):
        return prefix
    return _render_chat([*prefix, *chosen[:-1]], chosen[-1], rejected[-1], renderer)


def _chat_prompt_prefix(value: object) -> list[Message] | Rejection:
    """Messages from the optional `prompt` column: none, a list of messages, or one user message."""
    if value is None:
        return []
    if isinstance(value, str) and not value.lstrip().startswith("["):
        checked = check_text(value, PROMPT)
        return checked if isinstance(checked, Rejection) else [{"role": "user", "content": checked}]
    return check_messages(value, PROMPT)


def _render_chat(
    messages: list[Message], chosen: Message, rejected: Message, renderer: ChatRenderer
) -> PairText | Rejection:
    if not messages:
        return Rejection(R.MISSING_VALUE, PROMPT, None, "no messages precede the final assistant reply")
    prompt = renderer.prompt(messages)
    responses: list[str] = []
    for column, reply in ((CHOSEN, chosen), (REJECTED, rejected)):
        response = renderer.response(messages, prompt, reply)
        if response is None:
            return Rejection(R.CHAT_TEMPLATE_MISMATCH, column, reply)
        responses.append(response)
    return PairText(prompt, *responses)
