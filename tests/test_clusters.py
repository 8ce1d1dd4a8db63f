"""fedtune/core/clusters.py: the clusters read from their files, the rule groups the profiles place, and the
helpers every cluster profile imports (the profiles as Snakemake reads them: tests/test_site_audit.py,
tests/test_site_profiles.py)."""

from __future__ import annotations

import os
import subprocess

import pytest

from fedtune.core import clusters
from fedtune.core.clusters import (
    RULE_GROUPS,
    TRAIN_RULES,
    account,
    choice,
    rule_group,
    rules,
    scratch_results,
    site_clusters,
    smoke,
    smoke_test,
)

from .workflow_harness import ROOT

SCRATCH_VARIABLES = ["FEDTUNE_SCRATCH", "SCRATCH", "CINECA_SCRATCH"]


def test_rules_lists_a_groups_rules_in_order_and_names_an_unknown_group():
    assert rules("tokenize", "compress") == ("tokenize", "compress_update")
    assert rules("train")[0] == "train" and set(rules("train")) == set(TRAIN_RULES)
    assert rule_group("train_scoring") == "train" and rule_group("decode_aggregate") == "round"
    assert rule_group("report") is None
    with pytest.raises(KeyError, match="no rule group gpu: the groups are download, tokenize, compress"):
        rules("train", "gpu")


def test_the_dry_runs_summary_counts_the_train_group_as_trainings():
    from fedtune.report.plan import TRAIN_RULES as PLANNED

    assert set(PLANNED) == set(RULE_GROUPS["train"])


def test_the_clusters_are_their_files_and_the_gpu_sites_those_that_source_the_common_part(tmp_path):
    (tmp_path / "_common.sh").write_text("export NCCL_DEBUG=WARN\n")
    (tmp_path / "alpha.sh").write_text('export X=1\nsource "${BASH_SOURCE[0]%/*}/_common.sh"\n')
    (tmp_path / "beta.sh").write_text("# like slurm-local: no _common.sh\nexport OMP_NUM_THREADS=1\n")
    (tmp_path / "gamma.sh").write_text('  . "$FEDTUNE_HERE/_common.sh"  # shared\n')
    (tmp_path / "notes.txt").write_text("source ./_common.sh\n")
    assert clusters.clusters(tmp_path) == ["alpha", "beta", "gamma"]
    assert site_clusters(tmp_path) == ["alpha", "gamma"]
    # This repository: the four sites, and the local test cluster, which is no site.
    assert "slurm-local" in clusters.clusters() and "slurm-local" not in site_clusters()
    assert site_clusters() and set(site_clusters()) <= set(clusters.clusters())
    for name in site_clusters():
        assert (ROOT / "profiles" / name / "config.yaml").is_file(), name


def setup_env_torch(cluster: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ROOT / "scripts" / "setup-env"), "--print-torch"],
        env={**os.environ, "FEDTUNE_CLUSTER": cluster, "FEDTUNE_TORCH_INDEX": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_setup_env_reads_the_same_cluster_files():
    """scripts/setup-env tells a GPU site from its file as site_clusters does: the CUDA 12.6 build there,
    the default elsewhere; a name without a file is refused with the list of files."""
    for name in clusters.clusters():
        result = setup_env_torch(name)
        assert result.returncode == 0, result.stderr
        assert ("--index-url" in result.stdout.split()) == (name in site_clusters()), (name, result.stdout)
    result = setup_env_torch("nowhere")
    assert result.returncode == 2
    assert "FEDTUNE_CLUSTER=nowhere has no file scripts/clusters/nowhere.sh: use local or one of " in (
        result.stderr
    )
    assert all(name in result.stderr for name in clusters.clusters()), result.stderr


def test_account_is_the_clusters_own_then_the_general_one_and_required_unless_said(monkeypatch, capsys):
    monkeypatch.delenv("FEDTUNE_ACCOUNT", raising=False)
    monkeypatch.delenv("FEDTUNE_SOMEWHERE_ACCOUNT", raising=False)
    assert account("somewhere", required=False) is None
    with pytest.raises(SystemExit) as stopped:
        account("somewhere")
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (
        "error: no Slurm account for somewhere: set FEDTUNE_ACCOUNT (or FEDTUNE_SOMEWHERE_ACCOUNT) to your "
        "project account, e.g. `export FEDTUNE_ACCOUNT=<project>`\n"
    )
    monkeypatch.setenv("FEDTUNE_ACCOUNT", "p1")
    assert account("somewhere") == "p1"
    monkeypatch.setenv("FEDTUNE_SOMEWHERE_ACCOUNT", "p2")
    assert account("somewhere") == account("somewhere", required=False) == "p2"


def test_smoke_reads_the_environment_at_each_call(monkeypatch):
    monkeypatch.delenv("FEDTUNE_SMOKE", raising=False)
    assert not smoke_test() and smoke("debug", "normal") == "normal"
    monkeypatch.setenv("FEDTUNE_SMOKE", "1")
    assert smoke_test() and smoke("debug", "normal") == "debug"
    monkeypatch.setenv("FEDTUNE_SMOKE", "0")
    assert not smoke_test()


def test_scratch_results_takes_fedtune_scratch_then_the_sites_variables_then_the_project(
    monkeypatch, tmp_path
):
    for name in SCRATCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    project = tmp_path / "project"
    assert scratch_results("SCRATCH", project=str(project)) is None
    project.mkdir()
    assert scratch_results("SCRATCH", project=str(project)) == f"{project}/fedtune/results"
    monkeypatch.setenv("CINECA_SCRATCH", "/cineca")
    assert scratch_results("SCRATCH", "CINECA_SCRATCH") == "/cineca/fedtune/results"
    assert scratch_results("SCRATCH") is None
    monkeypatch.setenv("SCRATCH", "/scratch")
    assert scratch_results("SCRATCH", "CINECA_SCRATCH", project=str(project)) == "/scratch/fedtune/results"
    monkeypatch.setenv("FEDTUNE_SCRATCH", "/mine")
    assert scratch_results("SCRATCH") == scratch_results() == "/mine/results"


def test_choice_defaults_and_names_the_choices_of_a_wrong_value(monkeypatch):
    monkeypatch.delenv("FEDTUNE_X_PARTITION", raising=False)
    assert choice("FEDTUNE_X_PARTITION", "gpu", "cpu") == "gpu"
    monkeypatch.setenv("FEDTUNE_X_PARTITION", "")
    assert choice("FEDTUNE_X_PARTITION", "gpu", "cpu") == "gpu"
    monkeypatch.setenv("FEDTUNE_X_PARTITION", "cpu")
    assert choice("FEDTUNE_X_PARTITION", "gpu", "cpu") == "cpu"
    monkeypatch.setenv("FEDTUNE_X_PARTITION", "fpga")
    with pytest.raises(ValueError, match=r"^FEDTUNE_X_PARTITION=fpga: use gpu \(the default\) or cpu$"):
        choice("FEDTUNE_X_PARTITION", "gpu", "cpu")
