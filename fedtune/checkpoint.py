"""Resumable checkpoints of a training run, one folder per step:

    checkpoints/step-00000040/
      fsdp/ or deepspeed/     model and optimizer, sharded (torch.distributed.checkpoint / DeepSpeed)
      rng/rank-<r>.pt         each rank's random generator states
      trainer.json            step, data position, tokens seen, wall time, loss scaler, run identity
      loss.csv                the loss log so far

All ranks write into `.step-00000040.tmp` (the filesystem is shared across nodes); rank 0 renames it
when every rank is done, so a folder named step-N is always complete and a killed writer leaves only
a temporary name, which the next save removes. The newest complete folder is where a run resumes."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from fedtune import distributed
from fedtune.atomic import write_json
from fedtune.config import UserError

NAME = re.compile(r"^step-(\d{8})$")
TRAINER_STATE = "trainer.json"
LOSS_LOG = "loss.csv"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be resumed: the message names the folder and what to do."""


def name(step: int) -> str:
    return f"step-{step:08d}"


def complete(root: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := NAME.match(p.name)) and p.is_dir()]
    return sorted(found)


def newest(root: Path) -> Path | None:
    found = complete(root)
    return found[-1][1] if found else None


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(root: Path, step: int, backend, trainer: dict, loss_log: str, job, keep: int) -> Path:
    """Write checkpoint `step` (collective: every rank calls it) and keep the newest `keep`."""
    final = root / name(step)
    tmp = root / f".{name(step)}.tmp"
    if job.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    distributed.barrier()
    backend.save(tmp)
    torch.save(rng_state(), tmp / "rng" / f"rank-{job.rank}.pt")
    distributed.barrier()
    if job.is_main:
        (tmp / LOSS_LOG).write_text(loss_log)
        write_json(tmp / TRAINER_STATE, {**trainer, "extra": backend.extra_state()})
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for _, old in complete(root)[:-keep]:
            shutil.rmtree(old)
        for stale in root.glob(".step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
    distributed.barrier()
    return final


def read_trainer_state(folder: Path) -> dict:
    return json.loads((folder / TRAINER_STATE).read_text())


def load(folder: Path, backend, job) -> tuple[dict, str]:
    """Restore model, optimizer, RNG and backend state from `folder` (collective); returns the trainer
    state and the loss log."""
    trainer = read_trainer_state(folder)
    backend.load(folder)
    backend.load_extra_state(trainer.get("extra", {}))
    rng_file = folder / "rng" / f"rank-{job.rank}.pt"
    if trainer["world_size"] == job.world_size and rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return trainer, (folder / LOSS_LOG).read_text()


def remove_all(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
