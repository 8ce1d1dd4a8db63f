"""The code paths fedtune replaced, brought back for the measurements that compare against them. Product
code has no switch for them: a benchmark or test that wants one puts this folder first on PYTHONPATH
(Python then imports this module at start-up, in every process of the run, torchrun's workers included)
and names the old paths in FEDTUNE_OLD_PATHS (comma-separated):

- `per-rank-loading`: every rank reads the whole model with from_pretrained before sharding it (no
  meta-device load, no deepspeed.zero.Init); benchmarks/loading_memory.py's "before".
- `sync-checkpoint`: checkpoints written synchronously (no dcp.async_save); benchmarks/training.py
  --checkpoint-blocking's "before".

The patches are applied when fedtune imports the module, not here: importing torch during the
interpreter's start-up would slow every process (torchrun's own included) and change what it loads."""

import importlib.abc
import importlib.machinery
import os
import sys

OLD = {name for name in os.environ.get("FEDTUNE_OLD_PATHS", "").split(",") if name}
KNOWN = {"per-rank-loading", "sync-checkpoint"}
if OLD - KNOWN:
    raise SystemExit(f"FEDTUNE_OLD_PATHS: unknown {sorted(OLD - KNOWN)}; known: {sorted(KNOWN)}")


def _replace(module, name: str, value) -> None:
    # A renamed function would otherwise leave the "before" run measuring today's path without a word.
    if not callable(getattr(module, name, None)):
        raise SystemExit(f"FEDTUNE_OLD_PATHS: {module.__name__} has no function {name} to patch any more")
    setattr(module, name, value)


def _per_rank_loading(module):
    _replace(module, "loads_once", lambda *args, **kwargs: False)
    _replace(module, "zero_init", lambda *args, **kwargs: False)


def _sync_checkpoint(module):
    _replace(module, "_writes_async", lambda backend: False)


PATCHES = {}
if "per-rank-loading" in OLD:
    PATCHES["fedtune.train.loading"] = _per_rank_loading
if "sync-checkpoint" in OLD:
    PATCHES["fedtune.train.checkpoint"] = _sync_checkpoint


class _Patcher(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_module
        return spec


if PATCHES:
    sys.meta_path.insert(0, _Patcher())
