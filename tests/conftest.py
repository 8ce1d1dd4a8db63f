"""Shared fixtures: a tiny model built from config (no download), an isolated cache and temp folder per
session, and the rule that Slurm tests may only skip outside CI."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

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


def pytest_configure(config):
    # Isolate every cache the stack writes to, but keep compiled DeepSpeed ops between sessions:
    # compiling them costs minutes, and they depend only on the installed versions.
    session_tmp = Path(os.environ.get("FEDTUNE_TEST_TMP", "/tmp/fedtune-tests"))
    session_tmp.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HOME", str(session_tmp / "hf-home"))
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "fedtune-torch-extensions"))
    os.environ.setdefault("TMPDIR", str(session_tmp / "tmp"))
    Path(os.environ["TMPDIR"]).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    # CI runs as root with Slurm installable: a Slurm test that skips there has not tested anything.
    if report.skipped and item.get_closest_marker("slurm") and os.environ.get("CI") == "true":
        report.outcome = "failed"
        report.longrepr = f"Slurm test skipped in CI, which must run it: {report.longrepr}"


def corpus(n: int = 400) -> list[str]:
    """Small deterministic English-ish text for tokenizer training and tiny datasets."""
    import random

    rng = random.Random(0)
    words = "the a cat dog sat ran on over mat log quick slow red blue green big small and then".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 60))) + "." for _ in range(n)]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer Llama with a 512-token byte-level BPE tokenizer, saved with save_pretrained."""
    from fedtune.core.models import build_model, save_model, train_tokenizer

    out = tmp_path_factory.mktemp("tiny-model") / "model"
    tokenizer = train_tokenizer(corpus(), vocab_size=512)
    model = build_model(TINY_ARCHITECTURE, tokenizer, seed=0)
    save_model(model, tokenizer, out)
    return out
