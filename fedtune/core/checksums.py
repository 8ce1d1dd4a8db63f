"""sha256 of files, as the integrity records (counts.json, fedtune-checksums.json, aggregate.json)
store them."""

from __future__ import annotations

import hashlib
from pathlib import Path

CHUNK = 16 << 20


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(CHUNK)
        view = memoryview(buffer)
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


# The base model's identity (issue 37): what every cluster's download of it recorded, so that sites that
# downloaded different weights (a branch that moved between two downloads) are told apart.
SOURCE_RECORD = "fedtune-source.json"


def folder_digests(folder: str | Path, known: dict[str, str] | None = None) -> dict[str, str]:
    """{file name: sha256} of a model folder's own files: every plain file but the hidden ones (tools'
    markers) and the download's record itself. `known` saves hashing files already hashed."""
    known = known or {}
    return {
        path.name: known.get(path.name) or sha256_file(path)
        for path in sorted(Path(folder).iterdir())
        if path.is_file() and not path.name.startswith(".") and path.name != SOURCE_RECORD
    }


def folder_identity(digests: dict[str, str]) -> str:
    """One sha256 for a folder's files: over its sorted `name sha256` lines (sha256sum's format)."""
    lines = "".join(f"{digests[name]}  {name}\n" for name in sorted(digests))
    return hashlib.sha256(lines.encode()).hexdigest()
