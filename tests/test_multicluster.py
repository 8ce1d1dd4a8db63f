"""Two clusters on this machine, unattended: two run folders, two controllers started together with one
command each, all rounds. `leo` (site alpha; Leonardo in the published setup) aggregates and reaches
`karo` (site beta; Karolina) over real SSH (a local sshd, tests/ssh_harness.py) with the key an admin
would allow: confined by scripts/fedtune-rsync-gate to karo's exchange folder (read-only on its outbox,
write-only on its inbox: docs/transfers.md), and ssh in BatchMode
from fedtune itself (the harness's RSYNC_RSH carries only the port and the key); karo logs in nowhere.
(Not named leonardo and karolina: their scripts/clusters/*.sh need the real clusters' scratch.) The final aggregate must be bit-identical
to a one-cluster run of the same config, also when a controller is killed mid-round and restarted; a
remote that never delivers ends in the timeout error with nothing partial left."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .ssh_harness import restrict, start_sshd, stop_sshd
from .workflow_harness import ROOT, VENV_BIN, demo_config, snakemake, write_config

pytestmark = pytest.mark.sshd
ROUNDS = 3


def lean_config(**extra) -> dict:
    """The demo, small: 3 rounds of 3 steps, one shard, the last round evaluated on 10 documents."""
    config = demo_config()
    config["tokenize"] = {**config["tokenize"], "shards": 1}
    config["train"] = {**config["train"], "max_steps": 3, "warmup_steps": 1}
    config["evaluate"] = {**config["evaluate"], "intermediate": "none", "max_documents": 10}
    config["federation"] = {"rounds": ROUNDS, "pooled_baseline": False}
    config.update(extra)
    return config


def two_clusters(tmp_path: Path, config: dict, remotes: dict) -> tuple[Path, Path]:
    folders = {}
    for cluster in ("leo", "karo"):
        workdir = tmp_path / cluster
        workdir.mkdir()
        mine = {**config, "cluster": cluster}
        mine["sites"] = {name: dict(site) for name, site in config["sites"].items()}
        mine["sites"]["alpha"]["cluster"] = "leo"
        mine["sites"]["beta"]["cluster"] = "karo"
        mine["federation"] = {**config["federation"], "aggregate_on": "leo", "wait": "10m",
                              "remotes": remotes}  # fmt: skip
        write_config(workdir, mine)
        folders[cluster] = workdir
    return folders["leo"], folders["karo"]


def start(workdir: Path, env: dict) -> subprocess.Popen:
    """One controller, as a user starts it in tmux: the plain command, default target."""
    command = [
        f"{VENV_BIN}/snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory", str(workdir),
        "--configfile", str(workdir / "config.yaml"), "--profile", str(ROOT / "profiles" / "local"),
    ]  # fmt: skip
    env = dict(env, PATH=f"{VENV_BIN}:{env['PATH']}")
    log = open(workdir / "controller.log", "a")
    return subprocess.Popen(command, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip


def finish(process: subprocess.Popen, workdir: Path, timeout: int = 900) -> str:
    process.wait(timeout=timeout)
    text = (workdir / "controller.log").read_text()
    assert process.returncode == 0, text[-5000:]
    return text


def weights(workdir: Path, round: int = ROUNDS) -> dict[str, bytes]:
    folder = workdir / "results" / "demo" / f"round-{round}" / "aggregate" / "model"
    return {p.name: p.read_bytes() for p in folder.glob("*.safetensors")}


def one_cluster(tmp_path: Path, config: dict) -> dict[str, bytes]:
    workdir = tmp_path / "one-cluster"
    workdir.mkdir()
    write_config(workdir, config)
    snakemake(workdir, f"results/demo/round-{ROUNDS}/aggregate/model")
    return weights(workdir)


@pytest.fixture
def ssh(tmp_path):
    """The local sshd, its two keys confined to karo's exchange folder (made by karo's run when it starts):
    the pull key read-only on its outbox, the push key write-only on its inbox."""
    server = start_sshd(tmp_path / "sshd")
    restrict(server, tmp_path / "karo" / "results" / "demo" / "exchange")
    yield server
    stop_sshd(server)


def assert_confined(ssh, run: Path) -> None:
    """The keys the controllers used reach the exchange folder only: the run's own folders are refused."""
    for host in (ssh.host, ssh.push_host):
        probe = subprocess.run(
            ["rsync", "-e", f"{ssh.rsync_rsh} -o BatchMode=yes", f"{host}:{run}/round-1/", f"{run.parent / 'probe'}/"],
            capture_output=True,
            text=True,
            timeout=60,
        )  # fmt: skip
        assert probe.returncode != 0 and "fedtune-rsync-gate" in probe.stderr, probe.stderr


@pytest.mark.slow
def test_fedadam_three_rounds_with_a_controller_killed_mid_round(tmp_path, ssh):
    """Leonardo pulls beta's models from Karolina over SSH and pushes each aggregate to it; Leonardo's
    controller is killed in round 2 and started again with the same command."""
    config = lean_config()
    karolina_run = tmp_path / "karo" / "results" / "demo"
    leonardo, karolina = two_clusters(
        tmp_path,
        config,
        # Two keys, as docs/transfers.md sets up: the pull key through `path`, the push key through
        # `push_path` (another Host alias, the same folder).
        {
            "karo": {
                "path": f"{ssh.host}:{karolina_run}",
                "push_path": f"{ssh.push_host}:{karolina_run}",
                "transfer": "push",
            }
        },  # fmt: skip
    )
    env = ssh.env()
    leo, kar = start(leonardo, env), start(karolina, env)
    # Mid-round: round 1's aggregate is there, round 2's training under way.
    deadline = time.monotonic() + 600
    while not (leonardo / "results/demo/round-1/aggregate/model").is_dir():
        for process, workdir in ((leo, leonardo), (kar, karolina)):
            assert time.monotonic() < deadline and process.poll() is None, (
                workdir / "controller.log"
            ).read_text()
        time.sleep(0.5)
    os.killpg(leo.pid, signal.SIGKILL)
    leo.wait()
    subprocess.run([f"{VENV_BIN}/snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory",
                    str(leonardo), "--configfile", str(leonardo / "config.yaml"), "--unlock"],
                   cwd=leonardo, capture_output=True, check=True)  # fmt: skip
    leo = start(leonardo, env)
    leonardo_log, karolina_log = finish(leo, leonardo), finish(kar, karolina)

    expected = one_cluster(tmp_path, config)
    assert expected and weights(leonardo) == expected
    # Karolina took every aggregate it trained from without logging in anywhere, bit for bit.
    for r in range(1, ROUNDS):
        assert weights(karolina, r) == weights(leonardo, r)
    assert "[transfer] received" in karolina_log and "fetch --source 127.0.0.1:" in leonardo_log
    assert (leonardo / "results/demo/report/perplexity.csv").is_file()
    # The inbox keeps what was pushed (receive copies it out), so a deleted received output comes back
    # from it without Leonardo (docs/transfers.md).
    inbox = karolina_run / "exchange" / "inbox"
    kept = sorted(
        p.relative_to(inbox).as_posix().removesuffix(".COMPLETE") for p in inbox.rglob("*.COMPLETE")
    )
    assert "round-1/aggregate/model" in kept, kept
    for item in kept:
        assert {p.name: p.read_bytes() for p in (inbox / item).glob("*.safetensors")} == {
            p.name: p.read_bytes() for p in (karolina_run / item).glob("*.safetensors")
        }, item
    assert_confined(ssh, karolina_run)


@pytest.mark.slow
def test_adapters_three_rounds_both_pulling(tmp_path, ssh):
    """train.adapter: only adapters cross, each cluster pulls (Leonardo over SSH, Karolina from a
    shared path), and both merge every aggregate adapter themselves: Karolina inside its training jobs
    (train_merging), into the same bits as Leonardo's merge_adapter."""
    config = lean_config()
    config["train"] = {**config["train"], "adapter": {"r": 4}}
    config["aggregate"] = {"adapter_merge": "exact"}
    # Each round's aggregate scored: on beta's text by Karolina's next training, after its merge.
    config["evaluate"] = {**config["evaluate"], "intermediate": "aggregate"}
    leonardo_run = tmp_path / "leo" / "results" / "demo"
    karolina_run = tmp_path / "karo" / "results" / "demo"
    leonardo, karolina = two_clusters(
        tmp_path, config, {"karo": f"{ssh.host}:{karolina_run}", "leo": str(leonardo_run)}
    )
    env = ssh.env()
    leo, kar = start(leonardo, env), start(karolina, env)
    finish(leo, leonardo), finish(kar, karolina)
    expected = one_cluster(tmp_path, config)
    assert expected and weights(leonardo) == expected
    # Karolina's start of each later round is Leonardo's merged aggregate of the round before, bit for bit.
    for r in range(2, ROUNDS + 1):
        folder = karolina_run / f"round-{r}" / "beta" / "start"
        merged = {p.name: p.read_bytes() for p in folder.glob("*.safetensors")}
        assert merged and merged == weights(leonardo, r - 1), r
    assert not (karolina_run / "round-1" / "aggregate" / "model").exists()  # no merge job of its own
    # The merged start scored there, as Leonardo's merged aggregate, and sent to the report.
    for r in range(1, ROUNDS):
        score = json.loads((leonardo_run / f"round-{r}/eval/aggregate/beta.json").read_text())
        assert score == json.loads((karolina_run / f"round-{r + 1}/beta/before/aggregate.json").read_text())
        assert score["model"] == "aggregate" and score["round"] == r, score
    # The last round's, scored by an evaluation job there, merged there first into Leonardo's bits.
    final = karolina_run / f"round-{ROUNDS}" / "aggregate" / "model"
    assert {p.name: p.read_bytes() for p in final.glob("*.safetensors")} == weights(leonardo)
    assert (leonardo_run / f"round-{ROUNDS - 1}/aggregate/adapter.COMPLETE").is_file()
    assert_confined(ssh, karolina_run)


@pytest.mark.slow
def test_int8_exchange_with_error_feedback_both_pulling(tmp_path):
    """federation.exchange int8 with error feedback: beta's compressed update crosses instead of its model
    (each cluster pulls from the other's folder), Leonardo merges it tensor by tensor against the start
    model and rebuilds beta's model for its evaluation; each aggregate goes back as an update against the
    previous one, which Karolina rebuilds into Leonardo's bits; the final aggregate is bit for bit a
    one-cluster run's with the same exchange."""
    config = lean_config()
    config["federation"] = {**config["federation"], "exchange": {"dtype": "int8", "error_feedback": True}}
    leonardo_run = tmp_path / "leo" / "results" / "demo"
    karolina_run = tmp_path / "karo" / "results" / "demo"
    leonardo, karolina = two_clusters(tmp_path, config, {"karo": str(karolina_run), "leo": str(leonardo_run)})
    env = dict(os.environ)
    leo, kar = start(leonardo, env), start(karolina, env)
    finish(leo, leonardo), finish(kar, karolina)
    expected = one_cluster(tmp_path, config)
    assert expected and weights(leonardo) == expected
    for r in range(1, ROUNDS + 1):
        # What crossed: the update (with its sha256 in the marker), not the model; the residual stayed.
        marker = (karolina_run / f"round-{r}/beta/update.COMPLETE").read_text()
        assert "  update/model.safetensors\n" in marker and "  update/update.json\n" in marker
        assert not (karolina_run / f"round-{r}/beta/model.COMPLETE").exists()
        assert (karolina_run / f"round-{r}/beta/residual/model.safetensors").is_file()
        assert not (leonardo_run / f"round-{r}/beta/residual").exists()
        record = json.loads((leonardo_run / f"round-{r}/aggregate/model/aggregate.json").read_text())
        beta = next(entry for entry in record["inputs"] if entry["site"] == "beta")
        assert beta["model_dir"].endswith(f"round-{r}/beta/update") and record["start"]
        # The aggregate went back as its update, rebuilt at Karolina into the model Leonardo goes on from.
        marker = (leonardo_run / f"round-{r}/aggregate/update.COMPLETE").read_text()
        assert "  update/model.safetensors\n" in marker
        assert not (leonardo_run / f"round-{r}/aggregate/model.COMPLETE").exists()
        assert (leonardo_run / f"round-{r}/aggregate/residual/model.safetensors").is_file()
        assert weights(karolina, r) == weights(leonardo, r), r
        merged = {
            p.name: p.read_bytes()
            for p in (leonardo_run / f"round-{r}/aggregate/merged").glob("*.safetensors")
        }
        assert merged and merged != weights(leonardo, r)  # what the sites got is the rebuilt one
    sent = json.loads((karolina_run / f"round-{ROUNDS}/beta/update/update.json").read_text())
    assert sent["update_bytes"] < 0.3 * sent["model_bytes"]  # int8 of a float32 model, scales included
    # Beta's model rebuilt at Leonardo for its evaluation of the last round.
    assert (leonardo_run / f"round-{ROUNDS}/eval/beta/beta.json").is_file()


def test_a_remote_that_never_delivers_ends_in_the_timeout_error(tmp_path):
    config = lean_config()
    karolina_run = tmp_path / "karo" / "results" / "demo"
    leonardo, _ = two_clusters(tmp_path, config, {"karo": str(karolina_run)})
    text = (leonardo / "config.yaml").read_text().replace("wait: 10m", "wait: 3s")
    (leonardo / "config.yaml").write_text(text)
    result = snakemake(leonardo, "results/demo/round-1/aggregate/model", check=False)
    assert result.returncode != 0
    log = (leonardo / "results/demo/logs/fetch_manifest/beta.log").read_text()
    assert "gave up waiting for beta's manifest from karo" in log
    assert "On karo: is its controller running" in log
    assert "[transfer] waiting for beta's manifest from karo" in log
    run = leonardo / "results" / "demo"
    assert not (run / "data/beta/manifest.json").exists()
    assert not (run / "round-1/beta/model").exists()
    assert not [p for p in run.rglob(".*tmp*")]


# A string planted in the private site's text: no byte of it may reach the aggregating cluster.
MARKER = "Zyxwvq-private-marker-7731"


def plant_marker(folder: Path) -> dict[str, str]:
    """beta's demo text with one document holding MARKER first in each split (the test split is scored on
    its first documents)."""
    folder.mkdir()
    files = {}
    for split in ("train", "test"):
        lines = (ROOT / "data" / "demo" / "beta" / f"{split}.jsonl").read_text().splitlines(keepends=True)
        document = f'{{"text": "Bollettino riservato {MARKER}: cielo sereno a {MARKER}, venti deboli."}}\n'
        (folder / f"{split}.jsonl").write_text(document + "".join(lines))
        files[split] = str(folder / f"{split}.jsonl")
    return files


def holding(folder: Path, text: str) -> list[Path]:
    """Every file under `folder` whose bytes hold `text`."""
    needle = text.encode()
    return [p for p in folder.rglob("*") if p.is_file() and not p.is_symlink() and needle in p.read_bytes()]


@pytest.mark.slow
def test_a_private_sites_text_stays_on_its_cluster_and_only_scores_cross(tmp_path, ssh, tiny_model_dir):
    """beta's text is private (shareable false, local files) and trains on karo; leo aggregates. karo
    scores the base model, each aggregate and beta's model on beta's text and sends back the scores (leo
    pulls them over SSH from karo's exchange folder): no byte of beta's text reaches leo's folder, caches
    or logs, and the report's perplexity matrix is a one-cluster run's to the last digit. Round 1's models
    are scored on karo by beta's training of round 2 before it trains (one Slurm job per round there), the
    last round's aggregate, which crosses only for this, by an evaluation job."""
    config = lean_config()
    config["model"] = {"source": "local", "path": str(tiny_model_dir)}
    config["federation"] = {**config["federation"], "rounds": 2}
    config["evaluate"] = {**config["evaluate"], "cross_site": "none", "intermediate": "all"}
    beta = config["sites"]["beta"]["dataset"]
    beta.update(shareable=False, data_files=plant_marker(tmp_path / "beta-data"))
    leonardo_run = tmp_path / "leo" / "results" / "demo"
    karolina_run = tmp_path / "karo" / "results" / "demo"
    leonardo, karolina = two_clusters(
        tmp_path, config, {"karo": f"{ssh.host}:{karolina_run}", "leo": str(leonardo_run)}
    )
    processes = []
    for workdir in (leonardo, karolina):
        # Each cluster's own caches, inside its folder, so that the search below covers them too.
        env = dict(ssh.env(), HF_HOME=str(workdir / "hf-home"), TMPDIR=str(workdir / "tmp"))
        (workdir / "tmp").mkdir()
        processes.append((start(workdir, env), workdir))
    logs = {workdir.name: finish(process, workdir) for process, workdir in processes}
    assert (
        "fetch_score" in logs["leo"]
        and "evaluate_round_own" in logs["karo"]
        and "train_scoring" in logs["karo"]
    )

    assert not holding(leonardo, MARKER)
    assert holding(karolina_run / "data" / "beta" / "raw", MARKER)  # (the search finds it where it is)
    assert not (leonardo_run / "data" / "beta" / "raw").exists()
    made_on_karo = {
        "eval/base/beta.json": "eval/base/beta.json",
        "round-1/eval/aggregate/beta.json": "round-2/beta/before/aggregate.json",
        "round-1/eval/beta/beta.json": "round-2/beta/before/site.json",
        "round-2/eval/aggregate/beta.json": "round-2/eval/aggregate/beta.json",
        "round-2/eval/beta/beta.json": "round-2/eval/beta/beta.json",
    }
    for score, made in made_on_karo.items():
        assert (leonardo_run / score).read_bytes() == (karolina_run / made).read_bytes(), score

    workdir = tmp_path / "one-cluster"
    workdir.mkdir()
    write_config(workdir, config)
    snakemake(workdir, "results/demo/report/perplexity.csv")
    expected = (workdir / "results/demo/report/perplexity.csv").read_text()
    assert (leonardo_run / "report" / "perplexity.csv").read_text() == expected
    assert "beta" in expected.splitlines()[0]
    # The cost table has karo's own accounting (its table, sent after its last job), not an estimate.
    with open(leonardo_run / "report" / "cost_jobs.csv") as f:
        jobs = list(csv.DictReader(f))
    assert {row["stage"] for row in jobs if row["cluster"] == "karo"} >= {"training", "evaluation", "prepare"}
    assert not [row for row in jobs if "training.json only" in row["accounting"]], jobs
    with open(leonardo_run / "report" / "cost.csv") as f:
        assert {row["cluster"] for row in csv.DictReader(f)} == {"leo", "karo"}
    assert_confined(ssh, karolina_run)
