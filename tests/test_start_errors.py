"""What a first-time user's mistakes print at start: one line naming the file, key or value, before any
job (issue 37: a cluster with no work, a site's cluster without a remote, a YAML syntax error, the
SmolLM2 file not fetched yet)."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from fedtune.core.config_files import configfile_problem
from fedtune.core.options import ConfigError
from fedtune.download.options import FETCHED_GGUF
from fedtune.run.config import build_run_config, load_config

from .workflow_harness import ROOT, demo_config, snakemake, write_config

LLAMA2 = ROOT / "config" / "examples" / "llama2-it-cs.yaml"


def two_clusters(cluster: str | None, **federation) -> dict:
    """The demo with alpha on leonardo and beta on juwels, the models meeting on leonardo."""
    config = demo_config(cluster=cluster)
    config["sites"]["alpha"]["cluster"] = "leonardo"
    config["sites"]["beta"]["cluster"] = "juwels"
    config["federation"] = {"aggregate_on": "leonardo", **federation}
    return config


def refused(config: dict) -> str:
    with pytest.raises(ConfigError) as error:
        build_run_config(copy.deepcopy(config), source="my.yaml", base_dir=ROOT)
    message = str(error.value)
    assert "\n" not in message, message
    return message


def example_in(workdir: Path, example: Path) -> None:
    (workdir / "config.yaml").write_text(example.read_text())


def last_line(result) -> str:
    return result.stderr.strip().splitlines()[-1]


def printed(result) -> str:
    """What Snakemake printed: its errors go to stdout, a profile's to stderr."""
    return result.stdout + result.stderr


# A cluster with nothing to do here (point 6).


def test_a_cluster_that_neither_trains_nor_aggregates_is_refused_naming_the_configs_clusters():
    message = refused(two_clusters("leonard"))
    assert message.startswith("my.yaml: cluster: 'leonard' trains no site and does not aggregate"), message
    assert "this config's clusters are juwels, leonardo" in message, message


def test_every_cluster_with_work_is_accepted():
    """Each site's cluster, a cluster that only aggregates, and no cluster at all (everything here)."""
    remotes = {"juwels": "me@juwels:/run", "leonardo": "me@leo:/run"}
    for cluster in ("leonardo", "juwels", None):
        assert build_run_config(two_clusters(cluster, remotes=remotes), base_dir=ROOT).cluster == cluster
    config = two_clusters("hub", remotes=remotes)
    config["federation"]["aggregate_on"] = "hub"
    assert build_run_config(config, base_dir=ROOT).aggregate_on == "hub"


def test_a_mistyped_cluster_stops_the_dry_run_at_start(tmp_path):
    """`--config cluster=leonard` used to exit 0 with one job (all)."""
    example_in(tmp_path, LLAMA2)
    result = snakemake(tmp_path, "-n", "--config", "cluster=leonard", check=False, timeout=120)
    output = printed(result)
    assert result.returncode != 0, output[-2000:]
    assert "cluster: 'leonard' trains no site" in output and "clusters are karolina, leonardo" in output
    assert "rule all" not in output


def test_an_example_under_a_profile_that_has_none_of_its_sites_is_refused(tmp_path):
    """Iris (which needs no account) with the Leonardo + Karolina example."""
    example_in(tmp_path, LLAMA2)
    result = snakemake(tmp_path, "-n", profile="iris", check=False, timeout=120)
    assert result.returncode != 0, printed(result)[-2000:]
    assert "cluster: 'iris' trains no site and does not aggregate" in printed(result), printed(result)[-2000:]


# A cluster without a federation.remotes entry (point 7).


@pytest.mark.parametrize("pooled", [False, True])
def test_the_aggregating_cluster_needs_a_remote_for_each_other_sites_cluster(pooled):
    """Named: the site, its cluster and the line to add; not the pooled baseline, which is refused
    for two clusters too, but second."""
    config = two_clusters("leonardo", pooled_baseline=pooled)
    message = refused(config)
    assert message.startswith("my.yaml: sites.beta.cluster: juwels has no federation.remotes entry"), message
    assert "add under federation.remotes `juwels: user@host:/path/to/results/demo`" in message, message
    assert "profiles/juwels" not in message and "pooled" not in message


def test_the_other_clusters_need_a_remote_for_the_aggregating_one_when_an_aggregate_crosses():
    message = refused(two_clusters("juwels", rounds=2, remotes={"juwels": "me@juwels:/run"}))
    assert message.startswith("my.yaml: federation.aggregate_on: leonardo has no federation.remotes"), message
    assert "juwels (sites beta) fetches each round's aggregate" in message, message
    assert "`leonardo: user@host:/path/to/results/demo`" in message, message
    # One round, scored where the models meet: nothing comes back to juwels; pushed into its inbox: it
    # fetches nothing itself. Scored at home (evaluate.cross_site none, the default), the one aggregate
    # comes back to juwels, to be scored on beta's text.
    one_round = two_clusters("juwels", rounds=1)
    assert "juwels (sites beta) fetches each round's aggregate" in refused(one_round)
    one_round["evaluate"] = {"cross_site": "text_to_models"}
    build_run_config(one_round, base_dir=ROOT)
    pushed = {"juwels": {"path": "me@juwels:/run", "transfer": "push"}}
    build_run_config(two_clusters("juwels", rounds=2, remotes=pushed), base_dir=ROOT)
    build_run_config(two_clusters("leonardo", remotes=pushed), base_dir=ROOT)


def test_a_missing_remote_stops_the_dry_run_at_start(tmp_path):
    """Used to end in an InputFunctionException of fetch_site_model with a traceback."""
    write_config(tmp_path, two_clusters("leonardo"))
    result = snakemake(tmp_path, "-n", check=False, timeout=120)
    output = printed(result)
    assert result.returncode != 0
    assert "sites.beta.cluster: juwels has no federation.remotes entry" in output, output[-2000:]
    assert "InputFunctionException" not in output and "Building DAG" not in output


# YAML syntax errors (point 8).

BROKEN = {
    # text, line and column of the problem, a phrase of it
    "flow": ("run: demo\nsites:\n  alpha: [unclosed\n", 4, 1, "expected ',' or ']'"),
    "tab": ("run: demo\nsites:\n\talpha: {}\n", 3, 1, "found character '\\t' that cannot start any token"),
    "indent": ("run: demo\n  results: x\nsites: {}\n", 2, 10, "mapping values are not allowed here"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_yaml_error_names_the_file_line_and_column(case, tmp_path):
    text, line, column, phrase = BROKEN[case]
    path = tmp_path / "my.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    message = str(error.value)
    assert message.startswith(f"{path}:{line}:{column}: not valid YAML: "), message
    assert phrase in message and "\n" not in message, message
    assert configfile_problem(["-n", "--configfile", str(path), "--cores", "1"]) == message
    assert configfile_problem([f"--configfile={path}"]) == message


def test_the_command_line_check_passes_valid_files_and_names_an_absent_one(tmp_path):
    """An absent file (or a target after --configfile) used to be left to Snakemake, whose answer was a
    27-line traceback (issue 48): now it is one line (tests/test_first_hour.py has the cases)."""
    (tmp_path / "ok.yaml").write_text("run: demo\n")
    (tmp_path / "ok.json").write_text('{"run": "demo"}')
    args = ["--configfile", str(tmp_path / "ok.yaml"), str(tmp_path / "ok.json")]
    assert configfile_problem(args) is None
    assert configfile_problem([*args, str(tmp_path / "absent")]).startswith(
        f"--configfile {tmp_path / 'absent'}"
    )
    assert configfile_problem(["--config", "run=x", "--configfiles", str(tmp_path / "ok.yaml")]) is None


@pytest.mark.parametrize("profile", ["local", "leonardo"])
def test_snakemake_names_the_line_and_column_of_a_yaml_error_in_one_line(profile, tmp_path, monkeypatch):
    """Snakemake reads --configfile before the workflow (and says "not valid JSON or YAML"); every profile
    checks the file first."""
    monkeypatch.setenv("FEDTUNE_ACCOUNT", "proj123")
    (tmp_path / "config.yaml").write_text(BROKEN["flow"][0])
    result = snakemake(tmp_path, "-n", profile=profile, check=False, timeout=120)
    assert result.returncode == 2
    expected = f"error: {tmp_path / 'config.yaml'}:4:1: not valid YAML: expected ',' or ']'"
    assert last_line(result).startswith(expected), result.stderr[-2000:]
    assert "usage:" not in result.stderr and "not valid JSON or YAML" not in result.stderr


def test_every_profile_checks_the_yaml_of_its_configfiles():
    for path in sorted((ROOT / "profiles").glob("*/config.yaml")):
        assert "refuse_broken_configfiles(sys.argv)" in path.read_text(), path


# The SmolLM2 examples on a fresh clone (point 10).


def test_the_missing_smollm2_file_names_the_command_that_fetches_it(tmp_path):
    """Both SmolLM2 examples, in a folder without .cache/models: the dry run stops at start."""
    for example in sorted((ROOT / "config" / "examples").glob("smollm2-*.yaml")):
        workdir = tmp_path / example.stem
        workdir.mkdir()
        example_in(workdir, example)
        result = snakemake(workdir, "-n", check=False, timeout=120)
        assert result.returncode != 0, example.name
        assert re.search(
            r"model\.path: GGUF file not found: \S+SmolLM2-135M-Instruct\.Q4_1\.gguf; "
            r"`scripts/setup-env --smollm2` brings it",
            printed(result),
        ), printed(result)[-2000:]


def test_the_fetched_gguf_names_agree_with_the_fetch_script_and_the_examples():
    script = (ROOT / "scripts" / "fetch-smollm2").read_text()
    (name,) = re.findall(r"^file=(\S+)$", script, re.M)
    assert FETCHED_GGUF == {name: "scripts/setup-env --smollm2"}
    for example in (ROOT / "config" / "examples").glob("smollm2-*.yaml"):
        assert Path(yaml.safe_load(example.read_text())["model"]["path"]).name == name, example
