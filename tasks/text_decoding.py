"""Bytes of a JSONL or CSV file -> text: byte-order marks honoured (UTF-16/32 decoded), binary refused in one line.

Text without a byte-order mark is read as UTF-8 with ``errors="surrogateescape"``: a few undecodable bytes stay
in their rows (as U+DC80..U+DCFF) so that only those rows are quarantined as undecodable_bytes. A file that is
mostly not UTF-8 (binary, UTF-16 without a mark, an archive) is refused whole, since every row would be junk.
"""

from __future__ import annotations

import codecs
import re

from rlhf_core.data import DataError

ESCAPED_BYTE = re.compile("[\udc80-\udcff]")
"""What ``errors="surrogateescape"`` turns undecodable bytes into (U+DC80..U+DCFF)."""
SNIFF_BYTES = 64 * 1024
"""Leading bytes looked at to tell text from binary."""
NUL_FRACTION = 0.1
"""More NUL bytes than this share means not UTF-8 text: UTF-16 text of ASCII is about half NULs, while a few raw
NULs in a text file are row-level damage (control_character)."""
INVALID_FRACTION = 0.2
"""More bytes outside valid UTF-8 than this share means binary: random bytes score about 0.6, a Latin-1 text file a
few hundredths (its accented rows are quarantined one by one)."""

_BOMS = (  # UTF-32 first: its little-endian mark starts with UTF-16's
    (codecs.BOM_UTF32_LE, "utf-32", "UTF-32"), (codecs.BOM_UTF32_BE, "utf-32", "UTF-32"),
    (codecs.BOM_UTF8, "utf-8-sig", "UTF-8"),
    (codecs.BOM_UTF16_LE, "utf-16", "UTF-16"), (codecs.BOM_UTF16_BE, "utf-16", "UTF-16"),
)
_MAGIC = ((b"\x1f\x8b", "gzip-compressed data; add .gz to its name"),
          (b"PK\x03\x04", "a zip archive (an .xlsx workbook?); export it as CSV"),
          (b"PAR1", "Parquet; name it .parquet"))


def decode_text(uri: str, data: bytes) -> str:
    """The file's text. A UTF-8 mark is dropped; a UTF-16 or UTF-32 mark decodes the file in that encoding.

    Raises DataError naming the file when it is not text: a known binary format, mostly NUL bytes (UTF-16
    without a mark) or mostly invalid UTF-8, or when it has a UTF-16/32 mark but does not decode.
    """
    for bom, encoding, name in _BOMS:
        if not data.startswith(bom):
            continue
        if encoding == "utf-8-sig":
            data = data[len(bom):]
            break
        try:
            return data.decode(encoding)  # the utf-16/utf-32 codecs read the mark's byte order and drop it
        except UnicodeDecodeError as err:
            raise DataError(f"{uri}: starts with a {name} byte-order mark but is not valid {name} ({err.reason} at "
                            f"byte {err.start}); re-save it as UTF-8") from None
    refuse_binary(uri, data)
    return data.decode("utf-8", errors="surrogateescape")


def refuse_binary(uri: str, data: bytes) -> None:
    """DataError when the first SNIFF_BYTES of `data` do not look like UTF-8 text (see the module docstring)."""
    sample = data[:SNIFF_BYTES]
    for magic, what in _MAGIC:
        if sample.startswith(magic) and (magic != b"PAR1" or data.endswith(magic)):
            raise DataError(f"{uri}: is not UTF-8 text (looks like {what})")
    if not sample:
        return
    nuls = sample.count(0)
    if nuls > NUL_FRACTION * len(sample):
        odd = sample[1::2].count(0)
        if odd > 0.9 * nuls or nuls - odd > 0.9 * nuls:  # ASCII in UTF-16: every other byte is NUL
            order = "LE" if odd > 0.9 * nuls else "BE"
            raise DataError(f"{uri}: is not UTF-8 text (looks like UTF-16-{order} without a byte-order mark); "
                            "re-save it as UTF-8")
        raise DataError(f"{uri}: is not UTF-8 text (looks like binary data: {nuls} of its first {len(sample)} bytes "
                        "are NUL); expected UTF-8 JSON Lines or CSV")
    text = sample.decode("utf-8", errors="surrogateescape")
    invalid = len(ESCAPED_BYTE.findall(text[:-3]))  # the cut may split the last character
    if invalid > INVALID_FRACTION * len(sample):
        raise DataError(f"{uri}: is not UTF-8 text (looks like binary data: {invalid} of its first {len(sample)} "
                        "bytes are not valid UTF-8); expected UTF-8 JSON Lines or CSV")
