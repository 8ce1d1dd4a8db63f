"""The Slurm path for real: a two-node cluster on this machine (scripts/slurm-local), jobs that sacct
reports, srun across both nodes, and the demo workflow through `--profile profiles/slurm-local`."""

from __future__ import annotations

import copy
import csv
import os
import shutil
import subprocess
import time

import pytest

from .slurm_harness import VENV_BIN, running_cluster, slurm_local
from .workflow_harness import ROOT, demo_config, snakemake, write_config

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def slurm_cluster():
    yield from running_cluster()


def test_up_again_is_a_no_op(slurm_cluster):
    pids_before = sorted(p.read_text() for p in (slurm_cluster.state / "run").glob("*.pid"))
    start = time.monotonic()
    result = slurm_local("up", slurm_cluster.state)
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - start < 15
    assert sorted(p.read_text() for p in (slurm_cluster.state / "run").glob("*.pid")) == pids_before
    status = slurm_local("status", slurm_cluster.state)
    assert status.returncode == 0 and "n1" in status.stdout and "n2" in status.stdout, status.stdout


def test_a_job_runs_and_sacct_reports_it_completed(slurm_cluster, tmp_path):
    out = tmp_path / "job.out"
    (row,) = slurm_cluster.submit(
        "--output", str(out), "--wrap", "echo job on $SLURMD_NODENAME", cwd=tmp_path
    )
    assert row["State"] == "COMPLETED" and row["ExitCode"] == "0:0", row
    assert out.read_text().strip() in {"job on n1", "job on n2"}


def test_srun_in_a_two_node_allocation_puts_a_task_on_each_node(slurm_cluster, tmp_path):
    out = tmp_path / "tasks.out"
    script = (
        "srun --ntasks 2 --ntasks-per-node 1 bash -c "
        "'echo $SLURM_PROCID $SLURMD_NODENAME $(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)'"
    )
    (row,) = slurm_cluster.submit("-N", "2", "-n", "2", "--output", str(out), "--wrap", script, cwd=tmp_path)
    assert row["State"] == "COMPLETED" and row["NodeList"] == "n[1-2]", row
    lines = sorted(out.read_text().split("\n"))
    tasks = [line.split() for line in lines if line.strip()]
    assert [(rank, node) for rank, node, _ in tasks] == [("0", "n1"), ("1", "n2")], tasks
    # The first node's name resolves here (the launcher takes MASTER_ADDR from it).
    assert {first for _, _, first in tasks} == {"n1"}
    assert slurm_cluster.run("getent", "hosts", "n1", "n2").stdout.count("127.0.0.1") == 2


STEP_TASK = """#!/bin/bash
trap 'echo "USR1 in task $SLURM_PROCID on $SLURMD_NODENAME"; exit 0' USR1
sleep 300 & wait
"""


def test_the_profiles_time_limit_signal_reaches_every_training_process(slurm_cluster, tmp_path):
    """The cluster profiles' slurm_extra `--signal=USR1@300` (no `B:`) signals the processes of the job's
    srun steps, on every node: the training processes that scripts/launch starts, which checkpoint. With
    `B:` only the batch shell (Snakemake's job step) would get it. Here: 90 s before a 2-minute limit."""
    (tmp_path / "task.sh").write_text(STEP_TASK)
    (tmp_path / "task.sh").chmod(0o755)
    script = "srun --ntasks 2 --ntasks-per-node 1 ./task.sh"
    (row,) = slurm_cluster.submit(
        "-N", "2", "-n", "2", "--time", "2", "--signal=USR1@90", "--output", "out", "--wrap", script,
        cwd=tmp_path, timeout=180,
    )  # fmt: skip
    assert row["State"] == "COMPLETED", row
    received = sorted((tmp_path / "out").read_text().splitlines())
    assert received == ["USR1 in task 0 on n1", "USR1 in task 1 on n2"], received


FAILING_SNAKEFILE = """
rule all:
    input: "bad.txt"

rule bad:
    output: "bad.txt"
    shell: "echo failing on purpose >&2; exit 3"
"""


def test_a_failing_rule_is_reported_failed_without_hanging(slurm_cluster, tmp_path):
    (tmp_path / "Snakefile").write_text(FAILING_SNAKEFILE)
    start = time.monotonic()
    result = slurm_cluster.run(
        f"{VENV_BIN}/snakemake", "--profile", str(ROOT / "profiles" / "slurm-local"), "--retries", "0",
        cwd=tmp_path, timeout=240, check=False,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "Error in rule bad" in output, output
    assert time.monotonic() - start < 120
    jobs = slurm_cluster.jobs(workdir=tmp_path)
    assert [job["State"] for job in jobs] == ["FAILED"], jobs
    assert not (tmp_path / "bad.txt").exists()


@pytest.fixture(scope="module")
def demo_run(slurm_cluster, tmp_path_factory):
    """The demo through the slurm-local profile, once for the tests below: both sites downloaded (local
    rules) and tokenized (sbatch jobs, one shard per split), and site alpha trained on 2 nodes with one
    process each (train: nodes 2, processes_per_node 1, launcher srun)."""
    workdir = tmp_path_factory.mktemp("slurm-demo")
    config = demo_config()
    config["tokenize"]["shards"] = 1
    for site in config["sites"].values():
        site["cluster"] = "slurm-local"  # the launcher sources scripts/clusters/slurm-local.sh
        site["dataset"]["max_documents"] = 300
    config["train"].update(max_steps=6, warmup_steps=1, checkpoint_every=0, log_every=2)
    train = {"nodes": 2, "processes_per_node": 1, "launcher": "srun", "mem_mb": 2000, "runtime": 20}
    config["sites"]["alpha"]["train"] = train
    write_config(workdir, config)
    manifests = [f"results/demo/data/{site}/manifest.json" for site in config["sites"]]
    snakemake(workdir, *manifests, "results/demo/round-1/alpha/model", profile="slurm-local", timeout=900)
    return workdir, config, slurm_cluster.jobs(workdir=workdir)


def test_demo_tokenize_jobs_go_through_sbatch_and_complete(demo_run):
    workdir, config, jobs = demo_run
    assert all((workdir / f"results/demo/data/{site}/manifest.json").is_file() for site in config["sites"])
    tokenize = [job for job in jobs if job["Comment"].startswith("rule_tokenize_")]
    # Every tokenize job (2 sites x 2 splits x 1 shard) went through sbatch and completed; download and
    # the manifests are local rules and never reach Slurm.
    assert {job["Comment"] for job in tokenize} == {
        f"rule_tokenize_wildcards_{site}_{split}_0" for site in config["sites"] for split in ("train", "test")
    }
    assert len(tokenize) == 4 and all(job["State"] == "COMPLETED" for job in tokenize), tokenize
    assert not [job for job in jobs if job["Comment"].startswith(("rule_download", "rule_tokenize_manifest"))]


def test_demo_trains_one_site_on_two_nodes_one_process_each(demo_run):
    """One Snakemake job = one two-node allocation: the train rule runs in it (mpi), and scripts/launch's
    srun starts one training process on n1 and one on n2, which train together (gloo)."""
    workdir, _, jobs = demo_run
    train = [job for job in jobs if job["Comment"].startswith("rule_train_")]
    assert len(train) == 1 and train[0]["NodeList"] == "n[1-2]", jobs
    assert train[0]["State"] == "COMPLETED", train
    log = (workdir / "results/demo/logs/train/round-1/alpha.log").read_text()
    assert "launch: srun, 2 nodes x 1 tasks" in log, log[-3000:]
    ranks = sorted(line.split(" (")[0] for line in log.splitlines() if line.startswith("rank "))
    assert ranks == ["rank 0/2 on host n1", "rank 1/2 on host n2"], log[-3000:]
    assert (workdir / "results/demo/round-1/alpha/model/training.json").is_file()


def test_two_node_training_matches_the_same_training_run_locally(demo_run, tmp_path):
    """The same site trained with the local profile (one machine, torchrun, 2 processes: the same world
    size, data and seed) from the same tokenized data gives the same losses."""
    workdir, config, _ = demo_run
    for part in ("data", "model"):
        shutil.copytree(workdir / "results/demo" / part, tmp_path / "results/demo" / part)
    config = copy.deepcopy(config)
    config["sites"]["alpha"]["train"] = {"nodes": 1, "processes_per_node": 2, "launcher": "local"}
    write_config(tmp_path, config)
    snakemake(tmp_path, "results/demo/round-1/alpha/model", "--allowed-rules", "train", profile="local")

    def losses(root):
        with open(root / "results/demo/round-1/alpha/model/loss.csv") as stream:
            return {int(row["step"]): float(row["loss"]) for row in csv.DictReader(stream)}

    on_slurm, here = losses(workdir), losses(tmp_path)
    assert on_slurm and on_slurm == pytest.approx(here, abs=1e-5), (on_slurm, here)


def test_down_stops_only_what_up_started_and_up_restarts_it(slurm_cluster):
    """Runs last: stops the cluster and starts it again (only one this session started: another
    session's or a user's cluster is not ours to stop)."""
    if not slurm_cluster.started:
        pytest.skip(f"the cluster in {slurm_cluster.state} was already up before this session")
    pids = [int(p.read_text()) for p in (slurm_cluster.state / "run").glob("*.pid")]
    assert len(pids) == 6  # munged, mariadbd, slurmdbd, slurmctld, slurmd n1 and n2
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        assert slurm_local("down", slurm_cluster.state).returncode == 0
        assert bystander.poll() is None
        assert not any(os.path.exists(f"/proc/{pid}") and _running(pid) for pid in pids)
        assert not os.path.lexists("/etc/slurm/slurm.conf")
        assert slurm_local("status", slurm_cluster.state).returncode != 0
    finally:
        bystander.kill()
        bystander.wait()
    result = slurm_local("up", slurm_cluster.state)
    assert result.returncode == 0, result.stderr
    (row,) = slurm_cluster.submit("--wrap", "true", "--output", "/dev/null", cwd=slurm_cluster.state)
    assert row["State"] == "COMPLETED", row


def _running(pid: int) -> bool:
    """pid runs (a zombie waiting for its parent to reap it has exited)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
