"""`python -m fedtune.report.status` on a run folder built by hand in the formats train writes: a finished
site, one mid-training (checkpoints + a newer log line), one waiting and one failed."""

from __future__ import annotations

import json
import os
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


def finished_cluster_tree(tmp_path, transfer: str, cross_site: str = "text_to_models"):
    """The run folder of `karo` (site beta) in a 3-round federation whose models meet on `leo` (site
    alpha), as its controller leaves it when done: beta's models of every round and their COMPLETE
    markers (leo pulls), or push receipts (karo pushes), and the aggregates of rounds 1 and 2 received
    (the last round's stays on leo; with evaluate.cross_site none it comes too, to be scored, and karo's
    scores on beta's text are marked as well). Returns the config file and the run folder."""
    config = demo_config(results=str(tmp_path / "results"), federation={"rounds": 3})
    config["evaluate"] = {**config["evaluate"], "cross_site": cross_site}
    config["sites"]["alpha"]["cluster"] = "leo"
    config["sites"]["beta"]["cluster"] = "karo"
    if transfer == "pull":  # each cluster pulls what it needs from the other
        remotes = {"karo": "me@karo:/scratch/results/demo", "leo": "me@leo:/scratch/results/demo"}
    else:  # karo pushes its models to leo
        remotes = {"leo": {"path": "me@leo:/scratch/results/demo", "transfer": "push"}}
    config["federation"].update(aggregate_on="leo", remotes=remotes)
    config_file = write_config(tmp_path, config)
    run = tmp_path / "results" / "demo"
    (run / "data" / "beta").mkdir(parents=True)
    (run / "data" / "beta" / "manifest.json").write_text("{}")
    for r in (1, 2, 3):
        model = run / f"round-{r}" / "beta" / "model"
        model.mkdir(parents=True)
        (model / "training.json").write_text(
            json.dumps({"site": "beta", "steps": 30, "final_loss": 4.0 - r / 10, "wall_time_s": 50.0})
        )
        (model / "loss.csv").write_text(loss_log(30))
    # ... and, after its last job, its job accounting for the report's cost table.
    items = (
        ["data/beta/manifest.json"]
        + [f"round-{r}/beta/model" for r in (1, 2, 3)]
        + ["report/cost_jobs-karo.csv"]
    )
    if cross_site == "none":
        # Rounds 1 and 2's aggregates scored by beta's next training before it trains, round 3's models
        # by an evaluation job.
        items += [
            "eval/base/beta.json",
            "round-2/beta/before/aggregate.json",
            "round-3/beta/before/aggregate.json",
        ]
        items += ["round-3/eval/aggregate/beta.json", "round-3/eval/beta/beta.json"]
    for item in items:
        record = run / (f"sent/leo/{item}.COMPLETE" if transfer == "push" else f"{item}.COMPLETE")
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text("0" * 64 + "  training.json\n")
    received = ((1, 1_800_000_000), (2, 1_800_003_600)) + ((3, 1_800_007_200),) * (cross_site == "none")
    for r, when in received:
        (run / f"round-{r}" / "aggregate" / "model").mkdir(parents=True)
        log = run / "logs" / "fetch_aggregate" / f"{r}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("[transfer] fetched ...\n")
        os.utime(log, (when, when))
    return config_file, run


@pytest.mark.parametrize("transfer", ["pull", "push"])
def test_status_on_the_cluster_where_the_models_do_not_meet(tmp_path, transfer):
    """Started with karo's profile (its `config: cluster: karo`), status reports karo's part of the
    finished run: its site's trainings, everything it sent, the newest aggregate it received; not leo's
    site as waiting nor the aggregates and the report as pending."""
    config_file, run_dir = finished_cluster_tree(tmp_path, transfer)
    profile = tmp_path / "profiles" / "karo"
    profile.mkdir(parents=True)
    (profile / "config.yaml").write_text("executor: slurm\nconfig:\n  cluster: karo\n")
    result = subprocess.run(
        [sys.executable, "-m", "fedtune.report.status", "--configfile", str(config_file), "--profile",
         str(profile)],
        cwd=tmp_path, capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": ""},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "cluster: karo (the models meet on leo)" in lines
    table = [line.split() for line in lines if line.split()[:1] in (["1"], ["2"], ["3"])]
    assert [(row[0], row[1], row[2]) for row in table] == [(str(r), "beta", "done") for r in (1, 2, 3)]
    assert not any("alpha" in line or "waiting" in line or "pending" in line for line in lines), lines
    verb = "sent to" if transfer == "push" else "ready for"
    sent = [line for line in lines if line.startswith("sent: ")]
    assert sent[0].startswith(f"sent: beta's manifest: {verb} leo at ")
    assert [line.split(":")[1] for line in sent[1:]] == [f" beta's model of round {r}" for r in (1, 2, 3)] + [
        " karo's job accounting of round 3"
    ]
    assert all(f": {verb} leo at " in line for line in sent)
    assert (
        "received: round 2's aggregate from leo at 2027-01-15 09:00:00 UTC "
        "(2 of the 2 it sends; the last round's stays there)"
    ) in lines
    assert lines[-1] == "report: written on leo"

    # With evaluate.cross_site none, karo also sends its scores on beta's text and receives the last aggregate.
    (tmp_path / "home").mkdir()
    home_config, _ = finished_cluster_tree(tmp_path / "home", transfer, cross_site="none")
    result = subprocess.run(
        [sys.executable, "-m", "fedtune.report.status", "--configfile", str(home_config), "--profile",
         str(profile)],
        cwd=tmp_path / "home", capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": ""},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    sent = [line.split(":")[1] for line in lines if line.startswith("sent: ") and "score" in line]
    # Rounds 1 and 2's aggregates are scored by beta's next training (intermediate aggregate), the last
    # round's models by an evaluation job.
    made = {1: "round-2/beta/before/aggregate.json", 2: "round-3/beta/before/aggregate.json"}
    assert sent == [" the score of base on beta's text (eval/base/beta.json)"] + [
        f" the score of {model} on beta's text ({made.get(r) or f'round-{r}/eval/{model}/beta.json'}) of round {r}"
        for r, model in ((1, "aggregate"), (2, "aggregate"), (3, "beta"), (3, "aggregate"))
    ], lines
    assert all(f": {verb} leo at " in line for line in lines if line.startswith("sent: "))
    assert "received: round 3's aggregate from leo at 2027-01-15 10:00:00 UTC (3 of the 3 it sends)" in lines

    # Where the models meet, every site's model comes in and is evaluated.
    layout = layout_from_config(config_file, cluster="leo")
    assert layout.sites == ("alpha", "beta") and layout.aggregates_here
    (run_dir / "round-3" / "beta" / "model.COMPLETE").unlink(missing_ok=True)
    (run_dir / "sent" / "leo" / "round-3" / "beta" / "model.COMPLETE").unlink(missing_ok=True)
    status = collect(layout_from_config(config_file, cluster="karo"))
    assert [item["done"] for item in status["sent"]] == [True, True, True, False, True]
    assert status["received"]["round"] == 2 and status["report"] is None


def test_status_refuses_a_cluster_the_config_does_not_know(tmp_path):
    config_file, _ = finished_cluster_tree(tmp_path, "pull")
    result = subprocess.run(
        [sys.executable, "-m", "fedtune.report.status", "--configfile", str(config_file), "--cluster", "leonard"],
        cwd=tmp_path, capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": ""},
    )  # fmt: skip
    assert result.returncode == 2
    # build_run_config's start check, which the workflow runs too.
    assert "cluster: 'leonard' trains no site and does not aggregate" in result.stderr
    assert "this config's clusters are karo, leo" in result.stderr


def test_status_reads_the_cluster_each_profile_sets():
    """The cluster profiles are yte templates whose account expressions need the environment: status reads
    only their `config: cluster:`, with no account set."""
    from fedtune.core.clusters import site_clusters
    from fedtune.report.status import profile_cluster

    for cluster in site_clusters():
        assert profile_cluster(ROOT / "profiles" / cluster) == cluster
    assert profile_cluster(ROOT / "profiles" / "local") is None


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
