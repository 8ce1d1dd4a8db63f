"""benchmarks/old_paths brings back replaced code paths for the benchmarks' "before" runs by patching
fedtune's functions by name: each patch must apply, and a name that no longer exists must stop the run."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types

import pytest

from .workflow_harness import ROOT

OLD_PATHS = ROOT / "benchmarks" / "old_paths"

CHECK = {
    "per-rank-loading": "from fedtune.train import loading; print(loading.loads_once(None, None, False), loading.zero_init(None))",
    "sync-checkpoint": "from fedtune.train import checkpoint; print(checkpoint._writes_async(None))",
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CHECK))
def test_each_old_path_is_patched_in(name):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(OLD_PATHS), str(ROOT)]),
        "FEDTUNE_OLD_PATHS": name,
    }
    result = subprocess.run(
        [sys.executable, "-c", CHECK[name]], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert set(result.stdout.split()) == {"False"}


def test_a_renamed_function_stops_the_run():
    spec = importlib.util.spec_from_file_location("old_paths_sitecustomize", OLD_PATHS / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    renamed = types.ModuleType("fedtune.train.loading")
    with pytest.raises(SystemExit, match="no function loads_once"):
        module._per_rank_loading(renamed)
