"""Resumable checkpoints of a training run, one folder per step:

    checkpoints/step-00000040/
      fsdp/ or deepspeed/     model and optimizer, sharded (torch.distributed.checkpoint / DeepSpeed)
      rng/rank-<r>.pt         each rank's random generator states
      trainer.json            step, data position, tokens seen, wall time, loss scaler, run identity
      loss.csv                the loss log so far

All ranks write into `.step-00000040.tmp` (the filesystem is shared across nodes); rank 0 renames it
when every rank is done, so a folder named step-N is always complete and a killed writer leaves only
a temporary name, which the next save removes. The newest complete folder is where a run resumes.

FSDP's model and optimizer are written in the background (`dcp.async_save`): the ranks block only while
the state is copied to host memory (staging), then train on while a thread writes it. At most one save
is in flight: the next save, `wait()` (train's signal path) and the run's last checkpoint wait for it,
and only then is the folder renamed to step-N (benchmarks/training.py --checkpoint-blocking compares it
with a synchronous save, through benchmarks/old_paths). DeepSpeed's own save_checkpoint stays synchronous."""

from __future__ import annotations

import json
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedtune.core.atomic import write_json
from fedtune.core.options import UserError
from fedtune.train import distributed

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


@dataclass
class _InFlight:
    future: object  # concurrent.futures.Future of dcp.async_save
    tmp: Path
    final: Path
    keep: int
    job: object
    started: float


_in_flight: _InFlight | None = None
_async_group = None  # (the world group it belongs to, the group)


def _writes_async(backend) -> bool:
    # Backends whose state goes through torch.distributed.checkpoint (FSDP2, DDP) can write it behind.
    return hasattr(backend, "save_async")


def _gloo_group():
    """A process group of its own for the background writer's collectives (a CPU one, which dcp
    requires, also beside NCCL), so that they never interleave with the training loop's. Made again
    when the world group changed: a process that trains several times (the federation benchmark calls
    fedtune.train.loop.train once per site and round) starts a new world each time."""
    global _async_group
    import torch.distributed as dist

    world = dist.group.WORLD
    if _async_group is None or _async_group[0] is not world:
        _async_group = (world, dist.new_group(backend="gloo"))
    return _async_group[1]


def save(root: Path, step: int, backend, trainer: dict, loss_log: str, job, keep: int) -> Path:
    """Write checkpoint `step` (collective: every rank calls it) and keep the newest `keep`. FSDP's state
    is written in the background, except the run's last checkpoint (step == total_steps)."""
    wait()
    started = time.perf_counter()
    final = root / name(step)
    tmp = root / f".{name(step)}.tmp"
    if job.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    distributed.barrier()
    future = None
    last = step >= trainer.get("total_steps", step + 1)
    # The run's last checkpoint is written in the foreground (as torchtitan does): it is waited for at
    # once anyway, and the export's gather that follows then never meets the writer's thread.
    if _writes_async(backend) and not last:
        future = backend.save_async(tmp, _gloo_group())
    else:
        backend.save(tmp)
    torch.save(rng_state(), tmp / "rng" / f"rank-{job.rank}.pt")
    if job.is_main:
        (tmp / LOSS_LOG).write_text(loss_log)
        write_json(tmp / TRAINER_STATE, {**trainer, "extra": backend.extra_state()})
    global _in_flight
    _in_flight = _InFlight(future, tmp, final, keep, job, started)
    if future is None:
        wait()
    elif job.is_main:
        print(
            f"checkpoint step {step}: blocked {time.perf_counter() - started:.3f} s, writing on", flush=True
        )
    return final


def wait() -> Path | None:
    """Finish the checkpoint in flight, if any (collective): wait for its writer, then rank 0 renames
    it complete and prunes old ones. Returns its folder."""
    global _in_flight
    pending, _in_flight = _in_flight, None
    if pending is None:
        return None
    waited = time.perf_counter()
    if pending.future is not None:
        pending.future.result()
    distributed.barrier()
    job = pending.job
    if job.is_main:
        if pending.final.exists():
            shutil.rmtree(pending.final)
        pending.tmp.rename(pending.final)
        root = pending.final.parent
        for _, old in complete(root)[: -pending.keep]:
            shutil.rmtree(old)
        for stale in root.glob(".step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        blocked = time.perf_counter() - (pending.started if pending.future is None else waited)
        kind = "synchronous" if pending.future is None else "waited for the writer"
        print(f"checkpoint {pending.final.name}: complete ({kind}, blocked {blocked:.3f} s)", flush=True)
    distributed.barrier()
    return pending.final


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
    """Remove the checkpoints (train.remove_checkpoints, after the export), complete or not. The export
    record (fedtune.train.export_record: hard links, no disk while the model folder exists) and the
    lock of the job still running (fedtune.train.job_lock) stay."""
    if not root.is_dir():
        return
    for path in root.iterdir():
        if NAME.match(path.name) or (path.name.startswith(".step-") and path.name.endswith(".tmp")):
            shutil.rmtree(path, ignore_errors=True)
