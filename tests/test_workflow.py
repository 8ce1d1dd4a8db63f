"""The workflow through tokenize with the local profile: dry run, DAG, full run, no-op rerun, and a
deleted shard that reruns only itself and what depends on it."""

from __future__ import annotations

from collections import Counter

import pytest

from .workflow_harness import demo_config, dry_run, job_counts, snakemake, write_config

MANIFESTS = [
    f"results/demo/data/{site}/{split}/shard-{k}"
    for site in ("alpha", "beta")
    for split in ("train", "test")
    for k in (0, 1)
] + ["results/demo/data/alpha/manifest.json", "results/demo/data/beta/manifest.json"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("workflow")
    config = demo_config()
    for site in config["sites"].values():
        site["dataset"]["max_documents"] = 300
    write_config(workdir, config)
    return workdir


def test_dry_run_lists_every_job_with_its_reason(workdir):
    result = snakemake(workdir, "-n", *MANIFESTS)
    counts = job_counts(result.stdout)
    assert counts == {"download_data": 2, "download_model": 1, "tokenize": 8, "tokenize_manifest": 2}
    reasons = [line for line in result.stdout.splitlines() if line.strip().startswith("reason:")]
    assert len(reasons) == 13 and all(r.split(":", 1)[1].strip() for r in reasons)
    assert sum("Missing output files" in r for r in reasons) >= 11
    assert not (workdir / "results").exists()


def test_dag_and_rulegraph(workdir):
    dag = snakemake(workdir, "--dag", "dot", *MANIFESTS).stdout
    assert dag.lstrip().startswith("digraph") and dag.count("tokenize") >= 8
    graph = snakemake(workdir, "--rulegraph", "dot", *MANIFESTS).stdout
    for rule in ("download_data", "download_model", "tokenize", "tokenize_manifest"):
        assert rule in graph


def test_run_rerun_and_targeted_rerun(workdir):
    snakemake(workdir, *MANIFESTS)
    run = workdir / "results" / "demo"
    for site in ("alpha", "beta"):
        assert (run / "data" / site / "manifest.json").is_file()
        for split in ("train", "test"):
            for k in range(2):
                assert (run / "data" / site / split / f"shard-{k}" / "counts.json").is_file()
    assert (run / "model" / "base" / "model.safetensors").is_file()
    assert (run / "logs" / "tokenize" / "alpha" / "train-0.log").is_file()

    again = snakemake(workdir, "-n", *MANIFESTS)
    assert "Nothing to be done" in again.stdout + again.stderr

    # Remove one shard: only it and its site's manifest are redone.
    untouched = run / "data" / "alpha" / "train" / "shard-0" / "counts.json"
    before = untouched.stat().st_mtime_ns
    import shutil

    shutil.rmtree(run / "data" / "beta" / "train" / "shard-1")
    plan = snakemake(workdir, "-n", *MANIFESTS)
    assert job_counts(plan.stdout) == {"tokenize": 1, "tokenize_manifest": 1}
    assert "data/beta/train/shard-1" in plan.stdout
    snakemake(workdir, *MANIFESTS)
    assert (run / "data" / "beta" / "train" / "shard-1" / "counts.json").is_file()
    assert untouched.stat().st_mtime_ns == before


def test_config_error_stops_before_any_job(tmp_path):
    config = demo_config()
    config["tokenize"]["mode"] = "chunked"
    write_config(tmp_path, config)
    result = snakemake(tmp_path, *MANIFESTS, check=False)
    assert result.returncode != 0
    assert "tokenize.mode" in result.stderr and "config.yaml" in result.stderr
    assert not (tmp_path / "results").exists()


def test_two_rounds_unroll_in_the_dag(tmp_path):
    config = demo_config()
    config["federation"] = {"rounds": 2}
    config["evaluate"]["intermediate"] = "all"
    write_config(tmp_path, config)
    jobs = dry_run(tmp_path)
    counts = Counter(job.name for job in jobs)
    assert counts["train"] == 4 and counts["aggregate"] == 2 and counts["report"] == 1
    assert counts["evaluate_base"] == 1  # one job per model, scoring both test sets
    assert counts["evaluate_round"] == 2 * 3  # rounds x (2 site models + aggregate)
    # Round 2 starts from round 1's aggregate, round 1 from the base model.
    train_inputs = {job.shell.split("--init ")[1].split()[0] for job in jobs if job.name == "train"}
    assert train_inputs == {"results/demo/model/base", "results/demo/round-1/aggregate/model"}
