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
