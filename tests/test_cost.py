"""The report's cost table (fedtune.report.cost) and the job records it reads (fedtune.core.job_record):
each command's record, sacct's fields (a stand-in sacct on PATH, and none at all), the bytes the crossing
markers list, the wait for another cluster, and the tables built from them. The demo's report has the table
(tests/test_demo.py); a slurm-local run's is checked against the real sacct (tests/test_slurm_local.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from fedtune.core import cli
from fedtune.core.job_record import ENV
from fedtune.report import cost


@cli.entry("fedtune.train.loop")
def _fake_train(argv=None) -> int:
    time.sleep(0.05)
    return 0


@cli.entry("fedtune.aggregate.merge")
def _fake_stopped(argv=None) -> int:
    raise SystemExit(75)


def test_each_command_leaves_a_record_of_its_job(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "jobs"))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    called = time.time()
    assert _fake_train(["--out", "results/demo/round-2/alpha/model"]) == 0
    with pytest.raises(SystemExit):
        _fake_stopped(["--out", "results/demo/round-2/aggregate/model"])
    records = {r["command"]: r for r in cost.load_records(tmp_path / "jobs")}
    assert set(records) == {"fedtune.train", "fedtune.aggregate"}
    train = records["fedtune.train"]
    assert train["slurm_job_id"] == "4242" and train["processes"] == 4 and train["exit_code"] == 0
    # From the process's start (its imports count), not from the call; to its end.
    assert train["started"] < called - 0.5 and train["ended"] - called >= 0.05
    assert records["fedtune.aggregate"]["exit_code"] == 75
    assert cost.classify(train) == ("training", 2, "alpha")


def test_no_record_without_the_folder_or_on_another_rank(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    _fake_train(["--out", "x"])
    monkeypatch.setenv(ENV, str(tmp_path / "jobs"))
    monkeypatch.setenv("RANK", "1")
    _fake_train(["--out", "x"])
    assert not (tmp_path / "jobs").exists()


SACCT_LINES = (
    # Two nodes with two GPUs each for 1 h, 40 s in the queue, 7.2 MJ; a job of a site without energy.
    "101|2026-11-28T01:00:00|2026-11-28T01:00:40|2026-11-28T02:00:40|3600|2|billing=4,cpu=4,gres/gpu=4,mem=2G,node=2|7200000\n"
    "102|2026-11-28T02:01:00|2026-11-28T02:01:05|2026-11-28T02:11:05|600|1|cpu=1,mem=1G,node=1|0\n"
)


def _fake_sacct(folder: Path, text: str = SACCT_LINES, code: int = 0) -> None:
    folder.mkdir(exist_ok=True)
    script = folder / "sacct"
    (folder / "lines").write_text(text)
    script.write_text(f'#!/bin/sh\necho "$@" > {folder}/args\ncat {folder}/lines\nexit {code}\n')
    script.chmod(0o755)


def test_sacct_fields_become_queue_hours_and_energy(tmp_path, monkeypatch):
    _fake_sacct(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    jobs, note = cost.slurm_accounting(["101", "102"])
    assert note == ""
    assert (
        "-X" in (tmp_path / "bin" / "args").read_text()
        and "101,102" in (tmp_path / "bin" / "args").read_text()
    )
    assert jobs["101"].queue_s == 40 and jobs["101"].nodes == 2 and jobs["101"].gpus == 4
    assert jobs["101"].energy_j == 7.2e6
    assert jobs["102"].energy_j is None and jobs["102"].gpus == 0


def test_without_sacct_the_table_says_not_available(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sacct
    assert cost.slurm_accounting(["101"]) == ({}, "sacct not found")
    _fake_sacct(tmp_path / "bin", "", code=1)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    jobs, note = cost.slurm_accounting(["101"])
    assert jobs == {} and note.startswith("sacct failed")


def _record(folder: Path, command: str, argv: list[str], started: float, wall: float, **extra) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    record = {"command": command, "argv": argv, "started": started, "ended": started + wall, **extra}
    (folder / f"{command}-{len(list(folder.iterdir()))}.json").write_text(json.dumps(record))


def _item(run: Path, item: str, sizes: dict[str, int], mtime: float) -> None:
    folder = run / item
    folder.mkdir(parents=True)
    lines = []
    for name, size in sizes.items():
        (folder / name).write_bytes(b"x" * size)
        os.utime(folder / name, (mtime, mtime))
        lines.append(f"{'0' * 64}  {folder.name}/{name}\n")
    return "".join(lines)


def test_a_two_cluster_round_under_slurm(tmp_path, monkeypatch):
    """The aggregating cluster's view: its own site trained in job 101, the other's model fetched (it was
    ready 30 s after the fetch began), the merge and the evaluation sharing job 102."""
    run, jobs_dir, t0 = tmp_path / "run", tmp_path / "run" / "logs" / "jobs", 1_800_000_000.0
    _record(jobs_dir, "fedtune.train", ["--out", f"{run}/round-1/alpha/model"], t0, 3600, slurm_job_id="101")
    _record(jobs_dir, "fedtune.core.transfer",
            ["fetch", "--out", "run/round-1/beta/model", "--round", "1"], t0 + 100, 50)  # fmt: skip
    _record(
        jobs_dir,
        "fedtune.aggregate",
        ["--out", "round-1/aggregate/model"],
        t0 + 3700,
        150,
        slurm_job_id="102",
    )
    _record(jobs_dir, "fedtune.evaluate", ["--label", "aggregate", "--round", "1"], t0 + 3850, 450,
            slurm_job_id="102")  # fmt: skip
    _item(run, "round-1/beta/model", {"model.safetensors": 1000, "config.json": 24}, t0 + 130)
    # The marker in the outbox lists what travels: only what it names counts (compressed files, say).
    outbox = run / "exchange" / "outbox" / "round-1" / "aggregate"
    marker_text = _item(run / "exchange" / "outbox", "round-1/aggregate/model", {"delta.int8": 300}, t0)
    (outbox / "model.COMPLETE").write_text(marker_text)
    _fake_sacct(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)  # the workflow's directory: a fetch's --out is relative to it
    job = cost.CostJob(
        run, run / "report", settings={"cluster": "karolina", "sites": {"alpha": {"cluster": "karolina"},
                                                                      "beta": {"cluster": "leonardo"}}},
        crossings=[cost.CrossingItem(1, "leonardo", "karolina", "round-1/beta/model"),
                   cost.CrossingItem(1, "karolina", "leonardo", "round-1/aggregate/model")],
    )  # fmt: skip
    paths = cost.cost_report(job)
    table = pd.read_csv(paths["cost.csv"]).set_index(["round", "cluster"])
    row = table.loc[(1, "karolina")]
    assert row["bytes_received"] == 1024 and row["bytes_sent"] == 300
    assert table.loc[(1, "leonardo")]["bytes_sent"] == 1024
    assert row["training_s"] == 3600 and row["merge_s"] == 150 and row["evaluation_s"] == 450
    assert row["wait_s"] == pytest.approx(30) and row["transfer_s"] == pytest.approx(20)
    assert row["queue_s"] == 45  # each job's queue once: 40 + 5
    # Job 101: 1 h x 2 nodes; job 102: 600 s x 1 node, shared by the merge and the evaluation; the fetch
    # (local) counts its wall time x 1 process.
    assert row["node_hours"] == pytest.approx(2 + 600 / 3600 + 50 / 3600)
    assert row["gpu_hours"] == pytest.approx(4)
    # Job 102 and the fetch in the controller are not measured: no partial sum passes for the whole.
    assert row["energy_kwh"] == f"{cost.NOT_MEASURED_LOCAL}; {cost.NOT_MEASURED}"
    jobs = pd.read_csv(paths["cost_jobs.csv"])
    merge = jobs[jobs["stage"] == "merge"].iloc[0]
    assert merge["node_hours"] == pytest.approx(600 / 3600 * 150 / 600)
    assert jobs[jobs["stage"] == "training"].iloc[0]["energy_kwh"] == "2.0"
    assert "| 1 | karolina |" in paths["cost.md"].read_text()
    assert paths["cost.png"].stat().st_size > 0


def test_the_other_clusters_accounting_comes_as_its_own_table(tmp_path, monkeypatch):
    """The cluster where the models do not meet writes its commands with its own sacct (--jobs-only); the
    aggregating cluster's table then has its rows and node-hours, not the training.json estimate."""
    karo, leo, t0 = tmp_path / "karo", tmp_path / "leo", 1_800_000_000.0
    _record(karo / "logs" / "jobs", "fedtune.evaluate", ["--label", "aggregate", "--round", "1"], t0, 150,
            slurm_job_id="101")  # fmt: skip
    _record(karo / "logs" / "jobs", "fedtune.train", ["--out", f"{karo}/round-2/beta/model"], t0 + 150, 3450,
            slurm_job_id="101")  # fmt: skip
    _fake_sacct(tmp_path / "bin")
    env = dict(
        os.environ,
        PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        PYTHONPATH=str(Path(__file__).parent.parent),
    )
    part = leo / "report" / "cost_jobs-karo.csv"
    subprocess.run(
        [sys.executable, "-m", "fedtune.report.cost", "--jobs-only", "karo", "--run", str(karo), "--out", str(part)],
        check=True, env=env, capture_output=True,
    )  # fmt: skip
    training = karo / "round-2" / "beta" / "model" / "training.json"
    training.parent.mkdir(parents=True)
    training.write_text(json.dumps({"wall_time_s": 3400.0, "tokens_seen": 100}))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    settings = {"cluster": "leo", "sites": {"alpha": {"cluster": "leo"}, "beta": {"cluster": "karo"}}}
    job = cost.CostJob(
        leo, leo / "report", settings=settings, training=[(2, "beta", training)], remote_jobs=[part]
    )
    paths = cost.cost_report(job)
    table = pd.read_csv(paths["cost.csv"]).set_index(["round", "cluster"])
    # Job 101 (sacct: 1 h x 2 nodes) shared by the scoring of round 1 and the training of round 2.
    assert table.loc[(1, "karo")]["evaluation_s"] == 150
    assert table.loc[(2, "karo")]["training_s"] == 3450
    hours = table.loc[(1, "karo")]["node_hours"] + table.loc[(2, "karo")]["node_hours"]
    assert hours == pytest.approx(2)
    jobs = pd.read_csv(paths["cost_jobs.csv"])
    assert set(jobs["accounting"]) == {"sacct"}  # no "training.json only" estimate for beta
    bad = leo / "bad.csv"
    bad.write_text("round,cluster\n1,karo\n")
    with pytest.raises(cost.ReportError, match="bad.csv: no column stage"):
        cost.cost_report(cost.CostJob(leo, leo / "report", settings=settings, remote_jobs=[bad]))


def test_a_local_run_counts_wall_time_times_processes(tmp_path, monkeypatch):
    run, t0 = tmp_path / "run", 1_800_000_000.0
    jobs_dir = run / "logs" / "jobs"
    for rnd in (1, 2):
        _record(jobs_dir, "fedtune.train", ["--out", f"round-{rnd}/alpha/model"], t0, 360, processes=2)
        _record(jobs_dir, "fedtune.evaluate", ["--label", "aggregate", "--round", str(rnd)], t0, 36)
    _record(jobs_dir, "fedtune.train", ["--out", "pooled/model"], t0, 720, processes=2)
    evals = []
    for model, rnd, value in (("aggregate", 1, 20.0), ("aggregate", 2, 10.0), ("pooled", 0, 9.0)):
        path = tmp_path / f"{model}-{rnd}.json"
        path.write_text(json.dumps({"model": model, "round": rnd, "site": "alpha", "perplexity": value}))
        evals.append(path)
    monkeypatch.setenv("PATH", str(tmp_path))  # no sacct, and none needed: no Slurm job
    paths = cost.cost_report(cost.CostJob(run, run / "report", evals=evals))
    table = pd.read_csv(paths["cost.csv"])
    assert list(table["round"]) == [1, 2] and set(table["cluster"]) == {"local"}
    assert list(table["node_hours"]) == pytest.approx([0.2 + 0.01, 0.2 + 0.01])
    assert set(table["energy_kwh"]) == {cost.NOT_MEASURED_LOCAL}
    summary = pd.read_csv(paths["cost_summary.csv"]).set_index("model")
    assert summary.loc["federation", "value"] == 10.0 and summary.loc["federation", "round"] == 2
    assert summary.loc["federation", "node_hours_training"] == pytest.approx(0.4)
    assert summary.loc["pooled baseline", "node_hours_training"] == pytest.approx(0.4)
    # Against the pooled baseline, which reads the right way: 10 / 9 its perplexity (worse, above 1) at
    # 0.42 / 0.4 its node-hours. No metric divided by node-hours, where a worse perplexity scored higher.
    assert "value_per_node_hour" not in summary.columns
    assert summary.loc["federation", "value_vs_pooled"] == pytest.approx(10 / 9)
    assert summary.loc["federation", "node_hours_vs_pooled"] == pytest.approx(0.42 / 0.4)
    assert summary.loc["pooled baseline", "value_vs_pooled"] == 1.0
    text = paths["cost.md"].read_text()
    assert "value_vs_pooled: the metric as a multiple of the pooled baseline's" in text
    assert "| federation | 2 |" in text and "| 1.111 | 1.050 |" in text, text


def test_cost_figure_keeps_its_legend_off_the_bars_labels(tmp_path, monkeypatch):
    """issue 48: the legend sat inside the axes, over the node-hours label of a bar. Now it is outside
    them, and no label's box meets the legend's."""
    import matplotlib.pyplot as plt

    monkeypatch.setattr(plt, "close", lambda *args: None)
    rows = [
        {"round": r, "cluster": c, **{k: 0.0 for k in cost.TIME_COLUMNS}, "training_s": 300.0 + 40 * r,
         "evaluation_s": 60.0, "transfer_s": 20.0 if c == "leo" else 0.0, "node_hours": 0.1 + 0.02 * r}
        for r in (1, 2, 3) for c in ("leo", "karo")
    ]  # fmt: skip
    before = set(plt.get_fignums())
    cost.cost_figure(pd.DataFrame(rows), tmp_path / "cost.png")
    (number,) = set(plt.get_fignums()) - before
    fig = plt.figure(number)
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    labels = [text for text in ax.texts if text.get_text().endswith(" nh")]
    assert len(labels) == 6
    for text in labels:
        assert not text.get_window_extent(renderer).overlaps(legend), text.get_text()
        # ... and each label lies inside the axes (headroom above the tallest bar).
        assert ax.get_window_extent(renderer).contains(*text.get_window_extent(renderer).get_points()[1])
    plt.close(fig)


def test_cli_refuses_a_bad_crossing(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "fedtune.report.cost", "--run", str(tmp_path), "--out", str(tmp_path / "r"),
         "--crossing", "one:a=b"],
        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent)),
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "fedtune.report.cost: error: --crossing: 'one:a=b' is not ROUND:MAKER:RECEIVER=ITEM"
    )


def test_a_compressed_exchange_counts_each_update_both_ways(tmp_path, monkeypatch):
    """federation.exchange int8, the aggregating cluster's view: what the report rule passes as crossings
    (fedtune.run.crossings) is beta's update up and the aggregate's update back, and the table counts
    each as its update's files, never the model folders beside them."""
    from fedtune.run.config import build_run_config
    from fedtune.run.crossings import crossing_items

    from .test_data_stays import two_clusters

    config = two_clusters(private=(), aggregate_on="leo", rounds=2, exchange={"dtype": "int8"})
    config["cluster"] = "leo"
    crossings = [
        cost.CrossingItem(c.round, c.maker, c.receiver, c.item)
        for c in crossing_items(build_run_config(config))
        if c.round > 0  # as report.smk: the manifests are data, not a round's exchange
    ]
    assert {
        ("round-1/beta/update", "karo", "leo"),
        ("round-1/aggregate/update", "leo", "karo"),
    } <= {(c.item, c.maker, c.receiver) for c in crossings}  # and a score made at karo, not written here
    run, t0 = tmp_path / "run", 1_800_000_000.0
    for r in (1, 2):
        _item(run, f"round-{r}/beta/model", {"model.safetensors": 10_000}, t0)
        _item(run, f"round-{r}/beta/update", {"model.safetensors": 2_600 + r, "update.json": 40}, t0)
        _item(run, f"round-{r}/aggregate/model", {"model.safetensors": 10_000}, t0)
        # The aggregate's update leaves through the outbox, its marker listing what travels.
        marker = _item(
            run / "exchange" / "outbox", f"round-{r}/aggregate/update", {"model.safetensors": 2_700 + r}, t0
        )
        (run / "exchange" / "outbox" / f"round-{r}" / "aggregate" / "update.COMPLETE").write_text(marker)
    # Compressing the aggregate's update counts as the exchange's time (transfer_s), in its round.
    _record(
        run / "logs" / "jobs",
        "fedtune.core.updates",
        ["compress", "--out", "round-1/aggregate/update"],
        t0,
        30,
    )
    monkeypatch.setenv("PATH", str(tmp_path))  # no sacct: no Slurm job here
    settings = {"cluster": "leo", "sites": {"alpha": {"cluster": "leo"}, "beta": {"cluster": "karo"}}}
    paths = cost.cost_report(cost.CostJob(run, run / "report", settings=settings, crossings=crossings))
    table = pd.read_csv(paths["cost.csv"]).set_index(["round", "cluster"])
    assert table.loc[(1, "leo"), "transfer_s"] == 30
    assert table.loc[(1, "leo"), "bytes_received"] == 2_641 and table.loc[(1, "leo"), "bytes_sent"] == 2_701
    assert table.loc[(1, "karo"), "bytes_sent"] == 2_641 and table.loc[(1, "karo"), "bytes_received"] == 2_701
    items = pd.read_csv(paths["cost_items.csv"]).set_index("item")
    assert items.loc["round-1/aggregate/update", "bytes"] == 2_701
    assert (
        items.loc["round-1/aggregate/update", "counted_from"]
        == "exchange/outbox/round-1/aggregate/update.COMPLETE"
    )
    for c in crossings:  # each round's aggregate that goes back is counted from its update
        if c.maker == "leo":
            assert items.loc[c.item, "bytes"] == 2_700 + c.round
