"""The shipped demo text is the generator's output, small, and the two sites differ visibly."""

from __future__ import annotations

import json

from fedtune.download.demo_data import write

from .conftest import ROOT

SHIPPED = ROOT / "data" / "demo"


def test_shipped_files_are_the_generators_output(tmp_path):
    written = write(tmp_path)
    assert len(written) == 4
    for path in written:
        shipped = SHIPPED / path.relative_to(tmp_path)
        assert shipped.read_bytes() == path.read_bytes(), (
            f"{shipped} differs: rerun python -m fedtune.download.demo_data"
        )


def test_demo_data_is_small_and_the_sites_differ():
    total = sum(p.stat().st_size for p in SHIPPED.rglob("*") if p.is_file())
    assert total < 5 * 1024 * 1024
    alpha = [json.loads(line)["text"] for line in (SHIPPED / "alpha" / "train.jsonl").open()]
    beta = [json.loads(line)["text"] for line in (SHIPPED / "beta" / "train.jsonl").open()]
    words_a = {w for t in alpha for w in t.split()}
    words_b = {w for t in beta for w in t.split()}
    # Mostly disjoint vocabularies: a model tuned on one site should do worse on the other.
    assert len(words_a & words_b) < 0.1 * min(len(words_a), len(words_b))
    assert len(set(alpha)) == len(alpha) == 1600
