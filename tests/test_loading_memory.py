"""fedtune.train.loading: a 2-process train job that loads the starting weights once holds clearly fewer fp32
copies of the model on the node than one where every rank loads them (the per-rank path, kept for
comparison), and both paths start training from the same weights. The goal of at most 1.3 copies is the
benchmark's (benchmarks/loading_memory.py: 1.09-1.11 on a quiet machine); here the figures move with the
machine's load (1.364 once, 2.03 per rank, with the suite's three workers on 2 cores), so the test keeps
margins that load did not come near: the distance to the per-rank path is read from each process's
own peak (VmHWM), which no timing can hide."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import loading_memory  # noqa: E402

from tests.train_runs import losses, run_training  # noqa: E402

pytest_plugins = ["tests.train_fixtures"]
# fp32 copies of the model per node: loading once stays below BOUND and at least MARGIN below loading per rank
# (measured under load: 1.364 and 2.03; quiet: 1.09 and 2.01).
BOUND = 1.7
MARGIN = 0.3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("loading")
    # 43.5M parameters: 174 MB in fp32, large beside the run-to-run noise of the interpreter's memory.
    big = loading_memory.prepare(root / "big", 768, 6)
    small = loading_memory.prepare(root / "small", 64, 2, tokenizer_dir=big[0])
    return root, big, small


def test_loading_once_holds_clearly_fewer_copies_than_loading_per_rank(models):
    root, (model_dir, manifest, params), (small_dir, small_manifest, _) = models
    # glibc's default allocator, as the train stage runs: the shards are filled through one reused
    # buffer per rank, so no freed transfer buffers pile up in the heap
    # (benchmarks/results/loading/2026-11-26.md).
    env = dict(os.environ)
    baseline = loading_memory.measure(small_dir, small_manifest, 2, "once", root / "base", env=env)
    once = loading_memory.measure(model_dir, manifest, 2, "once", root / "once", env=env)
    # measured again while a rank had not loaded by rank 0's line (loading_memory.measure)
    per_rank = loading_memory.measure(model_dir, manifest, 2, "per-rank", root / "per-rank", env=env)
    assert once["processes_seen"] == per_rank["processes_seen"] == 2
    after = loading_memory.model_share(once, baseline, params)
    before = loading_memory.model_share(per_rank, baseline, params)
    print(
        f"fp32 copies while loading, per rank / once: node {before['copies_pss']} / {after['copies_pss']}, "
        f"own peaks {before['copies_own_peaks']} / {after['copies_own_peaks']}; the ranks' own peaks per rank "
        f"{per_rank['own_peak_each_mb']} MB"
    )
    assert after["copies_pss"] < BOUND, after
    # Every rank converting its own bf16 checkpoint to fp32 holds a whole copy at its own peak. Compared
    # by the sum of each process's own peak as the kernel keeps it (VmHWM): under load the ranks' peaks
    # need not meet in time and the polling misses some, and the node's summed peak of the per-rank path
    # fell to the once path's (1.158 against 1.177 in the suite; 0.755 against 1.26 beside four busy
    # loops), while the own peaks kept their distance (3.11 against 1.44 quiet, 2.53 against 1.66 loaded).
    assert before["copies_own_peaks"] - after["copies_own_peaks"] >= MARGIN, (before, after)


def test_both_paths_start_from_the_same_weights(tiny_model_dir, site_manifest, tmp_path, monkeypatch):
    options = {"backend": "fsdp", "sharding": "full", "max_steps": 2}
    run_training(tiny_model_dir, site_manifest, tmp_path / "once", options)
    monkeypatch.setenv("FEDTUNE_OLD_PATHS", "per-rank-loading")
    run_training(tiny_model_dir, site_manifest, tmp_path / "per-rank", options)
    assert losses(tmp_path / "once" / "model") == pytest.approx(
        losses(tmp_path / "per-rank" / "model"), abs=1e-6
    )
    assert "Traceback" not in (tmp_path / "once" / "stdout.txt").read_text()


def test_zero3_loads_partitioned_from_the_same_weights(tiny_model_dir, site_manifest, tmp_path, monkeypatch):
    """DeepSpeed ZeRO-3 creates the model under deepspeed.zero.Init (each rank holds its partitions from
    the start) and trains from the same weights as when every rank loads the whole model first."""
    options = {"backend": "deepspeed", "zero_stage": 3, "max_steps": 2}
    partitioned = run_training(tiny_model_dir, site_manifest, tmp_path / "zero-init", options)
    monkeypatch.setenv("FEDTUNE_OLD_PATHS", "per-rank-loading")
    whole = run_training(tiny_model_dir, site_manifest, tmp_path / "per-rank", options)
    held = re.search(r"partitioned while created \(deepspeed.zero.Init\), ([\d.]+) of it", partitioned.stdout)
    # Two ranks: half of every parameter each (rounded up to whole elements per parameter).
    assert held and 0.45 < float(held[1]) < 0.55, partitioned.stdout[-2000:]
    assert "deepspeed.zero.Init" not in whole.stdout
    assert losses(tmp_path / "zero-init" / "model") == pytest.approx(
        losses(tmp_path / "per-rank" / "model"), abs=1e-6
    )


def test_the_per_rank_path_is_read_again_while_a_rank_had_not_loaded(monkeypatch, tmp_path):
    """measure's retry: a per-rank reading whose ranks' own peaks are more than 20% apart (one rank caught
    before its load) is taken again; the once path, whose rank 0 alone reads the weights, is read once."""
    readings = iter([[450.0, 740.0], [700.0, 745.0], [450.0, 740.0]])
    folders = []

    def one_reading(model_dir, manifest, procs, mode, run_dir, env=None, backend=None):
        folders.append(run_dir.name)
        return {"own_peak_each_mb": next(readings)}

    monkeypatch.setattr(loading_memory, "_measure", one_reading)
    run = loading_memory.measure(tmp_path, tmp_path, 2, "per-rank", tmp_path / "per-rank")
    assert (run["tries"], run["own_peak_each_mb"], folders) == (
        2,
        [700.0, 745.0],
        ["per-rank", "per-rank-try2"],
    )
    assert loading_memory.measure(tmp_path, tmp_path, 2, "once", tmp_path / "once")["tries"] == 1
