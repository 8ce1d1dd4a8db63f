"""The report's cost table for a run on the local Slurm cluster (scripts/slurm-local): one round of the demo,
site alpha trained on two nodes, and every field the table takes from Slurm's accounting checked against
`sacct` here."""

from __future__ import annotations

import pandas as pd
import pytest

from fedtune.report.cost import NOT_MEASURED, parse_tres

from .slurm_harness import running_cluster
from .workflow_harness import demo_config, snakemake, write_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm_cluster():
    yield from running_cluster()


@pytest.fixture(scope="module")
def cost_run(slurm_cluster, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("slurm-cost")
    config = demo_config()
    config["tokenize"]["shards"] = 1
    config["federation"].update(rounds=1, pooled_baseline=False)
    for site in config["sites"].values():
        site["cluster"] = "slurm-local"
        site["dataset"]["max_documents"] = 300
    config["train"].update(max_steps=3, warmup_steps=1, checkpoint_every=0, log_every=1)
    config["sites"]["alpha"]["train"] = {
        "nodes": 2, "processes_per_node": 1, "launcher": "srun", "mem_mb": 2000, "runtime": 20,
    }  # fmt: skip
    write_config(workdir, config)
    # A round's group job (merge and evaluations) asks for the sum of the parts that may run at once: the
    # aggregate's 4000 MB and two evaluations' 4097 MB each are more than a slurm-local node's 8000 MB.
    # (The profile's set-resources are given again: the option replaces them.)
    resources = [
        "aggregate:mem_mb=2000",
        "evaluate_round:mem_mb=2000",
        "tokenize:mem_mb=3000",
        "tokenize:runtime=20",
    ]
    snakemake(
        workdir,
        "results/demo/report/cost.csv",
        "--set-resources",
        *resources,
        profile="slurm-local",
        timeout=1200,
    )
    return workdir / "results" / "demo", slurm_cluster


def _sacct(cluster, job_id: str) -> dict[str, str]:
    fields = ["JobID", "Submit", "Start", "ElapsedRaw", "NNodes", "AllocTRES", "ConsumedEnergyRaw", "State"]
    line = cluster.run("sacct", "-X", "-n", "-P", "-j", job_id, "-o", ",".join(fields)).stdout.splitlines()[
        -1
    ]
    return dict(zip(fields, line.split("|"), strict=True))


def test_the_cost_table_of_a_slurm_run_agrees_with_sacct(cost_run):
    run, cluster = cost_run
    jobs = pd.read_csv(run / "report" / "cost_jobs.csv", dtype={"slurm_job_id": str})
    slurm = jobs[jobs["slurm_job_id"].notna()]
    # Tokenize, training, the round's merge and evaluations ran as Slurm jobs, each with its record.
    assert {"prepare", "training", "merge", "evaluation"} <= set(slurm["stage"]), jobs
    for job_id, rows in slurm.groupby("slurm_job_id"):
        acct = _sacct(cluster, job_id)
        assert acct["State"] == "COMPLETED", acct
        elapsed, nodes = int(acct["ElapsedRaw"]), int(acct["NNodes"])
        gpus = int(parse_tres(acct["AllocTRES"]).get("gres/gpu", 0))
        assert set(rows["accounting"]) == {"sacct"}
        assert set(rows["nodes"]) == {nodes} and set(rows["elapsed_s"]) == {elapsed}
        # The job's node-hours and GPU-hours, shared among its commands, add up to sacct's.
        assert rows["node_hours"].sum() == pytest.approx(elapsed * nodes / 3600, rel=1e-6)
        assert rows["gpu_hours"].sum() == pytest.approx(elapsed * gpus / 3600, rel=1e-6, abs=1e-12)
        queue = (pd.Timestamp(acct["Start"]) - pd.Timestamp(acct["Submit"])).total_seconds()
        assert rows["queue_s"].dropna().tolist() == [queue]
        # slurm-local has no energy plugin: sacct gives 0 or nothing, and the table says so.
        assert acct["ConsumedEnergyRaw"] in ("", "0")
        assert set(rows["energy_kwh"]) == {NOT_MEASURED}
    train = slurm[slurm["stage"] == "training"]
    assert list(train["what"]) == ["alpha", "beta"] or set(train["what"]) == {"alpha", "beta"}
    assert int(train[train["what"] == "alpha"]["nodes"].iloc[0]) == 2
    table = pd.read_csv(run / "report" / "cost.csv").set_index(["round", "cluster"])
    row = table.loc[(1, "slurm-local")]
    round_jobs = slurm[slurm["round"] == 1]
    assert row["node_hours"] == pytest.approx(round_jobs["node_hours"].sum())
    assert row["training_s"] == pytest.approx(round_jobs[round_jobs["stage"] == "training"]["wall_s"].sum())
    assert row["energy_kwh"] == NOT_MEASURED and row["accounting"] == "sacct"
    assert "node_hours" in (run / "report" / "cost.html").read_text()
