"""The ways a training job starts across nodes, emulated on one machine: srun + torchrun per node with
c10d rendezvous (two torchrun invocations as two nodes), srun with one task per process and no
torchrun, and processes started by hand with RANK / WORLD_SIZE / MASTER_ADDR set. Each must train
the same model as the local reference run."""

from __future__ import annotations

import re
import subprocess

from tests.test_train_backends import assert_same_training
from tests.train_runs import (
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
    DeepSpeed ZeRO-0 (plain data parallel), which must match FSDP too. (DeepSpeed is not run as two
    emulated nodes on one host: its CPU shared-memory allreduce then waits forever at start.)"""
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
