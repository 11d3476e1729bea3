"""Reading user preference files (Parquet, JSONL, CSV; local paths or URIs) into rlhf_core SourceFile records.

Tolerant per record: a bad or too deeply nested JSON line, or a ragged CSV row, becomes a SourceRow with a parse
error, later quarantined. Strict per file: a file that cannot be used at all (missing, a directory, a symlink loop,
unreadable, corrupt compression, not UTF-8 text, unparseable as a whole) raises ONE DataError naming it, which
the CLI prints as one line. Only OSErrors of remote filesystems that may pass (network, busy storage) propagate
as they are, so the stage's retry can take them.
"""

from __future__ import annotations

import csv
import errno
import io
import json
import os
import stat
import sys

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from rlhf_core.data import DataError, SourceFile, SourceRow
from tasks.text_decoding import ESCAPED_BYTE, decode_text

PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
CSV_SUFFIXES = (".csv",)
COMPRESSION_CODECS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".lz4": "lz4"}
"""Compression suffix -> pyarrow codec; stripped before the format suffix is read (Parquet compresses inside)."""
COMPRESSION_SUFFIXES = tuple(COMPRESSION_CODECS)

_PERMANENT_OS_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)
_ERRNO_PROBLEMS = {
    errno.ENOENT: "no such file",
    errno.ENOTDIR: "no such file (a part of the path is not a directory)",
    errno.EISDIR: "is a directory, not a file; give the file(s) inside it",
    errno.ELOOP: "is a symlink loop (too many levels of symbolic links); point the path at the real file",
    errno.EACCES: "cannot be read: permission denied; make it readable (chmod +r) or copy it somewhere readable",
    errno.EPERM: "cannot be read: operation not permitted; make it readable or copy it somewhere readable",
    errno.ENAMETOOLONG: "cannot be opened: the path is too long",
}
"""errno -> what to print after the file name (the rest print the error itself)."""
_ERRNO_OF = {FileNotFoundError: errno.ENOENT, NotADirectoryError: errno.ENOTDIR, IsADirectoryError: errno.EISDIR,
             PermissionError: errno.EACCES}
"""For filesystems that raise the typed error without an errno."""


def read_source(uri: str) -> SourceFile:
    """All records of one Parquet / JSONL / CSV file (local path or any pyarrow/fsspec URI), optionally compressed.

    Raises DataError naming the file when it cannot be used at all (see the module docstring). OSErrors of a
    remote filesystem that may pass propagate so a caller may retry them.
    """
    suffix, codec = _suffixes(uri)
    fs, path = _filesystem(uri)
    local = isinstance(fs, pafs.LocalFileSystem)
    try:
        _check_is_file(uri, fs, path, local)
        if suffix in PARQUET_SUFFIXES:
            return _read_parquet(uri, fs, path)
        data = _read_local(path) if local else _read_remote(fs, path)
    except OSError as err:
        if not local and not isinstance(err, _PERMANENT_OS_ERRORS):
            raise
        raise DataError(f"{uri}: {_os_problem(err)}") from err
    except pa.ArrowException as err:  # a corrupt or unsupported Parquet file
        raise DataError(f"{uri}: cannot be read ({_first_line(err)})") from err
    if codec is not None:
        data = _decompress(uri, data, codec)
    text = decode_text(uri, data)
    return _parse_csv(uri, text) if suffix in CSV_SUFFIXES else _parse_json(uri, text)


def _suffixes(uri: str) -> tuple[str, str | None]:
    """The format suffix and the compression codec (None when not compressed)."""
    name = uri.rstrip("/").rsplit("/", 1)[-1].lower()
    stem, last = os.path.splitext(name)
    codec = COMPRESSION_CODECS.get(last)
    suffix = os.path.splitext(stem)[1] if codec else last
    known = (*PARQUET_SUFFIXES, *JSONL_SUFFIXES, *CSV_SUFFIXES)
    if suffix not in known:
        raise DataError(f"{uri}: unsupported file type {suffix or '(no suffix)'!r}; expected one of "
                        f"{', '.join(known)} (optionally compressed)")
    return suffix, codec


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """pyarrow filesystem + path: local paths directly, URIs via pyarrow, else via fsspec if installed."""
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    try:
        return pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as arrow_err:
        try:
            import fsspec  # optional: only for schemes pyarrow does not know (memory://, http://, ...)
        except ImportError:
            raise DataError(f"{uri}: pyarrow cannot open this URI ({arrow_err}) and fsspec is not installed") from None
        try:
            fs, path = fsspec.core.url_to_fs(uri)
        except (ValueError, ImportError) as err:
            raise DataError(f"{uri}: no filesystem for this URI (pyarrow: {arrow_err}; fsspec: {err})") from err
        return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


def _check_is_file(uri: str, fs: pafs.FileSystem, path: str, local: bool) -> None:
    """DataError unless `path` is a regular file (a FIFO or device would block or never end)."""
    if local:
        mode = os.stat(path).st_mode  # follows symlinks: a loop raises ELOOP here
        if stat.S_ISDIR(mode):
            raise DataError(f"{uri}: {_ERRNO_PROBLEMS[errno.EISDIR]}")
        if not stat.S_ISREG(mode):
            raise DataError(f"{uri}: is not a regular file (a pipe, socket or device); give a file")
        return
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.Directory:
        raise DataError(f"{uri}: {_ERRNO_PROBLEMS[errno.EISDIR]}")
    if info.type == pafs.FileType.NotFound:
        raise DataError(f"{uri}: {_ERRNO_PROBLEMS[errno.ENOENT]}")


def _read_local(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def _read_remote(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path, compression=None) as stream:  # decompressed by _decompress, in memory
        return stream.read()


def _read_parquet(uri: str, fs: pafs.FileSystem, path: str) -> SourceFile:
    table = pq.read_table(path, filesystem=fs)
    rows = [SourceRow(uri, i, values) for i, values in enumerate(table.to_pylist())]
    return SourceFile(uri, tuple(table.column_names), rows)


def _decompress(uri: str, data: bytes, codec: str) -> bytes:
    """The decompressed bytes; the data is already in memory, so every error here is a corrupt file."""
    try:
        with pa.CompressedInputStream(pa.BufferReader(data), codec) as stream:
            return stream.read()
    except (OSError, pa.ArrowException) as err:
        raise DataError(f"{uri}: is not valid {codec} data ({_first_line(err)}); re-compress it, or drop the "
                        "compression suffix if the file is not compressed") from err


def _os_problem(err: OSError) -> str:
    code = err.errno if err.errno is not None else _ERRNO_OF.get(type(err))
    return _ERRNO_PROBLEMS.get(code, f"cannot be read ({type(err).__name__}: {_first_line(err)})")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# ------------------------------------------------------------------------------------------------ records


def _parse_json(uri: str, text: str) -> SourceFile:
    """JSON Lines (one object per line; blank lines skipped), or one JSON array of objects."""
    if text.lstrip()[:1] == "[":
        rows = _json_array_rows(uri, text)
    else:
        rows = [_json_line(uri, i, line) for i, line in enumerate(text.split("\n")) if line.strip()]
    return SourceFile(uri, _columns(rows), rows)


def _json_array_rows(uri: str, text: str) -> list[SourceRow]:
    if ESCAPED_BYTE.search(text):
        raise DataError(f"{uri}: a JSON array file must be valid UTF-8 throughout; re-save it as UTF-8 (or as "
                        "JSON Lines, where a bad line is quarantined alone)")
    try:
        items = json.loads(text)
    except RecursionError:
        raise DataError(f"{uri}: JSON nested too deeply to parse; expected JSON Lines or an array of "
                        "flat objects") from None
    except ValueError as err:
        raise DataError(f"{uri}: not valid JSON ({err}); expected JSON Lines or an array of objects") from err
    return [_json_row(uri, i, item) for i, item in enumerate(items)]


def _json_line(uri: str, line_number: int, line: str) -> SourceRow:
    try:
        item = json.loads(line)
    except RecursionError:
        return SourceRow(uri, line_number, None, "JSON nested too deeply to parse", line)
    except ValueError as err:
        return SourceRow(uri, line_number, None, f"invalid JSON: {err}", line)
    if isinstance(item, dict) and ESCAPED_BYTE.search(line):
        item = {key: _restore_bytes(value) for key, value in item.items()}
    return _json_row(uri, line_number, item, line)


def _json_row(uri: str, index: int, item: object, raw: str | None = None) -> SourceRow:
    if not isinstance(item, dict):
        raw = _short_json(item) if raw is None else raw
        return SourceRow(uri, index, None, f"expected a JSON object, got {type(item).__name__}", raw)
    return SourceRow(uri, index, item)


def _short_json(item: object) -> str:
    try:
        return json.dumps(item)[:200]
    except (RecursionError, ValueError):
        return f"<{type(item).__name__} nested too deeply to show>"


def _parse_csv(uri: str, text: str) -> SourceFile:
    """CSV with a header row; every cell is a string; a row with the wrong field count is malformed.

    Fields of any length are read (the csv module's 128 KiB default would refuse the whole file for one long
    reply); over-long texts are quarantined later by DataPrepConfig.max_chars.
    """
    previous = csv.field_size_limit(min(len(text) + 1, sys.maxsize, 2**31 - 1))
    try:
        reader = csv.reader(io.StringIO(text, newline=""))
        header = next(reader, None)
        if not header:
            raise DataError(f"{uri}: empty CSV; expected a header row such as prompt,chosen,rejected")
        rows = [_csv_row(uri, i, header, fields) for i, fields in enumerate(reader) if fields]
    except csv.Error as err:
        raise DataError(f"{uri}: cannot be parsed as CSV near line {reader.line_num} ({err})") from err
    finally:
        csv.field_size_limit(previous)
    return SourceFile(uri, tuple(header), rows)


def _csv_row(uri: str, index: int, header: list[str], fields: list[str]) -> SourceRow:
    if len(fields) != len(header):
        reason = f"row has {len(fields)} fields, the header has {len(header)}"
        return SourceRow(uri, index, None, reason, ",".join(fields))
    return SourceRow(uri, index, {name: _restore_bytes(value) for name, value in zip(header, fields)})


def _restore_bytes(value: object) -> object:
    """A string that carries undecodable bytes (as escape surrogates) back to bytes, so validation can
    quarantine it as undecodable_bytes; anything else unchanged."""
    if isinstance(value, str) and ESCAPED_BYTE.search(value):
        return value.encode("utf-8", errors="surrogateescape")
    return value


def _columns(rows: list[SourceRow]) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for row in rows:
        seen.update(dict.fromkeys(row.values or ()))
    return tuple(seen)
