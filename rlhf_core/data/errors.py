"""The one exception the data-prep stage raises for problems with the user's files or settings."""

from __future__ import annotations


class DataError(Exception):
    """Input data that cannot be used at all: unreadable file, missing columns, too many bad rows.

    Row-level problems never raise this; they go to the quarantine table. The message always names the
    file (or setting), what was found and what was expected, so the CLI can print it as one line.
    """
