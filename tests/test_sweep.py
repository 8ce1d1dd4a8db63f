"""Scaling sweeps: the config's sweep expands into one set of train options per value (checked when the
config loads), the report turns the runs' training.json and loss.csv into the table and plot, the Iris
example plans one Slurm job per GPU count, and a real sweep over 1 and 2 CPU processes gives the same
loss per epoch."""

from __future__ import annotations

import json
import math
import os
import re

import pandas as pd
import pytest
import yaml

from fedtune.core.options import ConfigError
from fedtune.report.sweep import main as sweep_main
from fedtune.report.sweep import sweep_table
from fedtune.run.config import build_run_config, check_config
from fedtune.run.sweep import sweep_label

from .test_profiles import CLUSTERS, local_rules, sbatch_options
from .workflow_harness import ROOT, demo_config, job_counts, planned_jobs, snakemake, write_config

OPT_EXAMPLE = ROOT / "config" / "examples" / "opt125m-yelp.yaml"


def two_process_demo() -> dict:
    """The demo with sites of two CPU processes, the node size these sweeps are laid out against."""
    config = demo_config()
    config["train"]["processes_per_node"] = 2
    return config


def demo_with_sweep(sweep: dict, **train) -> dict:
    config = two_process_demo()
    config["train"].update(train)
    config["sweep"] = sweep
    return check_config(config)


def points(config: dict) -> dict[str, dict]:
    return {point.label: point.options.section() for point in build_run_config(config).sweep}


# ---------------------------------------------------------------------------------------------------
# sweep_points


def test_devices_expand_into_nodes_and_gpus_of_the_sites_node_size():
    """The Iris example: 4 GPUs per node, so 8 and 16 devices are 2 and 4 whole nodes."""
    config = check_config(yaml.safe_load(OPT_EXAMPLE.read_text()))
    expanded = points(config)
    assert list(expanded) == ["devices-1", "devices-2", "devices-4", "devices-8", "devices-16"]
    layout = {
        label: (o["nodes"], o["processes_per_node"], o["gpus_per_node"]) for label, o in expanded.items()
    }
    assert layout == {
        "devices-1": (1, 1, 1),
        "devices-2": (1, 2, 2),
        "devices-4": (1, 4, 4),
        "devices-8": (2, 4, 4),
        "devices-16": (4, 4, 4),
    }
    # Everything else is the site's training as configured.
    site = config["train"]
    for options in expanded.values():
        assert {
            k: v for k, v in options.items() if k not in ("nodes", "processes_per_node", "gpus_per_node")
        } == {k: v for k, v in site.items() if k not in ("nodes", "processes_per_node", "gpus_per_node")}


def test_devices_on_a_cpu_site_are_processes_and_ask_for_no_gpus():
    config = demo_with_sweep({"values": [1, 2]})
    expanded = points(config)
    assert [(o["nodes"], o["processes_per_node"], o["gpus_per_node"]) for o in expanded.values()] == [
        (1, 1, 0),
        (1, 2, 0),
    ]


def test_a_train_key_axis_sets_that_key_over_the_swept_sites_overrides():
    config = two_process_demo()
    config["sites"]["beta"]["train"] = {"lr": 0.01, "global_batch": 32}
    config["sweep"] = {"site": "beta", "axis": "micro_batch", "values": [4, 8, 16]}
    expanded = points(check_config(config))
    assert list(expanded) == ["micro_batch-4", "micro_batch-8", "micro_batch-16"]
    assert [o["micro_batch"] for o in expanded.values()] == [4, 8, 16]
    assert all(o["lr"] == 0.01 and o["global_batch"] == 32 for o in expanded.values())
    assert all(o["processes_per_node"] == 2 and o["nodes"] == 1 for o in expanded.values())


def test_no_sweep_gives_no_points():
    assert build_run_config(demo_config()).sweep == ()


@pytest.mark.parametrize(
    ("axis", "value", "label"),
    [
        ("devices", 4, "devices-4"),
        ("precision", "bf16", "precision-bf16"),
        ("gradient_checkpointing", True, "gradient_checkpointing-true"),
        ("lr", 0.0005, "lr-0.0005"),
        ("max_shard_size", "1 GB/x", "max_shard_size-1_GB_x"),
    ],
)
def test_labels_are_path_safe(axis, value, label):
    assert sweep_label(axis, value) == label
    assert re.fullmatch(r"[A-Za-z0-9._-]+", label)


BAD_SWEEPS = [
    # (sweep, train overrides, message)
    ({"axis": "speed", "values": [1]}, {}, "sweep.axis: 'speed' is neither devices nor a train key"),
    ({"site": "gamma", "values": [1]}, {}, "sweep.site: 'gamma' is not a site of this config"),
    ({"values": [1, 0]}, {}, "sweep.values[1]: 0 is not a device count"),
    ({"values": ["two"]}, {}, "sweep.values[0]: 'two' is not a device count"),
    ({"values": [True]}, {}, "sweep.values[0]: True is not a device count"),
    (
        {"values": [2, 3]},
        {"launcher": "torchrun", "processes_per_node": 2},
        "sweep.values[1]: 3 devices do not fill whole nodes of 2",
    ),
    (
        {"values": [1, 4]},
        {},
        "sweep.values[1]: 4 devices need 2 nodes of 2, but the site's launcher is local",
    ),
    (
        {"values": [1, 2]},
        # The site's own 3 processes divide 27 into whole micro batches; a sweep value of 2 does not.
        {"global_batch": 27, "micro_batch": 3, "processes_per_node": 3},
        "sweep.values[1] (devices 2): global_batch: 27 must be a multiple of micro_batch (3) x world size (2) = 6",
    ),
    (
        {"axis": "micro_batch", "values": [8, 3]},
        {},
        "sweep.values[1] (micro_batch 3): global_batch: 16 must be a multiple of micro_batch (3) x world size (2) = 6",
    ),
    ({"axis": "micro_batch", "values": [8, "big"]}, {}, "sweep.values[1].micro_batch: 'big' is not of type"),
    ({"axis": "precision", "values": ["fp8"]}, {}, "sweep.values[0].precision: 'fp8' is not one of"),
    (
        {"axis": "zero_stage", "values": [1]},
        {"offload_params": True},
        "sweep.values[0] (zero_stage 1): offload_params",
    ),
    ({"values": []}, {}, "sweep.values"),
    ({"values": [1], "axes": "devices"}, {}, "sweep: Additional properties are not allowed"),
]


@pytest.mark.parametrize(("sweep", "train", "message"), BAD_SWEEPS)
def test_a_bad_sweep_is_refused_when_the_config_loads_naming_the_key(sweep, train, message):
    config = two_process_demo()
    config["train"].update(train)
    if train.get("offload_params"):
        config["train"].update(backend="deepspeed", zero_stage=3)
    config["sweep"] = sweep
    with pytest.raises(ConfigError) as error:
        check_config(config, source="my.yaml")
    assert str(error.value).startswith("my.yaml: "), error.value
    assert message in str(error.value), error.value


# ---------------------------------------------------------------------------------------------------
# The report


def fake_run(folder, *, world_size, nodes, times, losses, epochs, steps_per_epoch=2, options=None):
    """A sweep job's output: global batch 4 of 8-token blocks, so a step of t seconds is 32/t tokens/s."""
    folder.mkdir(parents=True)
    summary = {
        "site": "alpha",
        "steps": len(times),
        "epochs": len(times) / steps_per_epoch,
        "steps_per_epoch": steps_per_epoch,
        "wall_time_s": 20.0 / world_size,
        "world_size": world_size,
        "nodes": nodes,
        "global_batch": 4,
        "block_size": 8,
        "final_loss": losses[-1],
        "options": options or {"micro_batch": 2},
    }
    (folder / "training.json").write_text(json.dumps(summary))
    rows = ["step,epoch,loss,lr,grad_norm,tokens_per_s,peak_mem_mb"]
    for step, (t, loss, epoch) in enumerate(zip(times, losses, epochs, strict=True), start=1):
        rows.append(f"{step},{epoch},{loss},1e-3,1.0,{32 / t},100.0")
    (folder / "loss.csv").write_text("\n".join(rows) + "\n")
    return folder


@pytest.fixture
def two_runs(tmp_path):
    one = fake_run(
        tmp_path / "devices-1",
        world_size=1,
        nodes=1,
        times=[5.0, 1.0, 1.0, 2.0],
        losses=[4.0, 3.0, 2.0, 1.0],
        epochs=[1, 1, 2, 2],
    )
    two = fake_run(
        tmp_path / "devices-2",
        world_size=2,
        nodes=1,
        times=[5.0, 0.5, 0.5, 0.5],
        losses=[4.0, 3.0, 2.0, 1.5],
        epochs=[1, 1, 2, 2],
    )
    return one, two


def test_report_table_matches_a_hand_computation(tmp_path, two_runs, capsys):
    one, two = two_runs
    out = tmp_path / "report"
    # Given largest first: the table still starts at the smallest device count.
    assert sweep_main(["report", "--out", str(out), "--axis", "devices", "--run", str(two), str(one)]) == 0
    table = pd.read_csv(out / "sweep.csv")
    assert list(table.columns) == [
        "devices",
        "world_size",
        "nodes",
        "steps",
        "wall_time_s",
        "step_time_s",
        "time_per_epoch_s",
        "tokens_per_s",
        "speedup",
        "efficiency",
        "loss_epoch_1",
        "loss_epoch_2",
    ]
    assert table["devices"].tolist() == [1, 2] and table["world_size"].tolist() == [1, 2]
    # 1 device: steps 2-4 (the first left out) take 1, 1, 2 s: mean 4/3 s, 2 steps per epoch.
    # 2 devices: 0.5 s per step, 1 s per epoch; speedup (8/3) / 1, efficiency speedup / 2.
    expected = {
        "step_time_s": [4 / 3, 0.5],
        "time_per_epoch_s": [8 / 3, 1.0],
        "tokens_per_s": [24.0, 64.0],
        "speedup": [1.0, 8 / 3],
        "efficiency": [1.0, 4 / 3],
        "wall_time_s": [20.0, 10.0],
        "loss_epoch_1": [3.5, 3.5],
        "loss_epoch_2": [1.5, 1.75],
    }
    for column, values in expected.items():
        assert table[column].tolist() == pytest.approx(values, rel=1e-6), column
    md = (out / "sweep.md").read_text()
    assert "| devices | world_size | nodes |" in md
    assert "| 2 | 2 | 1 | 4 | 10.0 | 0.500 | 1.00 | 64 | 2.67 | 1.33 | 3.5000 | 1.7500 |" in md, md
    assert (out / "sweep.png").read_bytes().startswith(b"\x89PNG")
    assert not list(out.glob(".*tmp-*")), "temporary files left behind"
    assert "| 1 | 1 | 1 |" in capsys.readouterr().err


def test_report_on_a_train_key_axis_reads_the_value_from_the_runs_options(tmp_path):
    runs = [
        fake_run(
            tmp_path / f"mb-{mb}",
            world_size=2,
            nodes=1,
            times=[1.0, 1.0],
            losses=[2.0, 1.0],
            epochs=[1, 1],
            options={"micro_batch": mb},
        )
        for mb in (2, 1)
    ]
    table = sweep_table(runs, "micro_batch")
    assert table["micro_batch"].tolist() == [1, 2]
    assert table["efficiency"].tolist() == [1.0, 1.0]  # same world size: efficiency is the speedup


def test_report_keeps_the_given_order_of_values_that_are_not_numbers(tmp_path):
    runs = [
        fake_run(
            tmp_path / p,
            world_size=1,
            nodes=1,
            times=[1.0, t],
            losses=[2.0, 1.0],
            epochs=[1, 1],
            options={"precision": p},
        )
        for p, t in (("fp32", 2.0), ("bf16", 1.0))
    ]
    table = sweep_table(runs, "precision")
    assert table["precision"].tolist() == ["fp32", "bf16"]
    assert table["speedup"].tolist() == pytest.approx([1.0, 2.0])


def break_summary(folder):
    (folder / "training.json").write_text("{not json")
    return folder / "training.json", "not valid JSON"


def drop_summary(folder):
    (folder / "training.json").unlink()
    return folder / "training.json", "not found"


def drop_summary_key(folder):
    summary = json.loads((folder / "training.json").read_text())
    del summary["steps_per_epoch"]
    (folder / "training.json").write_text(json.dumps(summary))
    return folder / "training.json", "no numeric steps_per_epoch"


def old_loss_csv(folder):
    (folder / "loss.csv").write_text("step,loss,lr,grad_norm,tokens_per_s,peak_mem_mb\n1,2.0,1,1,10,1\n")
    return folder / "loss.csv", "no column epoch"


def text_in_loss_csv(folder):
    text = (folder / "loss.csv").read_text().replace(",3.0,", ",nan?,")
    (folder / "loss.csv").write_text(text)
    return folder / "loss.csv", "line 3: loss is 'nan?'"


def empty_loss_csv(folder):
    (folder / "loss.csv").write_text("step,epoch,loss,lr,grad_norm,tokens_per_s,peak_mem_mb\n")
    return folder / "loss.csv", "no steps"


@pytest.mark.parametrize(
    "damage", [break_summary, drop_summary, drop_summary_key, old_loss_csv, text_in_loss_csv, empty_loss_csv]
)
def test_report_names_the_bad_file_and_exits_2(tmp_path, two_runs, capsys, damage):
    one, two = two_runs
    path, message = damage(two)
    out = tmp_path / "report"
    code = sweep_main(["report", "--out", str(out), "--axis", "devices", "--run", str(one), str(two)])
    err = capsys.readouterr().err
    assert code == 2
    assert f"sweep: error: {path}: {message}" in err, err
    assert not (out / "sweep.csv").exists()


def test_report_refuses_two_runs_of_one_value_and_a_run_of_another_axis(tmp_path, two_runs, capsys):
    one, two = two_runs
    again = tmp_path / "again"
    again.mkdir()
    for name in ("training.json", "loss.csv"):
        (again / name).write_bytes((one / name).read_bytes())
    assert (
        sweep_main(
            ["report", "--out", str(tmp_path / "r"), "--axis", "devices", "--run", str(one), str(again)]
        )
        == 2
    )
    assert f"{again}: devices 1 again (also {one})" in capsys.readouterr().err
    assert sweep_main(["report", "--out", str(tmp_path / "r"), "--axis", "precision", "--run", str(one)]) == 2
    assert f"{one / 'training.json'}: options hold no 'precision'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# The Iris example, planned with its profile


def test_iris_example_plans_one_train_sweep_job_per_gpu_count(tmp_path, monkeypatch):
    for variable in [v for v in os.environ if v.startswith("FEDTUNE_") and v.endswith("_ACCOUNT")]:
        monkeypatch.delenv(variable)
    monkeypatch.setenv("FEDTUNE_ACCOUNT", "proj123")
    config = yaml.safe_load(OPT_EXAMPLE.read_text())
    (tmp_path / "config.yaml").write_text(OPT_EXAMPLE.read_text())
    result = snakemake(
        tmp_path, "-n", f"results/{config['run']}/report/sweep.csv", profile="iris", timeout=300
    )
    _, gpu_partition, _, _, _, gpu_extra = CLUSTERS["iris"]
    jobs = [job for job in planned_jobs(result.stdout) if job.name not in local_rules()]
    assert "train" not in {job.name for job in jobs}, "the sweep report needs no site model"
    sweep_jobs = {job.wildcards["label"]: sbatch_options(job) for job in jobs if job.name == "train_sweep"}
    labels = sorted(f"devices-{v}" for v in config["sweep"]["values"])
    assert sorted(sweep_jobs) == labels, result.stdout[-3000:]
    for devices in config["sweep"]["values"]:
        options = sweep_jobs[f"devices-{devices}"]
        nodes, per_node = math.ceil(devices / 4), min(devices, 4)
        # torchrun: one Slurm task per node (left at its default of 1 on one node), with the CPUs of
        # all the node's processes.
        assert (f"--ntasks={nodes}" in options) if nodes > 1 else ("--ntasks" not in options), options
        for expected in [
            f"--nodes={nodes}",
            f"--gres=gpu:{per_node}",
            f"--cpus-per-task={7 * per_node}",
            f"-p {gpu_partition}",
            *gpu_extra,
        ]:
            assert expected in options, (devices, expected, options)
        assert "--signal" not in options, options  # the launcher times the signal (docs/clusters.md)
    assert re.search(r"^(local)?rule sweep_report:$", result.stdout, re.M), result.stdout[-3000:]


# ---------------------------------------------------------------------------------------------------
# A real sweep


def test_sweep_over_one_and_two_cpu_processes_gives_the_same_loss_per_epoch(tmp_path):
    """The demo's site alpha on 100 documents (about 60 blocks: 3 steps of 16 per epoch), 2 epochs, on 1
    and 2 processes. Only download, tokenize and the sweep's jobs run for the sweep report."""
    config = two_process_demo()
    del config["sites"]["beta"]
    config["sites"]["alpha"]["dataset"]["max_documents"] = 100
    config["tokenize"]["shards"] = 1
    config["train"].update(max_steps=None, epochs=2, warmup_steps=1, checkpoint_every=0, log_every=1)
    config["sweep"] = {"axis": "devices", "values": [1, 2]}
    write_config(tmp_path, config)
    run = tmp_path / "results" / "demo"
    result = snakemake(tmp_path, "--cores", "2", "results/demo/report/sweep.csv", timeout=600)
    ran = set(re.findall(r"^(?:local)?rule (\w+):$", result.stdout + result.stderr, re.M))
    assert ran == {
        "download_data",
        "download_model",
        "tokenize",
        "tokenize_manifest",
        "train_sweep",
        "sweep_report",
    }, ran

    table = pd.read_csv(run / "report" / "sweep.csv")
    assert table["devices"].tolist() == [1, 2] and table["world_size"].tolist() == [1, 2]
    assert table["nodes"].tolist() == [1, 1]
    losses = [c for c in table.columns if c.startswith("loss_epoch_")]
    assert losses == ["loss_epoch_1", "loss_epoch_2"], table.columns
    for column in losses:
        one, two = table[column]
        assert math.isfinite(one) and abs(one - two) <= 1e-4 * abs(one), (column, one, two)
    # Training happened: the second epoch's loss is below the first's.
    assert (table["loss_epoch_2"] < table["loss_epoch_1"]).all()
    assert (table["time_per_epoch_s"] > 0).all() and table["speedup"].iloc[0] == 1.0
    for label, world in (("devices-1", 1), ("devices-2", 2)):
        folder = run / "sweep" / "alpha" / label
        summary = json.loads((folder / "training.json").read_text())
        assert summary["world_size"] == world and summary["epochs"] == 2.0
        assert summary["steps"] == 2 * summary["steps_per_epoch"] > 2
        # No weights (Snakemake adds its own hidden timestamp file to directory outputs).
        assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == [
            "loss.csv",
            "training.json",
        ]
    assert (run / "report" / "sweep.md").is_file() and (run / "report" / "sweep.png").is_file()
    assert not (run / "round-1").exists()


@pytest.mark.parametrize(
    ("sweep", "cluster", "jobs"),
    [
        ({"values": [1, 2]}, None, 2),
        (None, None, 0),
        # The swept site trains on another cluster: its sweep runs there, not here.
        ({"values": [1, 2]}, "elsewhere", 0),
    ],
)
def test_rule_all_has_the_sweep_where_its_site_trains(tmp_path, sweep, cluster, jobs):
    config = two_process_demo() | {"sweep": sweep, "cluster": cluster}
    if cluster:  # beta trains there (a cluster with nothing to do is refused); alpha, the swept one, not
        config["sites"]["beta"]["cluster"] = cluster
        remotes = {"local": "me@host:/run"}  # where the aggregate comes from; no pooled model across two
        config["federation"] = {**config["federation"], "remotes": remotes, "pooled_baseline": False}
    write_config(tmp_path, config)
    counts = job_counts(snakemake(tmp_path, "-n", "--forceall").stdout)
    assert counts.get("train_sweep", 0) == jobs, counts
    assert counts.get("sweep_report", 0) == (1 if jobs else 0), counts
