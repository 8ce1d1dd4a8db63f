"""The ways a training job starts across nodes, emulated on one machine: srun + torchrun per node with
c10d rendezvous (two torchrun invocations as two nodes), srun with one task per process and no
torchrun, and processes started by hand with RANK / WORLD_SIZE / MASTER_ADDR set. Each must train
the same model as the local reference run."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time

from tests.test_train_backends import assert_same_training
from tests.train_runs import (
    LAUNCH,
    ROOT,
    RUN_TIMEOUT,
    env,
    fake_slurm,
    free_port,
    kill_tree,
    launch,
    train_args,
)

pytest_plugins = ["tests.train_fixtures"]


def hosts(stdout: str) -> dict[int, str]:
    return {int(rank): host for rank, host in re.findall(r"rank (\d+)/2 on host (\S+) \(", stdout)}


def launch_on_fake_slurm(tmp_path, args, launcher, options_note):
    slurm = fake_slurm(tmp_path / "fake-slurm")
    log = tmp_path / "slurm.log"
    result = launch(
        args,
        procs=1,
        launch_args=["--launcher", launcher, "--nodes", "2", "--port", str(free_port())],
        env=env(path_first=slurm, FAKE_SLURM_LOG=str(log)),
    )
    assert result.returncode == 0, f"{options_note}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result, log.read_text()


def test_torchrun_per_node_two_nodes_train_together(tiny_model_dir, site_manifest, reference_run, tmp_path):
    """srun starts one task per node; each runs torchrun --nnodes 2 with c10d rendezvous at the first
    node of the allocation (resolved with scontrol), and HSDP shards within / replicates across nodes."""
    args = train_args(tiny_model_dir, site_manifest, tmp_path, {"sharding": "hybrid"})
    result, slurm_log = launch_on_fake_slurm(tmp_path, args, "torchrun", "torchrun per node")
    assert "fake srun: 2 tasks on 2 nodes" in slurm_log and "show hostnames n[1-2]" in slurm_log
    assert sorted(hosts(result.stdout).values()) == ["n1", "n2"], result.stdout[-2000:]
    assert result.stdout.count("torchrun)") == 2
    assert '"nodes": 2' in (tmp_path / "model" / "training.json").read_text()
    assert_same_training(tmp_path / "model", reference_run / "model")


def test_srun_task_per_process_without_torchrun(tiny_model_dir, site_manifest, reference_run, tmp_path):
    """One task per process, ranks from SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS; sharding none
    (plain data parallel with DDP), which must match FSDP full sharding."""
    args = train_args(tiny_model_dir, site_manifest, tmp_path, {"sharding": "none"})
    result, slurm_log = launch_on_fake_slurm(tmp_path, args, "srun", "srun task per process")
    assert sorted(hosts(result.stdout).values()) == ["n1", "n2"]
    assert result.stdout.count("direct start)") == 2 and "torchrun)" not in result.stdout
    assert_same_training(tmp_path / "model", reference_run / "model")


def test_hand_set_variables_without_any_launcher(tiny_model_dir, site_manifest, reference_run, tmp_path):
    """Two plain `python -m fedtune.train` processes that find each other through the environment, with
    DeepSpeed ZeRO-0 (plain data parallel), which must match FSDP too. (DeepSpeed ZeRO-3 across two
    emulated nodes: tests/test_slurm_local.py.)"""
    args = train_args(tiny_model_dir, site_manifest, tmp_path, {"backend": "deepspeed", "zero_stage": 0})
    port = str(free_port())
    procs = []
    for rank in range(2):
        variables = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
        variables |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(
            subprocess.Popen(
                args,
                cwd=ROOT,
                env=env(**variables),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        outputs = [p.communicate(timeout=RUN_TIMEOUT)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "rank 1/2 on host" in outputs[1] and "direct start)" in outputs[1]
    assert_same_training(tmp_path / "model", reference_run / "model")


IMAGE = "/images/fedtune.sif"
TRAIN = ["python", "-m", "fedtune.train", "--site", "a b"]


def planned_command(*launch_args: str, **variables: str) -> list[str]:
    """The command scripts/launch would start (--dry-run), split as the shell would."""
    environment = {key: value for key, value in env(**variables).items() if not key.startswith("SLURM_")}
    environment.pop("FEDTUNE_CONTAINER_GPU", None)
    environment.update(variables)
    result = subprocess.run(
        ["bash", str(LAUNCH), "--dry-run", *launch_args, "--", *TRAIN],
        env=environment, capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return shlex.split(result.stdout)


def test_launch_command_lines_of_each_launcher_with_and_without_the_image():
    """Where the image goes: around each training process (COMMAND), never around srun or torchrun."""
    wrap = ["apptainer", "exec", "--nv", "--bind", str(ROOT), IMAGE]
    srun_opts = ["srun", "--kill-on-bad-exit=1", "--nodes", "2", "--cpus-per-task", "7"]
    inner = ["--nodes", "2", "--procs-per-node", "4", "--"]
    for image, command in ((None, TRAIN), (IMAGE, wrap + TRAIN)):
        extra = ["--container", image] if image else []
        assert planned_command("--procs-per-node", "2", *extra) == [
            "torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", "2", "--no-python", *command,
        ]  # fmt: skip
        common = ["--nodes", "2", "--procs-per-node", "4", "--cpus-per-task", "7", *extra]
        assert planned_command("--launcher", "torchrun", *common) == [
            *srun_opts, "--ntasks", "2", "--ntasks-per-node", "1",
            str(LAUNCH), "--launcher", "torchrun-node", *inner, *command,
        ]  # fmt: skip
        assert planned_command("--launcher", "srun", *common) == [
            *srun_opts, "--ntasks", "8", "--ntasks-per-node", "4",
            str(LAUNCH), "--launcher", "srun-task", *inner, *command,
        ]  # fmt: skip


def test_container_gpu_flag_comes_from_the_option_or_the_cluster_file():
    def flags(*args, **variables):
        command = planned_command("--container", IMAGE, *args, **variables)
        return command[command.index("exec") + 1 : command.index("--bind")]

    assert flags() == ["--nv"]
    assert flags("--container-gpu", "rocm") == ["--rocm"]
    assert flags(FEDTUNE_CONTAINER_GPU="rocm") == ["--rocm"]
    assert flags("--cluster", "slurm-local") == []  # no GPU there (scripts/clusters/slurm-local.sh)
    assert flags("--cluster", "leonardo", FEDTUNE_ACCOUNT="p1") == ["--nv"]
    result = subprocess.run(
        ["bash", str(LAUNCH), "--dry-run", "--container", IMAGE, "--container-gpu", "cuda", "--", "true"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 2 and "nv, rocm or none" in result.stderr


FAKE_SQUEUE = """#!/usr/bin/env bash
# `squeue -h -j JOB -o %e`: the job ends at the time in $FAKE_END (seconds since the epoch).
date -d "@$FAKE_END" +%Y-%m-%dT%H:%M:%S
"""

STOPPABLE = f"""#!{sys.executable}
# A stand-in training process (Python: it starts with SIGUSR1 ignored, as the launcher's processes do,
# and installs a handler, as fedtune.train.loop does): on SIGUSR1 it "checkpoints" and exits 75.
import os, pathlib, signal, sys, time

def stop(signum, frame):
    with open(os.environ["OUT"], "a") as out:
        out.write(f"USR1 at {{int(time.time())}}\\n")
    pathlib.Path(os.environ["FEDTUNE_RETRY_MARKER"]).touch()
    sys.exit(75)

signal.signal(signal.SIGUSR1, stop)
time.sleep(60)
"""


def test_launcher_signals_the_training_processes_before_the_jobs_end(tmp_path):
    """Inside a Slurm job, scripts/launch sends SIGUSR1 FEDTUNE_SIGNAL_BEFORE seconds before the end time
    squeue reports, and returns 75 when the processes stop after it (torchrun itself would say 1)."""
    for name, text in (("squeue", FAKE_SQUEUE), ("stoppable", STOPPABLE)):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    out = tmp_path / "out"
    started = int(time.time())
    result = subprocess.run(
        ["bash", str(LAUNCH), "--procs-per-node", "1", "--", str(tmp_path / "stoppable")],
        env=env(
            path_first=tmp_path, SLURM_JOB_ID="77", FAKE_END=str(started + 108), FEDTUNE_SIGNAL_BEFORE="100",
            OUT=str(out),
        ),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 75, result.stderr[-3000:]
    assert "launch: job 77; SIGUSR1 to the training processes 100s before its time limit" in result.stderr
    assert re.search(r"launch: job 77 ends in 10[0-8]s: SIGUSR1 to the training processes", result.stderr)
    (line,) = out.read_text().splitlines()
    # The first signal at ~8 s, or (a process still starting up ignores it) a repeat 15 s later.
    assert line.startswith("USR1 at ") and 6 <= int(line.split()[-1]) - started <= 40, line
