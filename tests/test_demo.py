"""The demo end to end with the local profile, as `make demo` runs it but on the demo's generated text
(tests/support/demo-generated.yaml, whose figures are exact; `make demo` runs the same settings on real
text, data/real): download, tokenize, six rounds of training both sites and merging them (FedAdam), the
pooled baseline, evaluate, report; then a rerun that has nothing to do and the HTML report. The demo's
point: federation gets close to pooling the data."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pandas as pd
import pytest
from PIL import Image

from fedtune.evaluate.options import EvaluateOptions

from . import report_browser
from .workflow_harness import ROOT, demo_config, dry_run, snakemake, write_config

# Every test here needs the demo's run (the module fixture: about 4 minutes on 2 cores).
pytestmark = pytest.mark.slow
CONFIG = demo_config()
ROUNDS = CONFIG["federation"]["rounds"]
STEPS = CONFIG["train"]["max_steps"]
LAST = f"round-{ROUNDS}"
# The demo needs no lm-eval; where the tests' install has it (the downstream extra), the same run also
# scores the project's downstream task (evaluate.tasks) on a part of alpha's test recipes.
DOWNSTREAM = importlib.util.find_spec("lm_eval") is not None
needs_lm_eval = pytest.mark.skipif(not DOWNSTREAM, reason="lm-eval missing: pip install -e '.[downstream]'")
TASK = "fedtune_demo_alpha"
TASK_LIMIT = 40


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("demo")
    config = demo_config()
    if DOWNSTREAM:
        config["evaluate"].update(tasks=[f"workflow/tasks/{TASK}.yaml"], task_limit=TASK_LIMIT)
    write_config(workdir, config)
    snakemake(workdir)
    return workdir / "results" / "demo", workdir


def last_round(run):
    table = pd.read_csv(run / "report" / "perplexity.csv")
    return table[(table["round"] == ROUNDS) | (table["model"] == "base")].set_index("model")


def test_site_models_beat_the_base_model_on_their_own_site(demo):
    run, _ = demo
    table = last_round(run)
    for site in ("alpha", "beta"):
        assert table.loc[site, site] < 0.5 * table.loc["base", site]
        # Each site model is specialised: it is better at home than the other site's model is there.
        other = "beta" if site == "alpha" else "alpha"
        assert table.loc[site, site] < table.loc[other, site]


def test_federation_comes_within_one_and_a_half_times_the_pooled_model(demo):
    """The demo's promise (issue #13): the final aggregate is within 1.5x of the pooled model's
    perplexity on both sites, and beats each site model on the other site's text."""
    run, _ = demo
    table = last_round(run)
    for site, other in (("alpha", "beta"), ("beta", "alpha")):
        assert table.loc["aggregate", site] <= 1.5 * table.loc["pooled", site], table
        assert table.loc["aggregate", site] < table.loc[other, site], table
    gap = pd.read_csv(run / "report" / "gap.csv")
    assert list(gap["round"]) == list(range(1, ROUNDS + 1)) and set(gap["model"]) == {"aggregate"}
    final = gap[gap["round"] == ROUNDS].iloc[0]
    for site in ("alpha", "beta"):
        assert final[site] == pytest.approx(table.loc["aggregate", site] / table.loc["pooled", site])
    # The gap narrows as the rounds go on.
    assert (gap.iloc[-1][["alpha", "beta"]] < gap.iloc[0][["alpha", "beta"]]).all()


def test_every_stage_left_its_outputs(demo):
    run, _ = demo
    for site in ("alpha", "beta"):
        model = run / LAST / site / "model"
        training = json.loads((model / "training.json").read_text())
        assert (
            training["site"] == site
            and training["steps"] == STEPS
            and training["world_size"] == CONFIG["train"]["processes_per_node"]
        )
        assert (training["round"], training["first_step"]) == (ROUNDS, (ROUNDS - 1) * STEPS)
        assert (model / "loss.csv").read_text().startswith("step,")
        assert (model / "model.safetensors").is_file()
    record = json.loads((run / LAST / "aggregate" / "model" / "aggregate.json").read_text())
    assert record["method"] == "fedavg"
    pooled = json.loads((run / "pooled" / "model" / "training.json").read_text())
    assert pooled["steps"] == 2 * ROUNDS * STEPS and len(pooled["manifests"]) == 2
    for name in ("perplexity.csv", "perplexity.md", "perplexity.png", "loss.png", "training.csv", "gap.png"):
        assert (run / "report" / name).stat().st_size > 0, name


@needs_lm_eval
def test_downstream_task_scores_every_model_and_the_report_tables_them(demo):
    run, _ = demo
    record = json.loads((run / "tasks" / "tasks.json").read_text())
    assert [t["name"] for t in record["tasks"]] == [TASK]
    assert record["tasks"][0]["documents"] == {TASK: {"test": 200}}
    # The evaluate jobs read the run folder's copy of the task and its data.
    copy = (run / "tasks" / "include" / TASK / f"{TASK}.yaml").read_text()
    assert f"test: results/demo/tasks/data/{TASK}/test/0-test.jsonl" in copy
    table = pd.read_csv(run / "report" / "tasks" / f"{TASK}.csv")
    models = [(0, "base"), (ROUNDS, "alpha"), (ROUNDS, "beta"), (ROUNDS, "aggregate")]
    assert list(zip(table["round"], table["model"], strict=True)) == models
    assert list(table.columns) == ["round", "model", "word_perplexity", "byte_perplexity", "bits_per_byte"]
    for rnd, model in models:
        path = run / ("eval" if model == "base" else LAST + "/eval") / "tasks" / f"{model}.csv"
        scores = pd.read_csv(path)
        assert set(scores["task"]) == {TASK} and set(scores["round"]) == {rnd}
        row = table[table["model"] == model].iloc[0]
        for metric, value in zip(scores["metric"], scores["value"], strict=True):
            assert row[metric] == value, (model, metric)
    by_model = table.set_index("model")["bits_per_byte"]
    # Alpha trained on recipes like the task's; the base model never trained.
    assert by_model["alpha"] < by_model["base"] and by_model["aggregate"] < by_model["base"]
    assert (run / "report" / "tasks" / f"{TASK}.md").read_text().startswith(f"Task {TASK}")


@needs_lm_eval
def test_the_workflows_task_score_equals_the_lm_eval_cli(demo, tmp_path):
    """The aggregate's scores in the run equal what the lm_eval CLI prints for the same model, task,
    limit and batch size (offline, on the project's task YAML)."""
    run, _ = demo
    model = run / LAST / "aggregate" / "model"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"))
    cli = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={model}",
         "--include_path", "workflow/tasks", "--tasks", TASK, "--device", "cpu",
         "--batch_size", str(EvaluateOptions.from_mapping(CONFIG["evaluate"]).batch_size), "--limit", str(TASK_LIMIT),
         "--output_path", str(tmp_path / "cli")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-3000:]
    (results_file,) = (tmp_path / "cli").rglob("results_*.json")
    expected = json.loads(results_file.read_text())["results"][TASK]
    scores = pd.read_csv(run / LAST / "eval" / "tasks" / "aggregate.csv")
    assert len(scores) == 3
    for metric, value in zip(scores["metric"], scores["value"], strict=True):
        assert value == expected[f"{metric},none"], metric


def test_status_summarises_the_finished_run(demo):
    run, workdir = demo
    result = subprocess.run(
        [sys.executable, "-m", "fedtune.report.status", "--configfile", "config.yaml", "--json"],
        cwd=workdir, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert {(site["round"], site["site"]) for site in status["sites"]} == {
        (r, s) for r in range(1, ROUNDS + 1) for s in ("alpha", "beta")
    }
    reported = pd.read_csv(run / "report" / "training.csv").set_index(["round", "site"])
    for site in status["sites"]:
        training = json.loads(
            (run / f"round-{site['round']}" / site["site"] / "model" / "training.json").read_text()
        )
        assert (site["state"], site["step"], site["total_steps"]) == ("done", STEPS, STEPS)
        assert site["loss"] == training["final_loss"] and site["elapsed_s"] == training["wall_time_s"]
        # One training speed, per second of steps, in status and the report; the job's adds start-up.
        speed = training["tokens_per_s"]
        assert site["tokens_per_s"] == speed > training["tokens_seen"] / training["wall_time_s"]
        assert reported.loc[(site["round"], site["site"]), "tokens_per_s"] == pytest.approx(speed, abs=0.5)
    # Before the last round only the merged model is evaluated (evaluate.intermediate: aggregate).
    expected = [2] * (ROUNDS - 1) + [6]
    assert [r["evaluations_expected"] for r in status["rounds"]] == expected
    assert [r["evaluations"] for r in status["rounds"]] == expected and all(
        r["aggregate"] for r in status["rounds"]
    )
    assert status["report"] is True


def test_rerun_has_nothing_to_do_and_the_html_report_builds(demo):
    _, workdir = demo
    again = snakemake(workdir, "-n")
    assert "Nothing to be done" in again.stdout + again.stderr
    snakemake(workdir, "--report", "report.html")
    html = (workdir / "report.html").read_text(errors="replace")
    assert "perplexity" in html.lower()


@pytest.mark.skipif(
    report_browser.chromium() is None, reason="chromium missing: scripts/setup-env --tests installs it"
)
def test_the_html_report_shows_tables_figures_and_settings_in_a_browser(demo, tmp_path):
    run, workdir = demo
    report = workdir / "report.html"
    if not report.is_file():
        snakemake(workdir, "--report", "report.html")
    driven = report_browser.driven_copy(report, tmp_path / "report.html")
    figures = [("Perplexity", "perplexity.png"), ("Perplexity", "rounds.png"), ("Training", "loss.png")]
    tables = [("Perplexity", "perplexity.html"), ("Training", "training.html"), ("Settings", "settings.html")]
    tables.append(("Cost", "cost.html"))
    if DOWNSTREAM:
        tables.append(("Downstream tasks", f"{TASK}.html"))
    shown = report_browser.show(driven, tables + figures)

    def rendered(name: str) -> list[list[str]]:
        assert shown[name]["frame"], shown[name]
        return report_browser.rendered_table_rows(
            report_browser.data_uri_bytes(shown[name]["frame"]), tmp_path
        )

    # The perplexity table: the page shows it in a frame whose cells hold the CSV's values.
    assert set(shown["perplexity.html"]["categories"]) == {
        "Perplexity",
        "Training",
        "Settings",
        "Federation gap",
        "Cost",
    } | ({"Downstream tasks"} if DOWNSTREAM else set())
    assert (
        "Perplexity (exp of the mean negative log-likelihood" in shown["perplexity.html"]["info"]
    )  # caption
    rows = rendered("perplexity.html")
    table = pd.read_csv(run / "report" / "perplexity.csv")
    assert rows[0] == list(table.columns)
    for (_, expected), cells in zip(table.iterrows(), rows[1:], strict=False):
        assert cells[:2] == [str(expected["round"]), expected["model"]]
        assert cells[2:] == [f"{expected[site]:,.3f}" for site in table.columns[2:]]
    assert len([r for r in rows if r and r[0].isdigit()]) == 2 * len(table)  # perplexity + bits per byte

    # Figures: each one is an image the browser decoded at the PNG's own size (not a broken image).
    for _, name in figures:
        with Image.open(run / "report" / name) as png:
            assert shown[name]["img"] == {"width": png.width, "height": png.height, "complete": True}, name
    assert "Training loss of every site" in shown["loss.png"]["info"]

    # Training and settings tables, with their captions.
    rows = rendered("training.html")
    assert rows[0][:3] == ["round", "site", "steps"] and {r[1] for r in rows[1:]} == {
        "alpha",
        "beta",
        "pooled",
    }
    assert all(r[2] == str(STEPS) for r in rows[1 : 1 + 2 * ROUNDS])
    assert "The run's settings as Snakemake applied them" in shown["settings.html"]["info"]
    settings = dict(map(tuple, rendered("settings.html")[1:]))
    assert settings["federation.rounds"] == str(ROUNDS) and settings["aggregate.method"] == "fedavg"
    assert settings["aggregate.server_optimizer.name"] == "fedadam"
    assert settings["sites.beta.prompt_template"] == "Scrivi un bollettino: {text}"

    # What the run cost: the report_cost table, a row per round and cluster.
    rows = rendered("cost.html")
    assert (
        rows[0][:2] == ["round", "cluster"] and len([r for r in rows[1:] if r and r[0].isdigit()]) >= ROUNDS
    )

    if DOWNSTREAM:
        # The downstream task's table, with its caption.
        assert "A downstream task of lm-evaluation-harness" in shown[f"{TASK}.html"]["info"]
        rows = rendered(f"{TASK}.html")
        table = pd.read_csv(run / "report" / "tasks" / f"{TASK}.csv")
        assert rows[0] == list(table.columns) and [r[1] for r in rows[1:]] == list(table["model"])

    # What a user sees: a screenshot of the table view and of a figure, neither a blank page.
    for category, name in [("Perplexity", "perplexity.html"), ("Training", "loss.png")]:
        png = report_browser.screenshot(driven, category, name, tmp_path / f"{name}.png")
        assert report_browser.distinct_colours(png) > 20, f"{png}: a blank page"


def copy_of_the_run(workdir, dest):
    """The finished demo's working directory as it is: files, mtimes and Snakemake's records (keyed by
    paths relative to it)."""
    return shutil.copytree(workdir, dest, symlinks=True)


def nothing_to_do(result) -> bool:
    return "Nothing to be done" in result.stdout + result.stderr


def test_a_moved_checkout_and_working_directory_have_nothing_to_do(demo, tmp_path):
    """Issue 37: a clone in another folder (or a renamed project folder, a scratch mount that resolves
    differently) must not rerun a finished run: no param, input, code or software record may hold the
    checkout's path (train's launcher did, and so retrained every round)."""
    _, workdir = demo
    checkout = tmp_path / "moved" / "fedtune"
    for name in ("Snakefile", "workflow", "fedtune", "scripts", "profiles", "config", "envs", "data"):
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(
                source, checkout / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            checkout.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, checkout / name)
    moved = copy_of_the_run(workdir, tmp_path / "moved" / "work")
    result = snakemake(moved, "-n", root=checkout)
    assert nothing_to_do(result), result.stdout[-3000:]


def planned(workdir) -> set[tuple]:
    """(rule, wildcards) of every job a dry run plans, rule all left out."""
    return {(job.name, tuple(sorted(job.wildcards.items()))) for job in dry_run(workdir) if job.name != "all"}


def test_a_deleted_output_of_any_stage_is_redone_with_what_depends_on_it(demo, tmp_path):
    """The promise (docs/reliability.md): deleting a stage's output (a shard, a site model, an aggregate,
    an evaluation) reruns the job that made it and every job made from it after it, nothing else. Before
    issue 37 only the shards were targets, and a deleted site model planned nothing."""
    _, workdir = demo
    copy = copy_of_the_run(workdir, tmp_path / "run")
    run = copy / "results" / "demo"
    last = str(ROUNDS)

    def without(relative):
        path = run / relative
        aside = tmp_path / "aside"
        path.rename(aside)
        try:
            return planned(copy)
        finally:
            aside.rename(path)

    # An evaluation: its job (one per model, both test sets) and the report.
    plan = without(f"{LAST}/eval/alpha/beta.json")
    assert plan == {
        ("evaluate_round", (("model", "alpha"), ("round", last))),
        ("report", ()),
        ("report_cost", ()),
    }, plan
    # The last round's site model: its training, the round's merge, what scores either, the report.
    plan = without(f"{LAST}/beta/model")
    expected = {
        ("train", (("round", last), ("site", "beta"))),
        ("aggregate", (("round", last),)),
        ("evaluate_round", (("model", "beta"), ("round", last))),
        ("evaluate_round", (("model", "aggregate"), ("round", last))),
        ("report", ()),
        ("report_cost", ()),
    }
    if DOWNSTREAM:
        expected |= {
            ("evaluate_tasks_round", (("model", model), ("round", last))) for model in ("beta", "aggregate")
        }
    assert plan == expected, plan
    # An aggregate of round 3: that merge, and every later round of both sites.
    plan = without("round-3/aggregate/model")
    trains = {dict(w)["round"] for name, w in plan if name == "train"}
    merges = {dict(w)["round"] for name, w in plan if name == "aggregate"}
    assert trains == {str(r) for r in range(4, ROUNDS + 1)} and merges == {
        str(r) for r in range(3, ROUNDS + 1)
    }
    assert {name for name, _ in plan} & {
        "tokenize",
        "download_data",
        "download_model",
        "train_pooled",
    } == set()
    # A shard: its tokenize job, its site's manifest, and on from there (beta's training, every merge).
    plan = without("data/beta/train/shard-1")
    assert [w for name, w in plan if name == "tokenize"] == [
        (("shard", "1"), ("site", "beta"), ("split", "train"))
    ]
    assert ("tokenize_manifest", (("site", "beta"),)) in plan and (
        "train",
        (("round", "1"), ("site", "beta")),
    ) in plan
    assert ("train", (("round", "1"), ("site", "alpha"))) not in plan
    # Back as it was: nothing to do.
    assert planned(copy) == set()


def test_a_run_started_from_this_runs_model_leaves_it_with_nothing_to_do(demo, tmp_path):
    """Issue 37: model.source local with a path into a finished run's results. The new run's download
    links the model's files, not Snakemake's marker, so finishing it does not make the finished run look
    outdated (before: it replanned everything from tokenize, "Updated input files: .../model/base")."""
    _, workdir = demo
    copy = copy_of_the_run(workdir, tmp_path / "run")
    config = demo_config()
    config["run"] = "second"
    config["model"] = {"source": "local", "path": "results/demo/model/base", "dtype": "float32"}
    (copy / "second.yaml").write_text(json.dumps(config))
    shutil.copy2(copy / "config.yaml", copy / "first.yaml")
    shutil.copy2(copy / "second.yaml", copy / "config.yaml")
    snakemake(copy, "results/second/model/base")
    source, linked = copy / "results/demo/model/base", copy / "results/second/model/base"
    assert (linked / "model.safetensors").stat().st_ino == (source / "model.safetensors").stat().st_ino
    assert (linked / ".snakemake_timestamp").stat().st_ino != (source / ".snakemake_timestamp").stat().st_ino
    shutil.copy2(copy / "first.yaml", copy / "config.yaml")
    assert nothing_to_do(snakemake(copy, "-n"))


def test_each_site_carries_the_identity_of_the_base_it_started_from(demo):
    """Round 1's models name the downloaded base (one sha256 of its files), which the aggregation compares
    with its own; later rounds start from an aggregate and name none."""
    run, _ = demo
    base = json.loads((run / "model" / "base" / "fedtune-source.json").read_text())
    assert set(base["file_sha256"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    for site in ("alpha", "beta"):
        first = json.loads((run / "round-1" / site / "model" / "training.json").read_text())
        assert first["base"] == {"identity": base["identity"], "commit": None}
        assert json.loads((run / "round-2" / site / "model" / "training.json").read_text())["base"] is None


def test_the_report_has_the_cost_table(demo):
    """Issue 40: per round the local profile's costs, wall time only: the training, merge and evaluation
    commands' seconds (each at least what training.json measured inside the training), node-hours as wall
    time x processes, energy not measured; at the end the federation's and the pooled model's node-hours."""
    run, _ = demo
    table = pd.read_csv(run / "report" / "cost.csv")
    assert list(table["round"]) == list(range(ROUNDS + 1)) and set(table["cluster"]) == {"local"}
    assert table.loc[0, "prepare_s"] > 0
    rounds = table[table["round"] > 0].set_index("round")
    training = pd.read_csv(run / "report" / "training.csv")
    for rnd, row in rounds.iterrows():
        sites = training[(training["round"] == rnd) & (training["site"] != "pooled")]
        inside = sites["wall_time_s"].sum()
        assert inside > 0 and row["training_s"] >= inside, (rnd, row["training_s"], inside)
        assert row["merge_s"] > 0 and row["evaluation_s"] > 0 and row["node_hours"] > 0
        assert row["accounting"] == "wall x processes (local)" and row["energy_kwh"] == "not measured (local)"
        assert row["bytes_sent"] == 0 and row["bytes_received"] == 0  # one cluster: nothing crosses
    summary = pd.read_csv(run / "report" / "cost_summary.csv").set_index("model")
    assert summary.loc["federation", "round"] == ROUNDS
    assert summary.loc["pooled baseline", "node_hours_training"] > 0
    # The pooled model trains on the federation's tokens.
    assert summary.loc["pooled baseline", "tokens"] == summary.loc["federation", "tokens"]
    assert "What the run cost" in (run / "report" / "cost.html").read_text()
    with Image.open(run / "report" / "cost.png") as png:
        assert png.size[0] > 100
