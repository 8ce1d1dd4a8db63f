"""Multi-cluster federation: two local folders stand for two clusters. A run trains only its own
cluster's sites and fetches the other's model and manifest with rsync; a missing remote says which
command to run where."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from fedtune.core import transfer
from fedtune.core.transfer import (
    FetchJob,
    PushJob,
    ReceiveJob,
    TransferError,
    WaitOptions,
    fetch,
    mark,
    push,
    receive,
)

from .ssh_harness import start_sshd, stop_sshd
from .workflow_harness import (
    demo_config,
    dry_run,
    job_counts,
    planned_jobs,
    slurm_jobs_per_round,
    snakemake,
    write_config,
)


def marked(folder):
    mark(folder)
    return folder


def test_a_marked_folder_is_fetched_and_every_file_verified(tiny_model_dir, tmp_path):
    source = tmp_path / "there" / "model"
    shutil.copytree(tiny_model_dir, source)
    marker = mark(source)
    assert marker.name == "model.COMPLETE"
    # sha256sum's own format: `sha256sum -c` in the parent folder checks it.
    check = subprocess.run(["sha256sum", "-c", marker.name], cwd=source.parent, capture_output=True)
    assert check.returncode == 0, check.stderr
    out = fetch(FetchJob(str(source), tmp_path / "here" / "model"))
    for path in source.iterdir():
        assert (out / path.name).read_bytes() == path.read_bytes()


def test_a_fetch_waits_for_the_marker_and_times_out_naming_remote_round_and_what_to_check(tmp_path, capfd):
    source = tmp_path / "there" / "model"
    source.mkdir(parents=True)
    (source / "config.json").write_text("{}")  # there, but not marked complete: still being written
    out = tmp_path / "here" / "model"
    with pytest.raises(TransferError) as error:
        fetch(
            FetchJob(str(source), out),
            WaitOptions(
                1.5,
                "beta's model of round 2 from karolina",
                "On karolina: is its controller running?",
                0.2,
                0.5,
            ),
        )
    message = str(error.value)
    assert "beta's model of round 2 from karolina" in message and "On karolina: is its controller" in message
    assert "model.COMPLETE never appeared" in message
    progress = capfd.readouterr().err
    assert "[transfer] waiting for beta's model of round 2 from karolina: 0 s of 1 s waited" in progress
    assert not out.exists() and not list(out.parent.iterdir())  # nothing partial left


def test_a_copy_that_fails_verification_is_deleted_and_fetched_again(tmp_path, monkeypatch):
    source = tmp_path / "there" / "model"
    source.mkdir(parents=True)
    (source / "weights.bin").write_bytes(b"good")
    mark(source)
    real = transfer._rsync
    copies = []

    def corrupting(*args, **kwargs):
        result = real(*args, **kwargs)
        destination = Path(args[-1])
        if destination.is_dir():
            if not copies:  # the first copy of the folder arrives damaged
                (destination / "weights.bin").write_bytes(b"bad!")
            copies.append(destination)
        return result

    monkeypatch.setattr(transfer, "_rsync", corrupting)
    out = fetch(FetchJob(str(source), tmp_path / "here" / "model"))
    assert (out / "weights.bin").read_bytes() == b"good"
    assert len(copies) == 2
    # A copy that never verifies: deleted, and the error says so.
    (source / "weights.bin").write_bytes(b"changed after marking")
    with pytest.raises(TransferError, match="failed verification 3 times.*sha256 differs"):
        fetch(FetchJob(str(source), tmp_path / "again" / "model"))
    assert not (tmp_path / "again" / "model").exists()


def test_a_file_is_marked_and_fetched(tmp_path):
    source = tmp_path / "manifest.json"
    source.write_text('{"site": "beta"}')
    mark(source)
    fetch(FetchJob(str(source), tmp_path / "here" / "manifest.json"))
    assert json.loads((tmp_path / "here" / "manifest.json").read_text()) == {"site": "beta"}


@pytest.mark.sshd
def test_push_over_ssh_into_the_inbox_then_receive(tiny_model_dir, tmp_path):
    """The aggregating cluster sends; the receiver waits for local files only. Over a real sshd."""
    server = start_sshd(tmp_path / "sshd")
    try:
        here, there = tmp_path / "leonardo" / "run", tmp_path / "karolina" / "run"
        shutil.copytree(tiny_model_dir, here / "round-1" / "aggregate" / "model")
        (there / "exchange" / "inbox").mkdir(parents=True)  # as the receiver's waiting job makes it
        monkey_env = dict(os.environ)
        os.environ["RSYNC_RSH"] = server.rsync_rsh
        try:
            push(PushJob(here, "round-1/aggregate/model", f"{server.host}:{there}"))
            # Over ssh too: the other direction, a pull of the marked original.
            mark(here / "round-1" / "aggregate" / "model")
            pulled = fetch(
                FetchJob(f"{server.host}:{here}/round-1/aggregate/model", tmp_path / "pulled" / "model")
            )
        finally:
            os.environ.clear()
            os.environ.update(monkey_env)
        assert (there / "exchange" / "inbox" / "round-1" / "aggregate" / "model.COMPLETE").is_file()
        out = receive(ReceiveJob(there, "round-1/aggregate/model", there / "round-1" / "aggregate" / "model"))
        for path in tiny_model_dir.iterdir():
            assert (out / path.name).read_bytes() == path.read_bytes()
            assert (pulled / path.name).read_bytes() == path.read_bytes()
        # The inbox keeps its copy: a deleted output is received again without the sender.
        assert (there / "exchange" / "inbox" / "round-1" / "aggregate" / "model.COMPLETE").is_file()
        shutil.rmtree(out)
        again = receive(
            ReceiveJob(there, "round-1/aggregate/model", there / "round-1" / "aggregate" / "model")
        )
        assert {p.name: p.read_bytes() for p in again.iterdir()} == {
            p.name: p.read_bytes() for p in tiny_model_dir.iterdir()
        }
    finally:
        stop_sshd(server)


def test_receive_deletes_a_copy_that_fails_verification_and_times_out(tmp_path):
    run = tmp_path / "run"
    staged = run / "exchange" / "inbox" / "data" / "beta" / "manifest.json"
    staged.parent.mkdir(parents=True)
    staged.write_text("{}")
    mark(staged)
    staged.write_text('{"changed": 1}')
    with pytest.raises(TransferError, match="never appeared.*failed verification"):
        receive(
            ReceiveJob(run, "data/beta/manifest.json", run / "data" / "beta" / "manifest.json"),
            WaitOptions(0.5, first=0.1, most=0.1),
        )
    assert not staged.exists() and not (run / "data" / "beta" / "manifest.json").exists()


def two_clusters(tmp_path, tiny_model_dir, remotes=True):
    """Folder `karolina` holds beta's finished round-1 model; `leonardo` is where we run."""
    leonardo, karolina = tmp_path / "leonardo", tmp_path / "karolina"
    remote_run = karolina / "results" / "demo"
    shutil.copytree(tiny_model_dir, remote_run / "round-1" / "beta" / "model")
    (remote_run / "data" / "beta").mkdir(parents=True)
    (remote_run / "data" / "beta" / "manifest.json").write_text('{"site": "beta", "splits": {}}')
    for item in ("round-1/beta/model", "data/beta/manifest.json"):
        mark(remote_run / item, remote_run / "exchange" / "outbox" / item)  # as rule mark_complete does
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


def test_a_missing_remote_is_a_config_error_naming_the_entry_to_add(tmp_path, tiny_model_dir):
    """At start, before the DAG (tests/test_start_errors.py has the other cases)."""
    leonardo, _ = two_clusters(tmp_path, tiny_model_dir, remotes=False)
    result = snakemake(leonardo, "-n", TARGETS[1], check=False)
    assert result.returncode != 0
    message = result.stdout + result.stderr
    assert "sites.beta.cluster: karolina has no federation.remotes entry" in message, message[-2000:]
    assert "`karolina: user@host:/path/to/results/demo`" in message
    assert "InputFunctionException" not in message


def test_with_adapters_only_adapters_cross_and_each_cluster_merges_the_aggregate(tmp_path, tiny_model_dir):
    """On karolina (the models meet on leonardo): rounds 2 and 3 of beta need the previous round's
    aggregate adapter from leonardo, merged here into the previous start model by the training job
    itself (train_merging: one Slurm job per training); no model crosses."""
    karolina = tmp_path / "karolina"
    karolina.mkdir()
    config = demo_config(cluster="karolina")
    config["sites"]["alpha"]["cluster"] = "leonardo"
    config["sites"]["beta"]["cluster"] = "karolina"
    config["train"] = {**config["train"], "adapter": {"r": 4}}
    config["aggregate"] = {"adapter_merge": "exact"}
    config["federation"] = {"rounds": 3, "aggregate_on": "leonardo", "remotes": {"leonardo": "me@leo:/run"}}
    write_config(karolina, config)
    jobs = dry_run(karolina, "results/demo/round-3/beta/model")
    by_rule = {job.name: job for job in jobs}
    assert "aggregate_adapters" not in by_rule and "aggregate" not in by_rule
    assert "merge_adapter" not in by_rule  # no Slurm job of its own here
    fetches = {job.wildcards["round"]: job.shell for job in jobs if job.name == "fetch_aggregate"}
    assert sorted(fetches) == ["1", "2"]
    assert "--source me@leo:/run/exchange/outbox/round-1/aggregate/adapter " in fetches["1"]
    trains = {job.wildcards["round"]: job for job in jobs if job.name in ("train", "train_merging")}
    assert sorted(trains) == ["1", "2", "3"] and all(
        job.wildcards["site"] == "beta" for job in trains.values()
    )
    assert trains["1"].name == "train" and "--merge" not in trains["1"].shell
    assert "--init results/demo/model/base" in trains["1"].shell
    # Round 2 merges round 1's adapter into the base, round 3 round 2's into round 2's start; each
    # then trains from what it merged, in the same job.
    for round, base in (("2", "results/demo/model/base"), ("3", "results/demo/round-2/beta/start")):
        shell = trains[round].shell
        assert trains[round].name == "train_merging", round
        previous = int(round) - 1
        merge = (
            f"python -m fedtune.aggregate.adapters --merge results/demo/round-{previous}/aggregate/adapter"
            f" --base {base} --out results/demo/round-{round}/beta/start"
        )
        assert shell.index(merge) < shell.index("-m fedtune.train"), shell
        assert f"--init results/demo/round-{round}/beta/start " in shell


@pytest.mark.parametrize("adapters", [False, True])
def test_the_dry_run_prints_the_slurm_jobs_per_round_it_plans(tmp_path, adapters):
    """With a Slurm profile: S trainings + 1 merge-and-evaluate job a round where the models meet; elsewhere
    one job per site and round (evaluate.cross_site none): the training, which first scores the previous
    round's aggregate and the site's previous model on the site's text (with adapters after merging its
    start model), and after the last round one job that scores its models; the printed line agrees."""
    config = demo_config(cluster="leo")
    config["sites"]["alpha"]["cluster"] = "leo"
    config["sites"]["beta"]["cluster"] = "karo"
    config["federation"] = {
        "rounds": 3,
        "aggregate_on": "leo",
        "remotes": {"karo": "me@karo:/run", "leo": "me@leo:/run"},
    }
    config["evaluate"] = {**config["evaluate"], "intermediate": "all"}
    if adapters:
        config["train"] = {**config["train"], "adapter": {"r": 4}}
        config["aggregate"] = {"adapter_merge": "exact"}
    else:
        config["aggregate"] = {**config["aggregate"], "compare": ["ties"]}
    expected = {"leo": [2, 2, 2], "karo": [1, 1, 2]}
    for cluster, jobs in expected.items():
        workdir = tmp_path / cluster
        workdir.mkdir()
        write_config(workdir, {**config, "cluster": cluster})
        result = snakemake(workdir, "-n", "-p", profile="slurm-local", timeout=300)
        assert slurm_jobs_per_round(result.stdout) == dict(enumerate(jobs, start=1)), cluster
        for name, counts in expected.items():
            assert f"fedtune: Slurm jobs per round on {name}: {', '.join(map(str, counts))} " in result.stderr
    # karo's training of round 3 scores round 2's aggregate (its start: with adapters, the start it has
    # just merged) and beta's round 2 model on beta's text, then trains; each score is an output of its own.
    train = next(
        job
        for job in planned_jobs(result.stdout)
        if job.name.startswith("train_") and job.wildcards["round"] == "3"
    )
    start = "results/demo/round-3/beta/start" if adapters else "results/demo/round-2/aggregate/model"
    previous = "results/demo/round-2/beta/model" + (
        " --base results/demo/round-2/beta/start" if adapters else ""
    )
    scored = [
        f"python -m fedtune.evaluate --model {start} --split test",
        f"python -m fedtune.evaluate --model {previous} --split test",
        "-m fedtune.train ",
    ]
    positions = [train.shell.find(command) for command in scored]
    assert -1 not in positions and positions == sorted(positions), train.shell
    for role in ("aggregate", "site"):
        assert f'"out":"results/demo/round-3/beta/before/{role}.json"' in train.shell, role


def test_a_failed_transfer_piped_into_tee_fails_its_job_under_a_clusters_shell_prefix(tmp_path):
    """A cluster with an environment file (scripts/clusters/<cluster>.sh; here slurm-local's) gets a
    shell prefix of its own, which replaces Snakemake's `set -euo pipefail`. The transfer rules run
    `... 2>&1 | tee log`: without pipefail the pipeline exits 0 when the transfer fails, and the job ends
    in a MissingOutputException instead of the transfer's exit code and error."""
    config = demo_config(cluster="slurm-local")
    config["sites"]["alpha"]["cluster"] = "slurm-local"
    config["sites"]["beta"]["cluster"] = "karo"
    config["federation"] = {"rounds": 1, "wait": 1, "remotes": {"karo": str(tmp_path / "nowhere" / "run")}}
    write_config(tmp_path, config)
    result = snakemake(tmp_path, "results/demo/data/beta/manifest.json", check=False, timeout=300)
    text = result.stdout + result.stderr
    assert result.returncode != 0, text[-3000:]
    assert "Error in rule fetch_manifest" in text, text[-3000:]
    assert "MissingOutputException" not in text, text[-3000:]
    assert "returned non-zero exit status" in text, text[-3000:]  # the transfer's own exit code
