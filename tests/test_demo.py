"""The demo end to end with the local profile, as `make demo` runs it: download, tokenize, train both
sites, aggregate, evaluate, report; then a rerun that has nothing to do and the HTML report."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from .workflow_harness import demo_config, snakemake, write_config


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("demo")
    write_config(workdir, demo_config())
    snakemake(workdir)
    return workdir / "results" / "demo", workdir


def test_site_models_beat_the_base_model_on_their_own_site(demo):
    run, _ = demo
    table = pd.read_csv(run / "report" / "perplexity.csv").set_index("model")
    for site in ("alpha", "beta"):
        assert table.loc[site, site] < 0.5 * table.loc["base", site]
        # Each site model is specialised: it is better at home than the other site's model is there.
        other = "beta" if site == "alpha" else "alpha"
        assert table.loc[site, site] < table.loc[other, site]
    # The merged model sits between: better than the base everywhere.
    assert (table.loc["aggregate", ["alpha", "beta"]] < table.loc["base", ["alpha", "beta"]]).all()


def test_every_stage_left_its_outputs(demo):
    run, _ = demo
    for site in ("alpha", "beta"):
        model = run / "round-1" / site / "model"
        training = json.loads((model / "training.json").read_text())
        assert training["site"] == site and training["steps"] == 60 and training["world_size"] == 2
        assert (model / "loss.csv").read_text().startswith("step,")
        assert (model / "model.safetensors").is_file()
    record = json.loads((run / "round-1" / "aggregate" / "model" / "aggregate.json").read_text())
    assert record["method"] == "fedavg"
    for name in ("perplexity.csv", "perplexity.md", "perplexity.png", "loss.png", "training.csv"):
        assert (run / "report" / name).stat().st_size > 0, name


def test_rerun_has_nothing_to_do_and_the_html_report_builds(demo):
    _, workdir = demo
    again = snakemake(workdir, "-n")
    assert "Nothing to be done" in again.stdout + again.stderr
    snakemake(workdir, "--report", "report.html")
    html = (workdir / "report.html").read_text(errors="replace")
    assert "perplexity" in html.lower()
