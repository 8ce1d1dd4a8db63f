"""One training at a time per checkpoints folder (issue 48): a lock file that says which job holds it.

A controller killed while its training job runs on, then restarted, submits the same job again; two
trainings would then write the same checkpoints and export into the same folder. The training's rank 0
takes `<checkpoints>/train.lock` before it trains or restores (O_EXCL), with its host, pid, the pid's
start time and its Slurm job id, and removes it when it ends (SIGKILL and node failures leave it). A
lock found there is checked:

- the same Slurm job (a requeued job runs again under its id): ours, taken over;
- another Slurm job: live while `squeue` lists it pending, running, suspended or requeued (it would
  train again), dead otherwise (ended, or no longer known);
- no Slurm job: live while its pid runs on this host with the start time recorded; a lock of another
  host without a Slurm job cannot be checked from here and counts as live.

A live holder stops this job with an error that names it (and on Slurm the `scancel` that frees the
folder); a dead one's lock is taken over, with a line that says so."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from fedtune.core.options import UserError

NAME = "train.lock"
# squeue's states of a job that runs, or will run again (its training would start in the folder).
LIVE_STATES = {
    "PENDING", "RUNNING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING",
    "RESIZING", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "SPECIAL_EXIT", "STOPPED",
}  # fmt: skip


class FolderBusy(UserError, RuntimeError):
    """Another live job trains into this folder: the message names it and how to free the folder."""


def hostname() -> str:
    return os.environ.get("SLURMD_NODENAME") or os.uname().nodename


def _start_time(pid: int) -> str | None:
    """The pid's start time in clock ticks since boot (/proc/<pid>/stat field 22): a pid reused by
    another process has another."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _this_holder() -> dict:
    return {
        "host": hostname(),
        "pid": os.getpid(),
        "pid_start": _start_time(os.getpid()),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def slurm_state(job_id: str) -> str | None:
    """squeue's state of the job, None when squeue does not list it (ended) or cannot be asked."""
    try:
        result = subprocess.run(
            ["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    states = result.stdout.split()
    return states[0] if result.returncode == 0 and states else None


def _squeue_available() -> bool:
    try:
        return subprocess.run(["squeue", "--version"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def liveness(holder: dict) -> tuple[bool, str]:
    """(whether the holder still runs or will run again, why)."""
    job = holder.get("slurm_job_id")
    if job:
        if job == os.environ.get("SLURM_JOB_ID"):
            return False, f"it is this Slurm job ({job}), run again"
        if not _squeue_available():
            return True, f"Slurm job {job}, which cannot be checked here (no squeue)"
        state = slurm_state(job)
        if state in LIVE_STATES:
            return True, f"Slurm job {job} is {state}"
        return False, f"Slurm job {job} has ended ({state or 'not in squeue'})"
    pid, host = holder.get("pid"), holder.get("host")
    if host != hostname():
        return True, f"pid {pid} on host {host}, which cannot be checked from {hostname()}"
    start = _start_time(int(pid)) if pid else None
    if start is not None and start == holder.get("pid_start"):
        return True, f"pid {pid} runs"
    return False, f"pid {pid} on {host} has ended"


def describe(holder: dict) -> str:
    job = holder.get("slurm_job_id")
    where = f"pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('since')}"
    return f"Slurm job {job} ({where})" if job else where


class JobLock:
    """`with JobLock(checkpoints):` holds the folder for this process (a context manager), or raises
    FolderBusy naming the live holder."""

    def __init__(self, checkpoints: Path, what: str | None = None):
        self.path = Path(checkpoints) / NAME
        self.what = what or str(checkpoints)
        self.held = False

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = json.dumps(_this_holder()) + "\n"
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    holder = json.loads(self.path.read_text())
                except FileNotFoundError:
                    continue  # released meanwhile: try again
                except (OSError, ValueError):
                    holder = {}  # a lock its writer did not finish (killed between open and write)
                alive, why = liveness(holder) if holder else (False, "an empty lock file")
                if alive:
                    raise FolderBusy(self._busy_message(holder, why)) from None
                print(f"train lock: taking over {self.path} from {describe(holder)}: {why}", flush=True)
                # Rename before removing: of two jobs taking over at once, one removes the stale lock.
                stale = self.path.with_name(f".{NAME}.stale-{os.getpid()}")
                try:
                    os.replace(self.path, stale)
                    stale.unlink()
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as stream:
                stream.write(me)
            self.held = True
            return
        raise FolderBusy(f"{self.path}: could not take the lock (other jobs keep taking it)")

    def _busy_message(self, holder: dict, why: str) -> str:
        job = holder.get("slurm_job_id")
        text = f"{self.what}: another training runs into this folder: {describe(holder)} ({why}). "
        if job:
            text += (
                f"Wait for it to end (its export is then restored by a rerun instead of training again), "
                f"or free the folder with `scancel {job}`"
            )
        else:
            text += (
                f"Wait for it to end, or stop it (`kill {holder.get('pid')}` on {holder.get('host')}); "
                f"if it is gone, delete {self.path}"
            )
        return text

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        if holder.get("pid") == os.getpid() and holder.get("host") == hostname():
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> JobLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
