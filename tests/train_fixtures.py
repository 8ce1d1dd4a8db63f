"""Session fixtures of the train tests, loaded as a plugin (`pytest_plugins` in each test_train*.py
file): registered once, so each training run here happens once per session, whichever files use it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.train_runs import DEEPSPEED3_OPTIONS, REFERENCE_OPTIONS, make_site_data, run_training


@pytest.fixture(scope="session")
def site_manifest(tiny_model_dir, tmp_path_factory) -> Path:
    return make_site_data(tmp_path_factory.mktemp("train-data"), tiny_model_dir)


@pytest.fixture(scope="session")
def reference_run(tiny_model_dir, site_manifest, tmp_path_factory) -> Path:
    """FSDP full sharding, fp32, 2 processes, checkpoints every 3 steps: what other runs must match."""
    run_dir = tmp_path_factory.mktemp("run-fsdp-full")
    run_training(tiny_model_dir, site_manifest, run_dir, REFERENCE_OPTIONS)
    return run_dir


@pytest.fixture(scope="session")
def deepspeed3_run(tiny_model_dir, site_manifest, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("run-deepspeed-3")
    run_training(tiny_model_dir, site_manifest, run_dir, DEEPSPEED3_OPTIONS)
    return run_dir
