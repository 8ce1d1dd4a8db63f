"""Multi-cluster federation: two local folders stand for two clusters. A run trains only its own
cluster's sites and fetches the other's model and manifest with rsync; a missing remote says which
command to run where."""

from __future__ import annotations

import json
import shutil

import pytest

from fedtune.core.transfer import TransferError, fetch

from .workflow_harness import demo_config, dry_run, job_counts, snakemake, write_config


def test_fetch_copies_a_model_folder_completely(tiny_model_dir, tmp_path):
    out = fetch(str(tiny_model_dir), tmp_path / "copy")
    for path in tiny_model_dir.iterdir():
        assert (out / path.name).read_bytes() == path.read_bytes()


def test_fetch_copies_an_adapter_folder(tmp_path):
    # What a site sends with train.adapter: a PEFT folder, no config.json.
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 4}')
    (adapter / "adapter_model.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"{}      ")
    (adapter / "training.json").write_text("{}")
    out = fetch(str(adapter), tmp_path / "copy")
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "training.json",
    ]
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "adapter_config.json").write_text('{"r": 4}')
    with pytest.raises(TransferError, match="not a complete model or adapter folder"):
        fetch(str(tmp_path / "half"), tmp_path / "copy2")


def test_fetch_refuses_a_missing_or_incomplete_source(tmp_path):
    with pytest.raises(TransferError, match="rsync exit .*run this there"):
        fetch(str(tmp_path / "absent"), tmp_path / "out", hint="run this there")
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    with pytest.raises(
        TransferError, match="not a complete model or adapter folder.*may still be in training"
    ):
        fetch(str(partial), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_fetch_a_single_file(tmp_path):
    source = tmp_path / "manifest.json"
    source.write_text('{"site": "beta"}')
    fetch(str(source), tmp_path / "here" / "manifest.json")
    assert json.loads((tmp_path / "here" / "manifest.json").read_text()) == {"site": "beta"}


def two_clusters(tmp_path, tiny_model_dir, remotes=True):
    """Folder `karolina` holds beta's finished round-1 model; `leonardo` is where we run."""
    leonardo, karolina = tmp_path / "leonardo", tmp_path / "karolina"
    remote_run = karolina / "results" / "demo"
    shutil.copytree(tiny_model_dir, remote_run / "round-1" / "beta" / "model")
    (remote_run / "data" / "beta").mkdir(parents=True)
    (remote_run / "data" / "beta" / "manifest.json").write_text('{"site": "beta", "splits": {}}')
    leonardo.mkdir()
    config = demo_config(cluster="leonardo")
    config["sites"]["alpha"]["cluster"] = "leonardo"
    config["sites"]["beta"]["cluster"] = "karolina"
    config["federation"] = {"rounds": 1, "remotes": {"karolina": str(remote_run)} if remotes else {}}
    write_config(leonardo, config)
    return leonardo, remote_run


TARGETS = ["results/demo/round-1/alpha/model", "results/demo/round-1/beta/model"]


def test_a_cluster_trains_its_own_sites_and_fetches_the_others(tmp_path, tiny_model_dir):
    leonardo, remote_run = two_clusters(tmp_path, tiny_model_dir)
    plan = job_counts(snakemake(leonardo, "-n", *TARGETS).stdout)
    assert plan["train"] == 1 and plan["fetch_site_model"] == 1
    assert plan["tokenize"] == 4  # alpha's 2 train + 2 test shards; beta is tokenized on karolina
    assert "fetch_manifest" not in plan  # training alpha needs only alpha's manifest

    snakemake(leonardo, TARGETS[1], "results/demo/data/beta/manifest.json")
    fetched = leonardo / TARGETS[1]
    for path in (remote_run / "round-1" / "beta" / "model").iterdir():
        assert (fetched / path.name).read_bytes() == path.read_bytes()
    assert json.loads((leonardo / "results/demo/data/beta/manifest.json").read_text())["site"] == "beta"


def test_a_missing_remote_names_the_command_to_run_where(tmp_path, tiny_model_dir):
    leonardo, _ = two_clusters(tmp_path, tiny_model_dir, remotes=False)
    result = snakemake(leonardo, "-n", TARGETS[1], check=False)
    assert result.returncode != 0
    message = result.stdout + result.stderr
    assert "snakemake --profile profiles/karolina results/demo/round-1/beta/model" in message
    assert "federation.remotes.karolina" in message


def test_with_adapters_only_adapters_cross_and_each_cluster_merges_the_aggregate(tmp_path, tiny_model_dir):
    """On karolina (the models meet on leonardo): round 2 of beta needs round 1's aggregate adapter from
    leonardo, merged here into the round's start model; no model crosses."""
    karolina = tmp_path / "karolina"
    karolina.mkdir()
    config = demo_config(cluster="karolina")
    config["sites"]["alpha"]["cluster"] = "leonardo"
    config["sites"]["beta"]["cluster"] = "karolina"
    config["train"] = {**config["train"], "adapter": {"r": 4}}
    config["aggregate"] = {"adapter_merge": "exact"}
    config["federation"] = {"rounds": 2, "aggregate_on": "leonardo", "remotes": {"leonardo": "me@leo:/run"}}
    write_config(karolina, config)
    jobs = dry_run(karolina, "results/demo/round-2/beta/model")
    by_rule = {job.name: job for job in jobs}
    assert "aggregate_adapters" not in by_rule and "aggregate" not in by_rule
    assert "--source me@leo:/run/round-1/aggregate/adapter " in by_rule["fetch_aggregate"].shell
    merge = by_rule["merge_adapter"].shell
    assert "--merge results/demo/round-1/aggregate/adapter --base results/demo/model/base" in merge
    assert "--output results/demo/round-1/aggregate/model" in merge
    # Round 1 of beta is leonardo's input (fetched from here), not this target's.
    (train,) = [job for job in jobs if job.name == "train"]
    assert train.wildcards == {"round": "2", "site": "beta"}
    assert "--init results/demo/round-1/aggregate/model" in train.shell
