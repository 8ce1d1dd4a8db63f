"""What each command of a run leaves for the report's cost table: a small JSON record per command, written
when it ends, into the folder named by $FEDTUNE_JOB_RECORDS (common.smk sets it to <run>/logs/jobs, as it
sets PYTHONPATH; unset, nothing is written, so a command run by hand leaves nothing behind).

    {"command", "argv", "started", "ended", "wall_s", "exit_code", "host", "processes",
     "slurm_job_id", "slurm_step_id", "gpus"}

The record is the command's own: the Slurm job id comes from the job's environment (the jobstep plugin keeps
SLURM_JOB_ID for the rule's shell, and srun sets it in each task), so the report needs neither Snakemake's
Slurm logs (deleted for successful jobs by default) nor a Snakemake version's log format; `sacct` turns the
job ids into queue wait, node-hours, GPU-hours and energy (fedtune.report.cost). Only rank 0 of a
distributed command writes. A record of the same command and arguments is replaced, so a rerun's record
is the one left.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from fedtune.core.atomic import write_json

ENV = "FEDTUNE_JOB_RECORDS"


def _rank() -> int:
    for name in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def _processes() -> int:
    value = os.environ.get("WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def _visible_gpus() -> int:
    """GPUs this process may use as the environment lists them (no torch import: a tokenize job has none)."""
    devices = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return len([d for d in devices.split(",") if d.strip()]) if devices else 0


def process_started() -> float:
    """When this process started (Linux: /proc), so that the record counts the interpreter's start and
    the command's imports (torch and transformers: 10-17 s of a short job); elsewhere, now."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks after boot
        boot = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def record_name(command: str, argv: list[str]) -> str:
    key = hashlib.sha1(json.dumps([command, argv]).encode()).hexdigest()[:16]
    return f"{command}-{key}.json"


@dataclass
class JobRecord:
    command: str
    argv: list[str]
    started: float = field(default_factory=process_started)

    def finish(self, exit_code: int) -> Path | None:
        """Write the record (atomically), unless no folder is named or this is not rank 0. A record that
        cannot be written is reported and skipped: the command's own work is done and must stand."""
        folder = os.environ.get(ENV)
        if not folder or _rank() != 0:
            return None
        ended = time.time()
        record = {
            "command": self.command,
            "argv": self.argv,
            "started": self.started,
            "ended": ended,
            "wall_s": ended - self.started,
            "exit_code": exit_code,
            "host": socket.gethostname(),
            "processes": _processes(),
            "gpus": _visible_gpus(),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_step_id": os.environ.get("SLURM_STEP_ID"),
        }
        path = Path(folder) / record_name(self.command, self.argv)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json(path, record)
        except OSError as error:
            print(f"{self.command}: warning: job record {path} not written: {error}", file=sys.stderr)
            return None
        return path
