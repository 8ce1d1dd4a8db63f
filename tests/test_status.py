"""`python -m fedtune.report.status` on a run folder built by hand in the formats train writes: a finished
site, one mid-training (checkpoints + a newer log line), one waiting and one failed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fedtune.report.status import collect, layout_from_config
from fedtune.train import checkpoint

from .workflow_harness import ROOT, demo_config, write_config

HEADER = "step,epoch,loss,lr,grad_norm,tokens_per_s,peak_mem_mb\n"


def loss_log(steps: int) -> str:
    rows = [
        f"{s},1,{5 - s / 100:.6f},3.000000e-03,0.500000,{1000 + s:.1f},250.0\n" for s in range(1, steps + 1)
    ]
    return HEADER + "".join(rows)


def write_checkpoint(root, step, total, wall):
    folder = root / checkpoint.name(step)
    folder.mkdir(parents=True)
    (folder / checkpoint.TRAINER_STATE).write_text(
        json.dumps({"step": step, "total_steps": total, "wall_time_s": wall, "tokens_trained": step * 2048})
    )
    (folder / checkpoint.LOSS_LOG).write_text(loss_log(step))


@pytest.fixture()
def run(tmp_path):
    results = tmp_path / "results"
    config = demo_config(results=str(results), federation={"rounds": 2})
    config["evaluate"]["intermediate"] = "all"  # every model of every round: 6 evaluations a round
    config_file = write_config(tmp_path, config)
    run = results / "demo"
    # round 1, alpha: finished (model folder written, checkpoints removed)
    model = run / "round-1" / "alpha" / "model"
    model.mkdir(parents=True)
    (model / "training.json").write_text(
        json.dumps({"site": "alpha", "steps": 60, "final_loss": 4.4, "wall_time_s": 95.5})
    )
    (model / "loss.csv").write_text(loss_log(60))
    # round 1, beta: checkpoints at 20 and 40, a half-written one, and a log that reached step 50
    ckpts = run / "round-1" / "beta" / "checkpoints"
    write_checkpoint(ckpts, 20, 60, 44.0)
    write_checkpoint(ckpts, 40, 60, 80.0)
    (ckpts / ".step-00000060.tmp").mkdir()
    logs = run / "logs" / "train" / "round-1"
    logs.mkdir(parents=True)
    (logs / "beta.log").write_text(
        "rank 0/2 on host h (cpu, torchrun)\n"
        "step 1/60 | loss 5.0100 | lr 3.00e-04 | grad_norm 1.000 | 900 tok/s | peak 250 MB | epoch 0.02\n"
        "checkpoint results/demo/round-1/beta/checkpoints/step-00000040\n"
        "step 50/60 | loss 4.5000 | lr 1.00e-03 | grad_norm 0.400 | 12,345 tok/s | peak 250 MB | epoch 0.83\n"
    )
    # round 2, beta: a job that stopped on an error
    (run / "logs" / "train" / "round-2").mkdir(parents=True)
    (run / "logs" / "train" / "round-2" / "beta.log").write_text("error: --manifest: not found\n")
    # round 1's aggregate and half of its evaluations
    (run / "round-1" / "aggregate" / "model").mkdir(parents=True)
    (run / "round-1" / "aggregate" / "model" / "aggregate.json").write_text("{}")
    # The report folder exists early (settings.json); the report is written when its main table is.
    (run / "report").mkdir()
    (run / "report" / "settings.json").write_text("{}")
    for model_name, site in [("alpha", "alpha"), ("alpha", "beta"), ("aggregate", "alpha")]:
        path = run / "round-1" / "eval" / model_name / f"{site}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
    return config_file, run


def test_status_reads_progress_from_the_run_folder(run, monkeypatch):
    config_file, run_dir = run
    monkeypatch.chdir(config_file.parent)
    layout = layout_from_config(config_file)
    assert layout.run_dir == run_dir and layout.rounds == 2 and layout.sites == ("alpha", "beta")
    status = collect(layout)
    sites = {(s["round"], s["site"]): s for s in status["sites"]}
    done = sites[1, "alpha"]
    assert (done["state"], done["step"], done["total_steps"], done["loss"]) == ("done", 60, 60, 4.4)
    assert done["tokens_per_s"] == 1060.0 and done["elapsed_s"] == 95.5 and done["eta_s"] == 0
    training = sites[1, "beta"]
    # The log's step 50 is newer than the checkpoint at 40; the half-written step-60 folder is not one.
    assert (training["state"], training["step"], training["total_steps"]) == ("training", 50, 60)
    assert training["checkpoint"] == "step-00000040"
    assert (training["loss"], training["tokens_per_s"]) == (4.5, 12345.0)
    # 80 s for 40 steps -> 2 s a step, 10 steps to go.
    assert training["eta_s"] == pytest.approx(20.0)
    assert sites[2, "alpha"]["state"] == "waiting" and sites[2, "alpha"]["step"] is None
    assert sites[2, "beta"]["state"] == "failed"
    assert status["rounds"][0] == {"round": 1, "aggregate": True, "evaluations": 3, "evaluations_expected": 6}
    assert status["rounds"][1]["aggregate"] is False and status["report"] is False


def test_status_checkpoint_only_uses_the_checkpoints_loss(run, monkeypatch):
    config_file, run_dir = run
    (run_dir / "logs" / "train" / "round-1" / "beta.log").unlink()
    monkeypatch.chdir(config_file.parent)
    beta = collect(layout_from_config(config_file))["sites"][1]
    assert (beta["step"], beta["loss"], beta["tokens_per_s"]) == (40, 4.6, 1040.0)
    assert beta["elapsed_s"] == 80.0 and beta["eta_s"] == pytest.approx(40.0)


def test_status_cli_prints_a_table(run):
    config_file, _ = run
    result = subprocess.run(
        [sys.executable, "-m", "fedtune.report.status", "--configfile", str(config_file)],
        cwd=config_file.parent, capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": ""},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    beta = next(line for line in lines if line.split()[:2] == ["1", "beta"])
    assert beta.split() == [
        "1",
        "beta",
        "training",
        "50/60",
        "step-00000040",
        "4.5000",
        "12,345",
        "0:01:20",
        "0:00:20",
    ]
    assert "round 1: aggregate done, evaluations 3/6" in lines


def test_status_names_a_missing_config(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "fedtune.report.status", "--configfile", str(tmp_path / "nope.yaml")],
        cwd=tmp_path, capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": ""},
    )  # fmt: skip
    assert result.returncode == 2 and "nope.yaml: config file not found" in result.stderr


def test_a_finished_jobs_speed_is_its_steps_mean_in_status_and_in_the_report(tmp_path):
    """training.json's tokens_per_s: tokens over the seconds of the training steps (each loss row's
    tokens/s is a step's tokens over its seconds), which status and the report's training table both
    show; the report adds the whole job's, over the wall time (9,341 against 1,901 in a demo once,
    both under one name)."""
    from fedtune.report.build import training_table
    from fedtune.report.status import site_status
    from fedtune.train.loop import TrainingProgress

    rows = HEADER + "1,1,5.0,0.003,0.5,1000.0,250\n2,1,4.9,0.003,0.5,4000.0,250\n"
    progress = TrainingProgress()
    progress.load_state_dict({"step": 2, "tokens_trained": 4096, "wall_time_s": 0.0}, rows)
    assert progress.step_time_s(2048) == pytest.approx(2048 / 1000 + 2048 / 4000)  # 2.56 s
    model = tmp_path / "round-1" / "alpha" / "model"
    model.mkdir(parents=True)
    (model / "loss.csv").write_text(rows)
    summary = {"site": "alpha", "steps": 2, "tokens_seen": 4096, "final_loss": 4.9, "wall_time_s": 20.48,
               "step_time_s": 2.56, "tokens_per_s": 1600.0}  # fmt: skip
    (model / "training.json").write_text(json.dumps(summary))
    status = site_status(tmp_path, 1, "alpha")
    assert status.tokens_per_s == 1600.0  # not the last step's 4,000
    (row,) = training_table([(1, "alpha", model / "training.json")]).to_dict("records")
    assert row["tokens_per_s"] == 1600.0 and row["job_tokens_per_s"] == pytest.approx(200.0)
