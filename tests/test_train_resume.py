"""Runs that are interrupted and started again end where an uninterrupted run ends: after SIGKILL
(FSDP, resume from the last periodic checkpoint) and after SIGUSR1 (DeepSpeed ZeRO-2: checkpoint now,
exit 75, resume). Both end equal to the uninterrupted FSDP reference run."""

from __future__ import annotations

import json
import signal
import threading

import pytest

from fedtune.train.loop import EXIT_RETRY
from tests.test_train_backends import assert_same_training
from tests.train_runs import (
    BASE_OPTIONS,
    REFERENCE_OPTIONS,
    RUN_TIMEOUT,
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
