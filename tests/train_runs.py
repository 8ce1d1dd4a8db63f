"""Helpers for the train tests: tiny tokenized shards in the tokenize stage's format, starting
`python -m fedtune.train` through scripts/launch, and stand-ins for srun and scontrol."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from fedtune.tools.sample_data import site_data

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
LAUNCH = ROOT / "scripts" / "launch"
BLOCK_SIZE = 32
RUN_TIMEOUT = 300  # seconds; a run takes 20-40 s on 2 busy cores

# Small and fast: 2 ranks x micro 2 x accumulation 2 = global batch 8; fp32 so runs compare exactly.
BASE_OPTIONS = {
    "micro_batch": 2,
    "global_batch": 8,
    "max_steps": 8,
    "lr": 0.003,
    "warmup_steps": 1,
    "checkpoint_every": 0,
    "log_every": 1,
    "processes_per_node": 2,
    "remove_checkpoints": False,
    "seed": 7,
}
REFERENCE_OPTIONS = {"backend": "fsdp", "sharding": "full", "checkpoint_every": 3, "keep_checkpoints": 10}
DEEPSPEED3_OPTIONS = {"backend": "deepspeed", "zero_stage": 3, "checkpoint_every": 3}


def make_site_data(root: Path, tokenizer_dir: Path, *, blocks: int = 48, shards: int = 2) -> Path:
    """Shards of packed blocks from the test corpus plus a manifest; returns the manifest path."""
    return site_data(root, tokenizer_dir, blocks=blocks, shards=shards, block_size=BLOCK_SIZE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_args(model_dir: Path, manifest: Path, run_dir: Path, options: dict, extra=()) -> list[str]:
    return [
        PYTHON,
        "-m",
        "fedtune.train",
        "--site",
        "site",
        "--init",
        str(model_dir),
        "--manifest",
        str(manifest),
        "--options",
        json.dumps({**BASE_OPTIONS, **options}),
        "--checkpoints",
        str(run_dir / "checkpoints"),
        "--out",
        str(run_dir / "model"),
        *extra,
    ]


def env(path_first: Path | None = None, **extra) -> dict:
    """The environment of a training run: this venv's torchrun on PATH, the repo importable."""
    path = [str(Path(PYTHON).parent), os.environ.get("PATH", "")]
    if path_first:
        path.insert(0, str(path_first))
    # FEDTUNE_OLD_PATHS (set by a test) brings back a replaced code path: benchmarks/old_paths.
    old = [str(ROOT / "benchmarks" / "old_paths")] if os.environ.get("FEDTUNE_OLD_PATHS") else []
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([*old, str(ROOT)]),
        "OMP_NUM_THREADS": "1",
        "PATH": os.pathsep.join(path),
        **extra,
    }


def launch(args: list[str], procs: int = 2, *, launch_args=(), wait=True, **popen):
    """scripts/launch with local torchrun; returns the CompletedProcess (or the Popen when not waiting)."""
    cmd = ["bash", str(LAUNCH), "--procs-per-node", str(procs), *launch_args, "--", *args]
    popen.setdefault("env", env())
    if not wait:
        return subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, **popen
        )
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=ROOT,
        **popen,
    )
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        kill_tree(proc)  # no training process may outlive the test
        stdout, stderr = proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def errors(stderr: str) -> str:
    """The end of stderr without the warnings that libraries repeat on every call."""
    lines = [line for line in stderr.splitlines() if "Warning" not in line and "return func(" not in line]
    return "\n".join(lines[-60:])


def run_training(model_dir, manifest, run_dir: Path, options: dict, extra=()) -> subprocess.CompletedProcess:
    result = launch(train_args(model_dir, manifest, run_dir, options, extra))
    (run_dir / "stdout.txt").parent.mkdir(parents=True, exist_ok=True)
    (run_dir / "stdout.txt").write_text(result.stdout + result.stderr)
    assert result.returncode == 0, (
        f"exit {result.returncode}\n{result.stdout[-3000:]}\n{errors(result.stderr)}"
    )
    return result


def wait_for(predicate, proc, timeout: float) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(
                f"training ended (exit {proc.returncode}) before the condition:\n{proc.stdout.read()}"
            )
        if time.time() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.05)


def kill_tree(proc, sig=signal.SIGKILL) -> None:
    """Signal the launcher and every process below it. torchrun starts each worker in a session of
    its own, so a process-group signal would miss them (Slurm signals the whole job step)."""
    import psutil

    parent = psutil.Process(proc.pid)
    for child in [*parent.children(recursive=True), parent]:
        try:
            child.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def losses(model_out: Path) -> list[float]:
    import csv

    with open(model_out / "loss.csv") as stream:
        return [float(row["loss"]) for row in csv.DictReader(stream)]


def weights(model_out: Path) -> dict:
    from safetensors.torch import load_file

    state = {}
    for path in sorted(model_out.glob("*.safetensors")):
        state.update(load_file(path))
    return state


FAKE_SRUN = r"""#!/usr/bin/env bash
# Stands in for Slurm's srun on one machine: starts the tasks with the variables srun gives them,
# as if the allocation had nodes n1..nN, and returns the highest task exit code, as srun does.
nodes=1 ntasks=1 per_node=""
while [[ $1 == -* ]]; do
    case $1 in
        --nodes) nodes=$2; shift 2 ;;
        --ntasks) ntasks=$2; shift 2 ;;
        --ntasks-per-node) per_node=$2; shift 2 ;;
        --cpus-per-task) shift 2 ;;
        --kill-on-bad-exit=*) shift ;;
        *) echo "fake srun: unexpected option $1" >&2; exit 1 ;;
    esac
done
per_node=${per_node:-$((ntasks / nodes))}
echo "fake srun: $ntasks tasks on $nodes nodes" >> "$FAKE_SLURM_LOG"
pids=()
for ((t = 0; t < ntasks; t++)); do
    node=$((t / per_node))
    SLURM_PROCID=$t SLURM_LOCALID=$((t % per_node)) SLURM_NODEID=$node SLURM_NTASKS=$ntasks \
        SLURM_JOB_ID=4242 SLURM_JOB_NODELIST="n[1-$nodes]" SLURMD_NODENAME="n$((node + 1))" "$@" &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do
    wait "$p" || { r=$?; ((r > rc)) && rc=$r; }
done
exit $rc
"""

FAKE_SCONTROL = r"""#!/usr/bin/env bash
# `scontrol show hostnames NODELIST`: the emulated nodes all live on this machine.
[[ "$1 $2" == "show hostnames" ]] || exit 1
echo "show hostnames $3" >> "$FAKE_SLURM_LOG"
echo 127.0.0.1
echo 127.0.0.1
"""


def fake_slurm(folder: Path) -> Path:
    """A folder with srun and scontrol stand-ins, to put first on PATH."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder
