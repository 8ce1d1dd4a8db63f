"""A controller (the main Snakemake) that dies while its training job runs on in Slurm loses nothing that
finished (issue 48). On the local two-node cluster (scripts/slurm-local), Snakemake is SIGKILLed while
site alpha's train job trains; then

- the controller is restarted at once, while the job still trains, and the job it submits starts: that
  second job refuses the folder, naming the live job and the `scancel` that frees it; the first job
  trains on to the end, and a third start of the controller trains nothing again (on Slurm the job's
  own Snakemake records its success, so the controller finds the model complete);
- the controller is restarted at once, and the job it submits waits in the queue until the first has
  finished: it restores the first job's recorded export in seconds, training no step, and the model is
  the same files.

And on one machine (profiles/local, no Slurm): Snakemake alone SIGKILLed or sent SIGINT while the
training runs; the training finishes, Snakemake holds its model incomplete, and the rerun restores it.

Each training step sleeps (1 s, 0.5 s, 0.2 s: SLOW_STEPS, a sitecustomize on PYTHONPATH, which the jobs
inherit from the controller's environment), so that the job outlives a controller's restart on any
machine while using no CPU."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from .slurm_harness import VENV_BIN, running_cluster
from .workflow_harness import ROOT, demo_config, snakemake, write_config

STEPS = 60
TARGET = "results/demo/round-1/alpha/model"
LOG = "results/demo/logs/train/round-1/alpha.log"
RULE = "rule_train_wildcards_1_alpha"
RECORD = "results/demo/round-1/alpha/checkpoints/export/record.json"

# Loaded by every Python process of the run; in the training processes (fedtune.train.loop imported,
# FEDTUNE_TEST_STEP_SLEEP set) each training step sleeps that long after it ran.
SLOW_STEPS = """
import importlib.abc, importlib.util, os, sys, time

class _SlowSteps(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "fedtune.train.loop":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            step = module.train_step

            def slow(*args, **kwargs):
                result = step(*args, **kwargs)
                time.sleep(float(os.environ["FEDTUNE_TEST_STEP_SLEEP"]))
                return result

            module.train_step = slow

        spec.loader.exec_module = exec_module
        return spec

if os.environ.get("FEDTUNE_TEST_STEP_SLEEP"):
    sys.meta_path.insert(0, _SlowSteps())
"""


@pytest.fixture(scope="module")
def slurm_cluster():
    yield from running_cluster()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The demo's base model and tokenized data (local profile: no Slurm needed for them), alpha training
    STEPS steps in one process, and the slow-steps hook."""
    source = tmp_path_factory.mktemp("controller-dies-data")
    config = demo_config()
    config["tokenize"]["shards"] = 1
    for site in config["sites"].values():
        site["cluster"] = "slurm-local"
        site["dataset"]["max_documents"] = 200
    config["train"].update(max_steps=STEPS, warmup_steps=1, checkpoint_every=20, log_every=1)
    config["sites"]["alpha"]["train"] = {"nodes": 1, "processes_per_node": 1, "launcher": "local"}
    config["sites"]["alpha"]["train"].update(mem_mb=2000, runtime=20)
    write_config(source, config)
    snakemake(source, "results/demo/data/alpha/manifest.json", "results/demo/model/base", profile="local")
    hook = tmp_path_factory.mktemp("slow-steps")
    (hook / "sitecustomize.py").write_text(SLOW_STEPS)
    return source, hook


def _workdir(prepared, tmp_path) -> Path:
    source, _ = prepared
    subprocess.run(["cp", "-a", f"{source}/.", str(tmp_path)], check=True)
    return tmp_path


def _env(slurm_cluster, hook, step_sleep: str = "1") -> dict:
    env = slurm_cluster.env(FEDTUNE_TEST_STEP_SLEEP=step_sleep, PYTHONPATH=str(hook))
    env["PATH"] = f"{VENV_BIN}:{env['PATH']}"
    return env


def _controller(workdir, env, *args, out="snakemake.out", profile="slurm-local") -> subprocess.Popen:
    """The main Snakemake in a session of its own (a signal to its PID reaches it alone)."""
    command = [
        f"{VENV_BIN}/snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory", str(workdir),
        "--configfile", str(workdir / "config.yaml"), "--profile", str(ROOT / "profiles" / profile),
        TARGET, "--allowed-rules", "train", *args,
    ]  # fmt: skip
    with open(workdir / out, "w") as stream:
        return subprocess.Popen(
            command, cwd=workdir, env=env, stdout=stream, stderr=subprocess.STDOUT, start_new_session=True
        )


# Long enough for a job to wait its turn behind other test files' jobs on the shared local cluster.
SLURM_WAIT_S = 900


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _train_jobs(slurm_cluster, workdir, state: str | None = None) -> list[str]:
    """The ids of this workdir's train jobs in squeue (in `state` only, if given)."""
    rows = [r.split("|") for r in slurm_cluster.run("squeue", "-h", "-o", "%i|%k|%T|%Z").stdout.splitlines()]
    return [r[0] for r in rows if r[1] == RULE and r[3] == str(workdir) and state in (None, r[2])]


def _running_train_job(slurm_cluster, workdir) -> str | None:
    jobs = _train_jobs(slurm_cluster, workdir, "RUNNING")
    return jobs[0] if jobs else None


def _kill_controller_mid_training(slurm_cluster, workdir, env) -> str:
    """Start the controller, SIGKILL it once its train job has trained 2 steps; returns the job's id."""
    controller = _controller(workdir, env)
    try:
        log = workdir / LOG
        # The download and tokenize jobs go first, and in the suite other files' Slurm jobs share the
        # cluster: a slot may take minutes.
        _wait(lambda: log.is_file() and "step 2/" in log.read_text(), SLURM_WAIT_S, "the job's second step")
        job = _running_train_job(slurm_cluster, workdir)
        assert job, (workdir / "snakemake.out").read_text()[-3000:]
    finally:
        controller.send_signal(signal.SIGKILL)
        controller.wait()
    return job


def _unlock(workdir, env):
    result = subprocess.run(
        [f"{VENV_BIN}/snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory", str(workdir),
         "--configfile", str(workdir / "config.yaml"), "--unlock"],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


def _unlock_and_run(workdir, env, *args, out):
    _unlock(workdir, env)
    controller = _controller(workdir, env, *args, out=out)
    controller.wait(timeout=600)
    return controller.returncode, (workdir / out).read_text()


def _job_state(slurm_cluster, job):
    rows = slurm_cluster.jobs(job_ids=[job])
    return rows[0]["State"].split()[0] if rows else None


def _files(folder: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_ino, p.read_bytes()) for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.slurm
def test_a_job_queued_while_the_first_trains_restores_its_export(slurm_cluster, prepared, tmp_path):
    """The controller is restarted while the first job trains, and the job it submits waits in the queue
    (here: --begin, released when the first job has completed; on a real cluster, a busy partition). It
    then finds the first job's export recorded, and restores it: no training step runs again."""
    workdir = _workdir(prepared, tmp_path)
    env = _env(slurm_cluster, prepared[1], step_sleep="0.5")  # the next job only has to be queued in time
    job = _kill_controller_mid_training(slurm_cluster, workdir, env)
    _unlock(workdir, env)
    # Held by its begin time; released below.
    held = "train:slurm_extra='--begin=now+600'"
    controller = _controller(workdir, env, "--retries", "0", "--set-resources", held, out="restart.out")
    try:
        second = _wait(
            lambda: next((j for j in _train_jobs(slurm_cluster, workdir) if j != job), None),
            120,
            "a second job",
        )
        _wait(lambda: _job_state(slurm_cluster, job) == "COMPLETED", SLURM_WAIT_S, f"job {job} to complete")
        record = json.loads((workdir / RECORD).read_text())
        assert record["slurm_job_id"] == job and record["steps"] == STEPS
        exported = _files(workdir / TARGET)
        slurm_cluster.run("scontrol", "update", f"JobId={second}", "StartTime=now")
        controller.wait(timeout=SLURM_WAIT_S)
    finally:
        if controller.poll() is None:
            controller.kill()
    output = (workdir / "restart.out").read_text()
    assert controller.returncode == 0, output[-4000:]
    log = (workdir / LOG).read_text()
    assert f"launch: job {second};" in log, log[-3000:]
    assert "no step trained" in log and f"by Slurm job {job} after {STEPS} steps" in log, log[-3000:]
    assert not re.search(r"^step \d+/", log, re.M) and "resumed from" not in log, log[-3000:]
    # The same files, the same inodes: linked back from the record.
    files = _files(workdir / TARGET)
    assert {k: v for k, v in files.items() if not k.startswith(".")} == {
        k: v for k, v in exported.items() if not k.startswith(".")
    }


@pytest.mark.slurm
def test_a_second_job_refuses_the_folder_while_the_first_still_trains(slurm_cluster, prepared, tmp_path):
    workdir = _workdir(prepared, tmp_path)
    # No retries: the refusal is what ends the restarted controller (a retry would refuse again, or,
    # once the first job has finished, restore its export).
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    config["train"]["retries"] = 0
    write_config(workdir, config)
    env = _env(slurm_cluster, prepared[1])
    job = _kill_controller_mid_training(slurm_cluster, workdir, env)
    code, output = _unlock_and_run(workdir, env, out="restart.out")
    assert code != 0, output[-4000:]
    refusal = f"another training runs into this folder: Slurm job {job}"
    assert refusal in output and f"`scancel {job}`" in output, output[-4000:]
    # The first job was still training when the second refused: squeue's state, as the refusal read it
    # (asking squeue again here would race the first job's end: the restarted controller may take a
    # minute to notice the second job's failure on a loaded machine).
    assert f"Slurm job {job} is RUNNING" in output, output[-4000:]
    # The first job trains on to the end, alone.
    _wait(lambda: _job_state(slurm_cluster, job) == "COMPLETED", SLURM_WAIT_S, f"job {job} to complete")
    summary = json.loads((workdir / TARGET / "training.json").read_text())
    assert summary["steps"] == STEPS
    exported = _files(workdir / TARGET)
    # A third start trains nothing again: the model is complete (the job's own Snakemake recorded its
    # success), or, where held incomplete, restored.
    controller = _controller(workdir, env, out="third.out")
    controller.wait(timeout=SLURM_WAIT_S)
    third = (workdir / "third.out").read_text()
    assert controller.returncode == 0, third[-4000:]
    if "rule train:" in third:
        log = (workdir / LOG).read_text()
        assert "no step trained" in log and not re.search(r"^step \d+/", log, re.M), log[-3000:]
    else:
        assert "Nothing to be done" in third, third[-4000:]
    assert {k: v for k, v in _files(workdir / TARGET).items() if not k.startswith(".")} == {
        k: v for k, v in exported.items() if not k.startswith(".")
    }


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_on_one_machine_a_training_that_outlived_its_controller_is_restored(prepared, tmp_path, sig):
    """profiles/local, the controller alone signalled (its PID) while alpha trains: the training runs on
    to its export; Snakemake holds the model incomplete, and the restarted controller (after --unlock)
    runs the job again (`--rerun-incomplete`, which the profile sets), which restores the export instead
    of training from step 1 (issue 48: both trainings were redone)."""
    workdir = _workdir(prepared, tmp_path)
    env = dict(os.environ, PATH=f"{VENV_BIN}:{os.environ['PATH']}", FEDTUNE_TEST_STEP_SLEEP="0.2")
    env["PYTHONPATH"] = str(prepared[1])
    controller = _controller(workdir, env, profile="local")
    try:
        log = workdir / LOG
        _wait(lambda: log.is_file() and "step 2/" in log.read_text(), 300, "the second step")
        controller.send_signal(sig)
        # The training goes on without its controller, to its export and the record.
        _wait(lambda: (workdir / RECORD).is_file(), 300, "the export record")
        lock = workdir / "results/demo/round-1/alpha/checkpoints/train.lock"
        _wait(lambda: not lock.exists(), 120, "the training to end")
        controller.wait(timeout=120)
    finally:
        if controller.poll() is None:
            controller.kill()
    first = log.read_text()
    assert f"step {STEPS}/{STEPS}" in first, first[-3000:]
    exported = _files(workdir / TARGET)

    _unlock(workdir, env)
    controller = _controller(workdir, env, out="restart.out", profile="local")
    controller.wait(timeout=300)
    output = (workdir / "restart.out").read_text()
    assert controller.returncode == 0, output[-4000:]
    assert "rule train:" in output, output[-4000:]  # held incomplete, run again
    log_text = log.read_text()
    # The log is appended to: the rerun's part starts after the first run's last line.
    rerun = log_text[len(first) :] if log_text.startswith(first) else log_text
    assert "no step trained" in rerun, log_text[-3000:]
    assert not re.search(r"^step \d+/", rerun, re.M), rerun[-3000:]
    assert {k: v for k, v in _files(workdir / TARGET).items() if not k.startswith(".")} == {
        k: v for k, v in exported.items() if not k.startswith(".")
    }
