"""dataset.shareable: where a site's text may be read. A site whose text stays home is refused, before any
job runs, every setting that would read it on another cluster or pool it; the aggregating cluster reads
only the test split of another cluster's site; the report says where each site's text was read."""

from __future__ import annotations

import copy
import re
from html import unescape

import pytest

from fedtune.core.options import ConfigError
from fedtune.core.residency import data_lines, data_read_on
from fedtune.download.options import DatasetOptions
from fedtune.run.config import build_run_config

from .test_report import write_evals
from .workflow_harness import demo_config, dry_run, snakemake, write_config


def two_clusters(private=("beta",), aggregate_on="leo", **federation) -> dict:
    """The demo's sites on two clusters (alpha on leo, beta on karo) from a hub model; `private` sites'
    text stays home (dataset.shareable false)."""
    config = demo_config()
    config["model"] = {"source": "hf", "name": "org/model"}
    config["sites"]["alpha"]["cluster"] = "leo"
    config["sites"]["beta"]["cluster"] = "karo"
    for site in config["sites"].values():
        site["dataset"]["shareable"] = True
    for site in private:
        config["sites"][site]["dataset"]["shareable"] = False
    # Each cluster pulls from the other (their run folders, as rsync would name them).
    remotes = {"leo": "me@leo:/scratch/results/demo", "karo": "me@karo:/scratch/results/demo"}
    config["federation"] = {"rounds": 1, "pooled_baseline": False, "aggregate_on": aggregate_on,
                            "remotes": remotes, **federation}  # fmt: skip
    return config


def test_local_files_stay_home_by_default_and_hub_data_sets_may_travel():
    local = {"source": "local", "data_files": {"train": "x.jsonl"}}
    hub = {"source": "hf", "name": "allenai/c4"}
    assert DatasetOptions.from_mapping(local).shareable is False
    assert DatasetOptions.from_mapping(hub).shareable is True
    assert DatasetOptions.from_mapping({**local, "shareable": True}).shareable is True
    assert DatasetOptions.from_mapping({**hub, "shareable": False}).shareable is False
    # The decision is written into the run's settings (report/settings.json), and reads back the same.
    config = two_clusters(private=(), aggregate_on="leo")
    del config["sites"]["beta"]["dataset"]["shareable"]
    config["federation"]["aggregate_on"] = "karo"
    run = build_run_config(config)
    assert run.raw["sites"]["beta"]["dataset"]["shareable"] is False
    assert DatasetOptions.from_json(run.sites["beta"].dataset.to_json()).shareable is False
    # Where the text goes decides no download: the download's options leave it out.
    assert "shareable" not in run.sites["beta"].dataset.download_json()


def test_the_pooled_baseline_with_a_site_whose_text_stays_home_is_refused():
    config = two_clusters(private=("beta",))
    for site in config["sites"].values():
        site["cluster"] = "local"  # one cluster: pooling would still mix beta's text with alpha's
    config["federation"].update(pooled_baseline=True, aggregate_on=None)
    with pytest.raises(
        ConfigError,
        match=r"^x.yaml: federation.pooled_baseline: .* site beta's text may not leave it "
        r"\(sites.beta.dataset.shareable: false\); set federation.pooled_baseline: false, or "
        r"sites.beta.dataset.shareable: true",
    ):
        build_run_config(copy.deepcopy(config), source="x.yaml")
    config["sites"]["beta"]["dataset"]["shareable"] = True
    assert build_run_config(config).pooled is not None


def test_cross_site_scores_that_read_a_private_sites_text_elsewhere_are_refused():
    """evaluate.cross_site text_to_models reads every site's test text where the models meet: a private
    site on another cluster is refused, naming the setting, the site, the key and both ways out. The
    default with sites on several clusters (none) reads each site's text at home only, and is allowed."""
    with pytest.raises(
        ConfigError,
        match=r"evaluate.cross_site: text_to_models reads every site's test text where the models meet "
        r"\(leo, federation.aggregate_on\), but site beta trains on karo and sites.beta.dataset.shareable "
        r"is false; set evaluate.cross_site: none .*, or sites.beta.dataset.shareable: true if its text "
        r"may be read on leo",
    ):
        config = two_clusters(private=("beta",), aggregate_on="leo")
        config["evaluate"] = {"cross_site": "text_to_models"}
        build_run_config(config)
    run = build_run_config(two_clusters(private=("alpha", "beta"), aggregate_on="karo"))
    assert run.evaluate.cross_site == "none"
    assert run.raw["evaluate"]["cross_site"] == "none"  # the decision is in the run's settings.json
    assert run.data_read_on == {"alpha": ("leo",), "beta": ("karo",)}
    assert data_lines(run.raw) == ["site alpha: data read only on leo", "site beta: data read only on karo"]
    shared = two_clusters(private=("beta",), aggregate_on="karo")
    shared["evaluate"] = {"cross_site": "text_to_models"}
    run = build_run_config(shared)
    assert run.data_read_on == {"alpha": ("leo", "karo"), "beta": ("karo",)}
    assert data_lines(run.raw) == ["site alpha: data read on leo, karo", "site beta: data read only on karo"]
    # One cluster: every model on every site's text, as before (nothing moves for it).
    one = demo_config()
    assert build_run_config(one).evaluate.cross_site == "text_to_models"
    # A run's settings.json from before the setting: every site's text was read where the models met.
    old = copy.deepcopy(run.raw)
    del old["evaluate"]["cross_site"]
    assert data_read_on(old) == run.data_read_on


def test_a_tokenizer_built_from_a_private_sites_text_on_every_cluster_is_refused():
    config = two_clusters(private=("beta",), aggregate_on="karo")
    config["model"] = demo_config()["model"]  # source init: each cluster trains it on every site's text
    with pytest.raises(
        ConfigError,
        match=r"sites.beta.dataset.shareable: false, but model.source init trains the tokenizer on every "
        r"site's text on every cluster, so site beta's text would be read on leo too",
    ):
        build_run_config(config)


def test_the_report_says_where_each_sites_text_was_read(tmp_path):
    from fedtune.report.build import ReportJob, report

    config = two_clusters(private=("beta",), aggregate_on="karo")
    config["evaluate"] = {"cross_site": "text_to_models"}
    run = build_run_config(config)
    paths = report(ReportJob(tmp_path / "report", write_evals(tmp_path), settings=run.raw))
    page = unescape(paths["settings_html"].read_text())
    assert (
        "<p>Where each site's text was read (sites.<site>.dataset.shareable):<br>"
        "site alpha: data read on leo, karo<br>site beta: data read only on karo</p>"
    ) in page


def test_the_aggregating_cluster_downloads_only_the_test_split_of_another_clusters_site(
    tmp_path, tiny_model_dir
):
    """evaluate.cross_site text_to_models: the models' cluster reads the other cluster's test split."""
    config = two_clusters(private=("alpha",), aggregate_on="leo")
    config.update(cluster="leo", model={"source": "local", "path": str(tiny_model_dir)})
    config["evaluate"] = {"cross_site": "text_to_models"}
    write_config(tmp_path, config)
    jobs = dry_run(tmp_path, "results/demo/eval/base/alpha.json")
    downloads = {job.wildcards["site"]: job.shell for job in jobs if job.name == "download_data"}
    assert set(downloads) == {"alpha", "beta"}
    assert "--splits" not in downloads["alpha"]
    assert "--splits test" in downloads["beta"]


def test_by_default_no_cluster_reads_another_clusters_text_and_the_scores_cross(tmp_path, tiny_model_dir):
    """Sites on two clusters (evaluate.cross_site none, the default): each cluster downloads its own site
    only and scores on it the base model, every aggregate and the site's own model; karo marks each score
    complete for leo, whose report waits for them (fetch_score), and whose evaluations read alpha only."""
    plans = {}
    for cluster in ("leo", "karo"):
        workdir = tmp_path / cluster
        workdir.mkdir()
        config = two_clusters(private=("beta",), aggregate_on="leo", rounds=2)
        config.update(cluster=cluster, model={"source": "local", "path": str(tiny_model_dir)})
        config["evaluate"] = {"intermediate": "aggregate"}
        write_config(workdir, config)
        plans[cluster] = dry_run(workdir)
    leo, karo = plans["leo"], plans["karo"]
    assert {job.wildcards["site"] for job in leo if job.name == "download_data"} == {"alpha"}
    assert {job.wildcards["site"] for job in karo if job.name == "download_data"} == {"beta"}
    # (download_model's --corpora names every site's folder; it reads them with model.source init only.)
    for job in leo:
        assert job.name == "download_model" or "data/beta/raw" not in job.shell, (job.name, job.shell)
    scored = {(job.name, str(job.wildcards.get("round")), job.wildcards.get("model")) for job in karo
              if job.name.startswith("evaluate")}  # fmt: skip
    # Round 1's aggregate is scored by beta's training of round 2, before it trains (train_scoring).
    assert scored == {("evaluate_base", "None", None), ("evaluate_round", "2", "aggregate"),
                      ("evaluate_round_own", "2", "beta")}  # fmt: skip
    for job in karo:
        if job.name.startswith("evaluate") or job.name == "train_scoring":
            assert '"site":"beta"' in job.shell and '"site":"alpha"' not in job.shell, job.shell
    assert '"out":"results/demo/round-2/beta/before/aggregate.json"' in next(
        job.shell for job in karo if job.name == "train_scoring"
    )
    marked = {job.wildcards["item"] for job in karo if job.name == "mark_complete"}
    made = {"eval/base/beta.json", "round-2/beta/before/aggregate.json", "round-2/eval/aggregate/beta.json",
            "round-2/eval/beta/beta.json"}  # fmt: skip
    # ... and, after its last job, its jobs' accounting for the report's cost table.
    assert made <= marked and marked - made == {"data/beta/manifest.json", "round-1/beta/model",
                                                "round-2/beta/model", "report/cost_jobs-karo.csv"}  # fmt: skip
    part = next(job for job in karo if job.name == "report_cost_part")
    assert "--jobs-only karo " in part.shell
    assert any(job.name == "fetch_cost_part" for job in leo)
    assert "--remote-jobs results/demo/report/cost_jobs-karo.csv " in next(
        job.shell for job in leo if job.name == "report_cost"
    )
    # The last round's aggregate goes to karo too, to be scored there.
    assert {job.wildcards["round"] for job in karo if job.name == "fetch_aggregate"} == {"1", "2"}
    fetched = {re.search(r"--out \S*results/demo/(\S+)", job.shell).group(1) for job in leo
               if job.name in ("fetch_score", "fetch_base_score")}  # fmt: skip
    # ... each into its usual place in leo's run folder, where the report reads it.
    assert fetched == {"eval/base/beta.json", "round-1/eval/aggregate/beta.json", "round-2/eval/aggregate/beta.json",
                       "round-2/eval/beta/beta.json"}  # fmt: skip
    assert "outbox/round-2/beta/before/aggregate.json " in next(
        job.shell for job in leo if job.name == "fetch_score" and job.wildcards["round"] == "1"
    )
    assert {(str(job.wildcards.get("round")), job.wildcards.get("model")) for job in leo
            if job.name.startswith("evaluate")} == {("None", None), ("1", "aggregate"), ("2", "aggregate"),
                                                    ("2", "alpha")}  # fmt: skip


def test_a_private_sites_text_is_not_downloaded_on_another_cluster(tmp_path, tiny_model_dir):
    config = two_clusters(private=("beta",), aggregate_on="karo")
    config.update(cluster="leo", model={"source": "local", "path": str(tiny_model_dir)})
    write_config(tmp_path, config)
    result = snakemake(tmp_path, "--dry-run", "results/demo/data/beta/raw", check=False)
    assert result.returncode != 0
    assert (
        "site beta's text is read only on karo, not on leo (sites.beta.dataset.shareable: false)"
        in result.stderr + result.stdout
    )
