"""Why a row was quarantined: one Enum of reason codes, each with a human message."""

from __future__ import annotations

from enum import Enum


class QuarantineReason(str, Enum):
    """Reason code stored in the quarantine table's `reason` column (the Enum value)."""

    MALFORMED_RECORD = "malformed_record"
    MISSING_VALUE = "missing_value"
    EMPTY_TEXT = "empty_text"
    NAN_VALUE = "nan_value"
    NON_TEXT = "non_text"
    UNDECODABLE_BYTES = "undecodable_bytes"
    INVALID_UNICODE = "invalid_unicode"
    CONTROL_CHARACTER = "control_character"
    BAD_MARGIN = "bad_margin"
    IDENTICAL_PAIR = "identical_pair"
    TOO_LONG = "too_long"
    PROMPT_TOO_LONG = "prompt_too_long"
    FIELD_TOO_LONG = "field_too_long"
    FORMAT_MISMATCH = "format_mismatch"
    DUPLICATE_PAIR = "duplicate_pair"
    DUPLICATE_PROMPT = "duplicate_prompt"
    HH_NO_SHARED_PREFIX = "hh_no_shared_prefix"
    EMPTY_RESPONSE = "empty_response"
    CHAT_NOT_A_LIST = "chat_not_a_list"
    CHAT_MALFORMED_MESSAGE = "chat_malformed_message"
    CHAT_UNKNOWN_ROLE = "chat_unknown_role"
    CHAT_NO_FINAL_ASSISTANT = "chat_no_final_assistant"
    CHAT_PROMPT_MISMATCH = "chat_prompt_mismatch"
    CHAT_TEMPLATE_MISMATCH = "chat_template_mismatch"

    @property
    def message(self) -> str:
        """One sentence saying what is wrong with the row (and, where it helps, how to fix it)."""
        return _MESSAGES[self]


_MESSAGES: dict[QuarantineReason, str] = {
    QuarantineReason.MALFORMED_RECORD: "the record could not be parsed (bad JSON line, not an object, "
    "or a CSV row with the wrong number of fields)",
    QuarantineReason.MISSING_VALUE: "a required value is missing (null or absent key)",
    QuarantineReason.EMPTY_TEXT: "the text is empty or whitespace only",
    QuarantineReason.NAN_VALUE: "the value is NaN where text was expected",
    QuarantineReason.NON_TEXT: "the value is not text (number, bool, list or object where a string was expected)",
    QuarantineReason.UNDECODABLE_BYTES: "the value holds bytes that are not valid UTF-8",
    QuarantineReason.INVALID_UNICODE: "the text holds lone surrogate code points (not valid Unicode)",
    QuarantineReason.CONTROL_CHARACTER: "the text holds NUL or other control characters (other than tab/newline)",
    QuarantineReason.BAD_MARGIN: "the margin is not a finite number (leave it empty for no margin)",
    QuarantineReason.IDENTICAL_PAIR: "chosen and rejected are identical, so the pair carries no preference",
    QuarantineReason.TOO_LONG: "prompt + response is longer than the configured max_length (tokens with a "
    "tokenizer, else characters)",
    QuarantineReason.PROMPT_TOO_LONG: "the prompt is longer than data.prep.max_prompt_length (tokens with a "
    "tokenizer, else characters), which keeps room for a reply within the model's positions",
    QuarantineReason.FIELD_TOO_LONG: "one text is longer than data.prep.max_chars characters (a guard against "
    "runaway rows; raise it if such texts are expected)",
    QuarantineReason.FORMAT_MISMATCH: "the row is laid out as another format than most rows of its file "
    "(fix the row, split the file by format, or force one with --format)",
    QuarantineReason.DUPLICATE_PAIR: "the same prompt + chosen + rejected appeared earlier; the first is kept",
    QuarantineReason.DUPLICATE_PROMPT: "the same prompt appeared earlier in the prompts file; the first is kept",
    QuarantineReason.HH_NO_SHARED_PREFIX: "the chosen and rejected dialogues share no prompt prefix",
    QuarantineReason.EMPTY_RESPONSE: "the response is empty after splitting off the shared prompt",
    QuarantineReason.CHAT_NOT_A_LIST: "a chat value must be a list of {role, content} messages",
    QuarantineReason.CHAT_MALFORMED_MESSAGE: "a chat message is not an object with string `role` and `content`",
    QuarantineReason.CHAT_UNKNOWN_ROLE: "a chat message has a role other than system, user or assistant",
    QuarantineReason.CHAT_NO_FINAL_ASSISTANT: "the conversation does not end with an assistant message",
    QuarantineReason.CHAT_PROMPT_MISMATCH: "chosen and rejected conversations differ before the final reply "
    "(give a `prompt` column or make the earlier turns identical)",
    QuarantineReason.CHAT_TEMPLATE_MISMATCH: "the tokenizer's chat template does not render the prompt as a "
    "prefix of prompt + reply",
}
