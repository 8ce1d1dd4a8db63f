"""sha256 of files, as the integrity records (counts.json, fedtune-checksums.json, aggregate.json)
store them."""

from __future__ import annotations

import hashlib
import json
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


# What a model folder's writer records (fedtune.core.models.save_model, the aggregate): bytes and sha256 of
# each weight file.
CHECKSUMS_RECORD = "fedtune-checksums.json"


def weight_digests(folder: str | Path) -> dict[str, str]:
    """sha256 of each weight file of a model folder: from the writer's record (fedtune-checksums.json),
    else hashed here."""
    folder = Path(folder)
    record = folder / CHECKSUMS_RECORD
    if record.is_file():
        return {name: entry["sha256"] for name, entry in json.loads(record.read_text()).items()}
    return {p.name: sha256_file(p) for p in sorted(folder.glob("*.safetensors"))}


def model_identity(folder: str | Path) -> str:
    """One sha256 for a model folder's weights (the identity a site model's training.json `start` and an
    aggregate's `start_identity` record, fedtune.core.exchange.start_identity's). No torch, so that the
    transfers on a login node can compare a copy against its round's start."""
    return folder_identity(weight_digests(folder))
