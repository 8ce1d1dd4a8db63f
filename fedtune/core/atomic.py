"""Writes that are all-or-nothing: a reader never sees a half-written file or folder, and an
interrupted writer leaves only a temporary name that the next run removes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _tmp_sibling(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))


def remove_stale(path: Path) -> None:
    """Remove what a killed writer of `path` left behind (SIGKILL runs no cleanup). One writer per
    path at a time is the workflow's invariant: Snakemake never runs two jobs for one output."""
    if path.parent.is_dir():
        for stale in path.parent.glob(f".{path.name}.tmp-*"):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temporary folder beside `path`; on success it replaces `path` in one rename."""
    path = Path(path)
    remove_stale(path)
    tmp = _tmp_sibling(path)
    try:
        yield tmp
        if path.exists():
            old = _tmp_sibling(path)
            os.replace(path, old / path.name)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_bytes(path: str | Path, data: bytes) -> None:
    """Write a file so that readers see the old content or the new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_text(path: str | Path, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str | Path, data) -> None:
    write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")
