"""The first problem of a local text or JSON data file, found line by line, so that a bad file stops with
one line naming the file and the line, not a raw traceback from deep inside `datasets` (or, for invalid
UTF-8 inside a JSON string, only at tokenize).

A data file is input from whoever wrote it: the check reads it once, streamed, and holds one line at a
time. It covers what the json and text loaders would refuse or misread: bytes that are not UTF-8, a NUL
byte (a binary file), a JSON Lines row that does not parse or is not an object. A `.json` file that is one
JSON document (a list of objects, or an object of columns) is parsed whole, as `datasets` does."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

# Read at the dry run when the site's local files add up to at most this; larger files are checked at
# download, where they are read anyway.
CHEAP_BYTES = 64 * 2**20


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")


def _plain_suffix(path: Path) -> str:
    return Path(path.name.removesuffix(".gz")).suffix


def first_problem(path: str | Path, loader: str, max_rows: int | None = None) -> str | None:
    """'<file>: line N: <what>' for the first bad line of a json or text data file; None when every line
    reads (other loaders, and compressions other than gzip, are left to `datasets`). `max_rows`
    (dataset.max_documents): only the rows a download that keeps that many reads, so that a large file
    is not read whole to keep its first rows."""
    path = Path(path)
    if loader not in ("json", "text") or path.suffix in (".bz2", ".xz", ".zst", ".lz4"):
        return None
    with _open_binary(path) as stream:
        head = stream.read(8192)
    if b"\0" in head:  # a binary file says so, not that its first line is not UTF-8
        line = head.count(b"\n", 0, head.index(b"\0")) + 1
        return f"{path}: line {line}: a NUL byte: a binary file, not {loader} text"
    whole_json = loader == "json" and _plain_suffix(path) == ".json" and _starts_a_document(path)
    if whole_json:
        return _whole_json_problem(path)
    rows = 0
    with _open_binary(path) as lines:
        for number, raw in enumerate(lines, start=1):
            if max_rows is not None and rows >= max_rows:
                break
            if b"\0" in raw:
                return f"{path}: line {number}: a NUL byte: a binary file, not {loader} text"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                return f"{path}: line {number}: not UTF-8 (byte {raw[error.start]:#04x} at column {error.start + 1})"
            if loader == "text":
                rows += 1
                continue
            if not line.strip():
                continue
            rows += 1
            try:
                # Control characters inside strings: pyarrow reads them, so they pass here too.
                row = json.loads(line, strict=False)
            except json.JSONDecodeError as error:
                return f"{path}: line {number}: not valid JSON ({error.msg} at column {error.colno})"
            if not isinstance(row, dict):
                return f"{path}: line {number}: a JSON Lines row must be an object, not {type(row).__name__}"
    return None


def _starts_a_document(path: Path) -> bool:
    """A .json file holding one document ([...] or a multi-line {...}) rather than JSON Lines."""
    with _open_binary(path) as stream:
        head = stream.read(4096).lstrip()
        if head.startswith(b"["):
            return True
        if not head.startswith(b"{"):
            return False
        first_line = head.split(b"\n", 1)[0]
    try:
        json.loads(first_line, strict=False)
        return False  # the first line is a whole object: JSON Lines
    except (json.JSONDecodeError, UnicodeDecodeError):
        return True


def _whole_json_problem(path: Path) -> str | None:
    with _open_binary(path) as stream:
        raw = stream.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        return f"{path}: line {line}: not UTF-8 (byte {raw[error.start]:#04x})"
    try:
        json.loads(text, strict=False)
    except json.JSONDecodeError as error:
        return f"{path}: line {error.lineno}: not valid JSON ({error.msg} at column {error.colno})"
    return None


def cheap(paths) -> bool:
    """Whether local files are small enough to read at every start (the dry run included)."""
    return sum(Path(p).stat().st_size for p in paths) <= CHEAP_BYTES
