"""Small deterministic data for the tests and the benchmarks that run without a hub: an English-ish corpus
(a tokenizer is trained on it, tiny datasets are made of it) and a site's packed blocks in the tokenize
stage's format, as a train job reads them."""

from __future__ import annotations

import json
import random
from pathlib import Path


def corpus(n: int = 400) -> list[str]:
    """`n` sentences of 5-60 words from a 20-word vocabulary, the same on every call."""
    rng = random.Random(0)
    words = "the a cat dog sat ran on over mat log quick slow red blue green big small and then".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 60))) + "." for _ in range(n)]


def site_data(
    root: Path, tokenizer_dir: Path, *, blocks: int = 48, shards: int = 2, block_size: int = 32
) -> Path:
    """`shards` shards of `blocks` packed blocks of `block_size` tokens from the corpus, in the tokenize
    stage's format, under root/data/site, and their manifest (returned). Every fifth block has its second
    half's labels masked, as padding would leave them."""
    import numpy as np
    import pyarrow as pa
    from datasets import Dataset

    from fedtune.core.models import load_tokenizer
    from fedtune.tokenize.shards import arrow_files

    tokenizer = load_tokenizer(tokenizer_dir)
    ids: list[int] = []
    for text in corpus(600):
        ids += [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]]
        ids.append(tokenizer.eos_token_id)
        if len(ids) >= blocks * block_size:
            break
    flat = np.asarray(ids[: blocks * block_size], dtype=np.int32).reshape(blocks, block_size)
    labels = flat.copy()
    labels[::5, block_size // 2 :] = -100
    site = root / "data" / "site"
    shard_paths = []
    for k, part in enumerate(np.array_split(np.arange(blocks), shards)):
        columns = {
            name: pa.FixedSizeListArray.from_arrays(
                pa.array(a[part].reshape(-1), type=pa.int32()), block_size
            )
            for name, a in (("input_ids", flat), ("labels", labels))
        }
        shard = site / "train" / f"shard-{k}"
        Dataset(pa.table(columns)).save_to_disk(str(shard))
        counts = {"block_size": block_size, "blocks": len(part), "files": arrow_files(shard)}
        (shard / "counts.json").write_text(json.dumps(counts))
        shard_paths.append(f"train/shard-{k}")
    manifest = site / "manifest.json"
    manifest.write_text(
        json.dumps({"site": "site", "block_size": block_size, "splits": {"train": {"shards": shard_paths}}})
    )
    return manifest
