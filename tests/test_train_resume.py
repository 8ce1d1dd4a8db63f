"""Runs that are interrupted and started again end where an uninterrupted run ends: after SIGKILL
(FSDP, resume from the last periodic checkpoint), after SIGUSR1 (DeepSpeed ZeRO-2: checkpoint now,
exit 75, resume) and after Ctrl-C (SIGINT to the launcher's process group: the same). All end equal to
the uninterrupted FSDP reference run. A job whose export finished is restored, not trained again, when it
runs again (its export record); a second job refuses a folder that a live one trains into; a NaN loss or
gradient is never stepped on."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading

import pytest

from fedtune.train import export_record, job_lock
from fedtune.train.loop import EXIT_RETRY
from tests.test_train_backends import assert_same_training
from tests.train_runs import (
    BASE_OPTIONS,
    REFERENCE_OPTIONS,
    ROOT,
    RUN_TIMEOUT,
    env,
    errors,
    kill_tree,
    launch,
    run_training,
    train_args,
    wait_for,
)

pytest_plugins = ["tests.train_fixtures"]


def checkpoints(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))


# full: FSDP2 sharded checkpoints; none: DDP, whose checkpoint goes through the same DCP calls. The DDP
# run is compared with the FSDP reference, so its tolerance allows for another reduction order.
@pytest.mark.parametrize(("sharding", "tolerance"), [("full", 1e-6), ("none", 1e-5)])
def test_killed_run_resumes_to_the_same_weights(
    tiny_model_dir, site_manifest, reference_run, tmp_path, sharding, tolerance
):
    options = REFERENCE_OPTIONS | {"sharding": sharding}
    proc = launch(train_args(tiny_model_dir, site_manifest, tmp_path, options), wait=False)
    first = tmp_path / "checkpoints" / "step-00000003"
    try:
        wait_for(first.is_dir, proc, timeout=RUN_TIMEOUT)
    finally:
        kill_tree(proc, signal.SIGKILL)  # the whole job at once, as a node failure would
    proc.wait()
    assert not (tmp_path / "model").exists()
    done = checkpoints(tmp_path)
    assert done and done[-1] < f"step-{BASE_OPTIONS['max_steps']:08d}", done

    result = run_training(tiny_model_dir, site_manifest, tmp_path, options)
    assert f"resumed from {tmp_path / 'checkpoints' / done[-1]}" in result.stdout
    assert_same_training(tmp_path / "model", reference_run / "model", tolerance=tolerance)
    # The loss log spans the whole run, across the restart.
    steps = [int(r.split(",")[0]) for r in (tmp_path / "model" / "loss.csv").read_text().splitlines()[1:]]
    assert steps == list(range(1, BASE_OPTIONS["max_steps"] + 1))
    summary = json.loads((tmp_path / "model" / "training.json").read_text())
    assert (
        summary["tokens_trained"]
        == json.loads((reference_run / "model" / "training.json").read_text())["tokens_trained"]
    )
    # The training speed counts the steps before the restart too (each row: a step's tokens over its time).
    per_step = summary["tokens_seen"] / summary["steps"]
    rates = [float(r.split(",")[5]) for r in (tmp_path / "model" / "loss.csv").read_text().splitlines()[1:]]
    step_time = sum(per_step / rate for rate in rates)
    assert summary["step_time_s"] == pytest.approx(step_time, abs=1e-3)
    # From the unrounded time: step_time_s is rounded to the millisecond, 0.1% of a 0.5 s run.
    assert summary["tokens_per_s"] == pytest.approx(summary["tokens_seen"] / step_time, rel=1e-3)


def test_sigusr1_checkpoints_exits_75_and_resumes(tiny_model_dir, site_manifest, reference_run, tmp_path):
    options = {"backend": "deepspeed", "zero_stage": 2, "checkpoint_every": 3}
    proc = launch(train_args(tiny_model_dir, site_manifest, tmp_path, options), wait=False)
    watchdog = threading.Timer(RUN_TIMEOUT, kill_tree, [proc])  # a hung run must not hang the suite
    watchdog.start()
    output = []
    try:
        for line in proc.stdout:
            output.append(line)
            if line.startswith("step 2/"):
                # Slurm's --signal reaches every process of the job step: launcher, torchrun and workers.
                kill_tree(proc, signal.SIGUSR1)
                break
        output += proc.stdout.readlines()
        proc.wait()
    finally:
        watchdog.cancel()
    assert proc.returncode == EXIT_RETRY, "".join(output)[-4000:]
    text = "".join(output)
    assert "received SIGUSR1" in text
    done = checkpoints(tmp_path)
    assert done and "step-00000002" <= done[-1] < f"step-{BASE_OPTIONS['max_steps']:08d}"
    assert not (tmp_path / "model").exists()

    result = run_training(tiny_model_dir, site_manifest, tmp_path, options)
    assert f"resumed from {tmp_path / 'checkpoints' / done[-1]}" in result.stdout
    assert_same_training(tmp_path / "model", reference_run / "model")


def test_sigint_to_the_process_group_checkpoints_exits_75_and_resumes(
    tiny_model_dir, site_manifest, reference_run, tmp_path
):
    """Ctrl-C in the terminal of a local run: SIGINT to the launcher's process group (torchrun's workers
    run in sessions of their own; the launcher and torchrun pass it on). The training checkpoints at the
    end of its step and exits 75, as on SIGTERM, and the rerun resumes there: no step is redone."""
    proc = launch(train_args(tiny_model_dir, site_manifest, tmp_path, REFERENCE_OPTIONS), wait=False)
    watchdog = threading.Timer(RUN_TIMEOUT, kill_tree, [proc])
    watchdog.start()
    output = []
    try:
        for line in proc.stdout:
            output.append(line)
            if line.startswith("step 1/"):
                os.killpg(proc.pid, signal.SIGINT)
                break
        output += proc.stdout.readlines()
        proc.wait()
    finally:
        watchdog.cancel()
    text = "".join(output)
    assert proc.returncode == EXIT_RETRY, text[-4000:]
    assert "received SIGINT" in text or "received SIGTERM" in text, text[-4000:]
    (saved,) = re.findall(r"checkpoint (\S+/step-(\d+))\n", text)
    stopped_at = int(saved[1])
    assert 1 <= stopped_at < BASE_OPTIONS["max_steps"], text[-4000:]
    assert not (tmp_path / "model").exists()

    result = run_training(tiny_model_dir, site_manifest, tmp_path, REFERENCE_OPTIONS)
    assert f"resumed from {saved[0]} at step {stopped_at}" in result.stdout
    # No step trained twice: the rerun's first step is the one after the checkpoint.
    trained = [int(n) for n in re.findall(r"^step (\d+)/", result.stdout, re.M)]
    assert trained and min(trained) == stopped_at + 1, result.stdout[-3000:]
    assert_same_training(tmp_path / "model", reference_run / "model")


def _copy_record(reference_run, run_dir):
    """The reference run's export record where this run's checkpoints go: the files of a job of the same
    identity (the same data, start, options and code) whose model folder Snakemake has deleted."""
    shutil.copytree(
        export_record.folder(reference_run / "checkpoints"), export_record.folder(run_dir / "checkpoints")
    )


def test_an_exported_job_run_again_is_restored_and_another_job_trains(
    tiny_model_dir, site_manifest, reference_run, tmp_path
):
    record = export_record.folder(reference_run / "checkpoints")
    summary = json.loads((record / export_record.RECORD).read_text())
    assert summary["steps"] == BASE_OPTIONS["max_steps"]
    # Hard links: the record costs no second copy of the model.
    for path in (reference_run / "model").iterdir():
        if path.is_file():
            assert os.path.samefile(path, record / "model" / path.name), path.name
    _copy_record(reference_run, tmp_path)

    result = run_training(tiny_model_dir, site_manifest, tmp_path, REFERENCE_OPTIONS)
    assert "no step trained" in result.stdout, result.stdout[-3000:]
    assert not re.search(r"^step \d+/", result.stdout, re.M), result.stdout[-3000:]
    for path in (reference_run / "model").iterdir():
        assert (tmp_path / "model" / path.name).read_bytes() == path.read_bytes(), path.name
        assert os.path.samefile(
            tmp_path / "model" / path.name,
            export_record.folder(tmp_path / "checkpoints") / "model" / path.name,
        )
    assert not (tmp_path / "checkpoints" / job_lock.NAME).exists()  # released

    # Another identity (here another lr) trains, and its export replaces the record.
    other = REFERENCE_OPTIONS | {"lr": 0.002}
    result = run_training(tiny_model_dir, site_manifest, tmp_path, other)
    assert "is of another job (options differ): removed, training" in result.stdout, result.stdout[-3000:]
    assert f"step {BASE_OPTIONS['max_steps']}/" in result.stdout
    saved = export_record.read(tmp_path / "checkpoints")
    assert saved["identity"]["options"]["lr"] == 0.002


def test_a_second_job_refuses_the_folder_a_live_job_trains_into(
    tiny_model_dir, site_manifest, reference_run, tmp_path
):
    """A lock held by a live process (here a stand-in on this host) stops the second job before it trains,
    naming the holder; once the holder has ended, its stale lock is taken over."""
    _copy_record(reference_run, tmp_path)
    holder = subprocess.Popen(["sleep", "600"])
    try:
        lock = tmp_path / "checkpoints" / job_lock.NAME
        lock.write_text(json.dumps({
            "host": job_lock.hostname(), "pid": holder.pid, "pid_start": job_lock._start_time(holder.pid),
            "slurm_job_id": None, "since": "2026-11-28T10:00:00+0000",
        }))  # fmt: skip
        result = launch(train_args(tiny_model_dir, site_manifest, tmp_path, REFERENCE_OPTIONS))
        assert result.returncode != 0
        assert (
            f"another training runs into this folder: pid {holder.pid} on {job_lock.hostname()}"
            in result.stderr
        ), errors(result.stderr)
        assert f"kill {holder.pid}" in result.stderr
        assert not (tmp_path / "model").exists() and lock.is_file()
    finally:
        holder.kill()
        holder.wait()
    result = run_training(tiny_model_dir, site_manifest, tmp_path, REFERENCE_OPTIONS)
    assert f"taking over {lock} from pid {holder.pid}" in result.stdout, result.stdout[-3000:]
    assert "no step trained" in result.stdout
    assert not lock.exists()


FAKE_SQUEUE = """#!/bin/sh
# squeue -h -j ID -o %T: the state of job 4242 from $FAKE_SQUEUE_STATE (nothing: the job has ended).
[ "$1" = --version ] && { echo "slurm 22.05"; exit 0; }
[ -n "$FAKE_SQUEUE_STATE" ] && echo "$FAKE_SQUEUE_STATE"
exit 0
"""


@pytest.mark.parametrize("state", ["RUNNING", "PENDING", ""])
def test_a_lock_of_a_slurm_job_is_live_while_squeue_lists_it(tmp_path, monkeypatch, state):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(FAKE_SQUEUE)
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SQUEUE_STATE", state)
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    folder = tmp_path / "round-1" / "alpha" / "checkpoints"
    folder.mkdir(parents=True)
    holder = {"host": "n1", "pid": 1234, "pid_start": "1", "slurm_job_id": "4242", "since": "then"}
    (folder / job_lock.NAME).write_text(json.dumps(holder))
    lock = job_lock.JobLock(folder, what="round-1/alpha/model")
    if state:
        with pytest.raises(job_lock.FolderBusy) as refused:
            lock.acquire()
        message = str(refused.value)
        assert message.startswith(
            "round-1/alpha/model: another training runs into this folder: Slurm job 4242"
        )
        assert f"Slurm job 4242 is {state}" in message and "`scancel 4242`" in message
        return
    with lock:
        assert json.loads((folder / job_lock.NAME).read_text())["slurm_job_id"] == "4243"
    assert not (folder / job_lock.NAME).exists()
    # This job's own lock (a requeued job runs again under its id) is its own to take over.
    (folder / job_lock.NAME).write_text(json.dumps(holder | {"slurm_job_id": "4243"}))
    monkeypatch.setenv("FAKE_SQUEUE_STATE", "RUNNING")
    with job_lock.JobLock(folder):
        pass


# Loaded by every Python process of the run (sitecustomize on PYTHONPATH): makes the loss of micro batch
# POISON_CALL NaN (POISON_MODE `loss`), or its gradients alone (`grad`: the loss stays finite).
POISON_MICRO_BATCH = """
import os
import torch
from fedtune.train import backends

_calls = [0]
_loss = backends._micro_loss


def _micro_loss(model, inputs, trained):
    loss = _loss(model, inputs, trained)
    _calls[0] += 1
    if _calls[0] == int(os.environ["POISON_CALL"]):
        if os.environ["POISON_MODE"] == "loss":
            loss = loss * float("nan")
        else:
            loss.register_hook(lambda grad: grad * float("nan"))
    return loss


backends._micro_loss = _micro_loss
"""
# ... and prints after every optimizer step whether the weights are still finite.
POISON = (
    POISON_MICRO_BATCH
    + """
_step = torch.optim.AdamW.step


def step(self, *args, **kwargs):
    out = _step(self, *args, **kwargs)
    tensors = [p.to_local() if hasattr(p, "to_local") else p for g in self.param_groups for p in g["params"]]
    print(f"optimizer step: weights finite {all(bool(torch.isfinite(t).all()) for t in tensors)}", flush=True)
    return out


torch.optim.AdamW.step = step
"""
)


@pytest.mark.parametrize(
    ("options", "mode", "what"),
    [
        ({"backend": "fsdp", "sharding": "full"}, "loss", "loss is nan"),
        ({"backend": "fsdp", "sharding": "none"}, "grad", "gradient norm is nan"),
        ({"backend": "deepspeed", "zero_stage": 2}, "grad", "gradient norm is inf"),
    ],
    ids=["fsdp-nan-loss", "ddp-nan-gradient", "deepspeed2-nan-gradient"],
)
def test_a_nan_loss_or_gradient_stops_training_without_a_step_on_it(
    tiny_model_dir, site_manifest, tmp_path, options, mode, what
):
    """Step 3's first micro batch poisoned (2 ranks x 2 micro batches a step: the 5th call on each rank):
    the optimizer stepped twice, on finite weights, and the run stops naming step 3 and what was not
    finite."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(POISON)
    run_env = env(POISON_CALL="5", POISON_MODE=mode)
    run_env["PYTHONPATH"] = f"{hook}{os.pathsep}{ROOT}"
    run_dir = tmp_path / "run"
    result = launch(
        train_args(tiny_model_dir, site_manifest, run_dir, options | {"checkpoint_every": 1}), env=run_env
    )
    assert result.returncode != 0, result.stdout[-3000:]
    assert f"step 3: the {what}" in result.stderr and "the optimizer did not step on it" in result.stderr, (
        errors(result.stderr)
    )
    steps = re.findall(r"optimizer step: weights finite (True|False)", result.stdout)
    assert steps == ["True"] * 4, result.stdout[-3000:]  # steps 1 and 2 on each of the 2 ranks
    assert not re.search(r"^step 3/", result.stdout, re.M)
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == [
        "step-00000001",
        "step-00000002",
    ]
    assert not (run_dir / "model").exists()
