"""Checks on single values: text fields, the optional margin, and the length limit."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Real
from typing import TYPE_CHECKING, Literal

from rlhf_core.data.reasons import QuarantineReason as R
from rlhf_core.data.records import Rejection
from rlhf_core.data.schema import CHOSEN, PROMPT, REJECTED

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Tab, newline and carriage return are ordinary in dialogues; every other C0 control (NUL first) and DEL
# is a sign of binary junk or a broken export.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")

LengthUnit = Literal["characters", "tokens"]


@dataclass(frozen=True)
class Measure:
    """Length of a text in the unit max_length is given in: characters, or tokens with a tokenizer."""

    unit: LengthUnit
    """What `count` counts; printed in the prep summary and in too_long details."""
    count: Callable[[str], int]
    """Length of one text in `unit`."""

    def __call__(self, text: str) -> int:
        return self.count(text)


def check_text(value: object, column: str) -> str | Rejection:
    """The value as a usable string, or the first reason it is not one.

    Order of checks: missing, NaN, bytes that are not UTF-8, non-text, lone surrogates, control
    characters, empty/whitespace-only. Valid UTF-8 bytes are decoded and accepted.
    """
    if value is None:
        return Rejection(R.MISSING_VALUE, column)
    if isinstance(value, float) and math.isnan(value):
        return Rejection(R.NAN_VALUE, column, value)
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as err:
            return Rejection(R.UNDECODABLE_BYTES, column, value, str(err))
    if not isinstance(value, str):
        return Rejection(R.NON_TEXT, column, value, f"got {type(value).__name__}")
    return check_string(value, column)


def check_string(text: str, column: str) -> str | Rejection:
    """Unicode, control-character and emptiness checks for a value already known to be a string."""
    if match := _SURROGATE.search(text):
        return Rejection(R.INVALID_UNICODE, column, text, f"U+{ord(match.group()):04X} at {match.start()}")
    if match := _CONTROL.search(text):
        return Rejection(R.CONTROL_CHARACTER, column, text, f"U+{ord(match.group()):04X} at {match.start()}")
    if not text.strip():
        return Rejection(R.EMPTY_TEXT, column, text)
    return text


def check_margin(value: object, column: str) -> float | None | Rejection:
    """The margin as a float, None when absent (null, NaN or empty string), or BAD_MARGIN.

    NaN counts as absent because pandas writes missing floats as NaN; infinities and bools are bad.
    Numeric strings (as every CSV cell is) are parsed.
    """
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = float(value)
        except ValueError:
            return Rejection(R.BAD_MARGIN, column, value, "not a number")
    if isinstance(value, bool) or not isinstance(value, Real):
        return Rejection(R.BAD_MARGIN, column, value, f"got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:  # an integer with hundreds of digits
        return Rejection(R.BAD_MARGIN, column, value, "too large for a float")
    if math.isnan(number):
        return None
    if math.isinf(number):
        return Rejection(R.BAD_MARGIN, column, value, "infinite")
    return number


def make_measure(tokenizer: PreTrainedTokenizerBase | None) -> Measure:
    """Characters when no tokenizer is given, else tokens (no special tokens added)."""
    if tokenizer is None:
        return Measure("characters", len)
    return Measure("tokens", lambda text: len(tokenizer.encode(text, add_special_tokens=False)))


def check_length(
    prompt: str, chosen: str, rejected: str, max_length: int | None, measure: Measure
) -> Rejection | None:
    """TOO_LONG for the first of prompt+chosen, prompt+rejected over max_length (None = no limit)."""
    if max_length is None:
        return None
    for column, response in ((CHOSEN, chosen), (REJECTED, rejected)):
        length = measure(prompt + response)
        if length > max_length:
            detail = f"prompt + {column} is {length} {measure.unit} > max_length {max_length}"
            return Rejection(R.TOO_LONG, column, response, detail)
    return None


def check_prompt_length(prompt: str, max_prompt_length: int | None, measure: Measure) -> Rejection | None:
    """PROMPT_TOO_LONG when the prompt alone is over max_prompt_length (None = no limit)."""
    if max_prompt_length is None:
        return None
    length = measure(prompt)
    if length <= max_prompt_length:
        return None
    detail = f"prompt is {length} {measure.unit} > max_prompt_length {max_prompt_length}"
    return Rejection(R.PROMPT_TOO_LONG, PROMPT, prompt, detail)


def check_chars(prompt: str, chosen: str, rejected: str, max_chars: int | None) -> Rejection | None:
    """FIELD_TOO_LONG for the first of prompt, chosen, rejected longer than max_chars characters (None = no cap)."""
    if max_chars is None:
        return None
    for column, value in ((PROMPT, prompt), (CHOSEN, chosen), (REJECTED, rejected)):
        if len(value) > max_chars:
            return Rejection(R.FIELD_TOO_LONG, column, value, f"{column} is {len(value)} characters > {max_chars}")
    return None
