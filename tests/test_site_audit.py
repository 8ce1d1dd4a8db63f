"""The second site audit (issue 50): what a user meets on the first day at each site, held by tests where
a test can hold it. Every rule that becomes a Slurm job has resources in every cluster profile, whatever
the profile's switches; host names agree across the examples, the quick start and the docs; CPU jobs go
where a GPU-only project may run them; Leonardo's serial jobs fit its per-user cap and the dry run says
how long they take; Iris's GPU jobs avoid the 16 GB V100s. Read from the profiles as Snakemake reads them
(yte) and from dry runs; nothing here reaches a site."""

from __future__ import annotations

import re

import pytest
import yaml

from fedtune.core import clusters as cluster_helpers
from fedtune.core.clusters import RULE_GROUPS, site_clusters

from .test_profiles import local_rules, profile_settings
from .workflow_harness import ROOT, snakemake

# The GPU clusters: every file scripts/clusters/<name>.sh that sources _common.sh, with its profile.
CLUSTERS = site_clusters()
# The switches of a site's profile beyond FEDTUNE_SMOKE (each read with its other value set).
SITE_SWITCHES = {
    "karolina": {"FEDTUNE_KAROLINA_CPU_PARTITION": "qcpu"},
    "meluxina": {"FEDTUNE_MELUXINA_CPU_PARTITION": "cpu"},
}
# Each profile under each value of its switches (the profile is read with these variables set).
SWITCHES = {
    cluster: [{}, *([SITE_SWITCHES[cluster]] if cluster in SITE_SWITCHES else []), {"FEDTUNE_SMOKE": "1"}]
    for cluster in CLUSTERS
}
SWITCH_VARIABLES = ["FEDTUNE_SMOKE", *(name for switch in SITE_SWITCHES.values() for name in switch)]


def workflow_rules() -> set[str]:
    """Every rule the workflow can define, conditional ones included (exchange, adapters, pooled, sweep):
    read from workflow/rules/*.smk, as `rule NAME:` and `use rule ... as NAME`."""
    return {
        match.group(1) or match.group(2)
        for path in (ROOT / "workflow" / "rules").glob("*.smk")
        for match in re.finditer(r"^\s*(?:rule (\w+):|use rule \w+ as (\w+))", path.read_text(), re.M)
    }


def settings(monkeypatch, cluster: str, **variables: str) -> dict:
    for name in SWITCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FEDTUNE_ACCOUNT", "p200001")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    return profile_settings(cluster)


def test_the_rule_list_sees_the_conditional_rules():
    rules = workflow_rules()
    assert {"compress_update", "decode_site_model", "compress_aggregate", "decode_aggregate",
            "train_merging", "merge_adapter", "evaluate_pooled_sweep", "tokenize"} <= rules  # fmt: skip


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_every_rule_that_becomes_a_slurm_job_has_resources_in_the_clusters_profile(cluster, monkeypatch):
    """A rule missing from set-resources would fall to default-resources, which no profile can size for
    every kind of job (on Karolina: qgpu without a GPU; on MeluXina before: the cpu partition a GPU-only
    project may not use). A rule added to the workflow fails here until each profile places it."""
    for variables in SWITCHES[cluster]:
        placed = settings(monkeypatch, cluster, **variables).get("set-resources", {})
        jobs = workflow_rules() - local_rules(cluster)
        missing = sorted(rule for rule in jobs if "slurm_partition" not in placed.get(rule, {}))
        assert not missing, f"profiles/{cluster} ({variables or 'defaults'}) places no {missing}"


def test_every_rule_that_becomes_a_slurm_job_is_in_a_rule_group():
    """The profiles place groups of rules (fedtune/core/clusters.py, RULE_GROUPS), so a rule in no group
    would be placed by none: a rule added to the workflow fails here until it joins a group."""
    grouped = [rule for names in RULE_GROUPS.values() for rule in names]
    assert len(grouped) == len(set(grouped)), "a rule in two groups"
    jobs = workflow_rules() - local_rules()
    assert not sorted(jobs - set(grouped)), f"rules in no group of RULE_GROUPS: {sorted(jobs - set(grouped))}"
    assert not sorted(set(grouped) - workflow_rules()), "RULE_GROUPS names a rule the workflow lacks"


# What a profile's __definitions__ may not define itself: each shared helper of fedtune/core/clusters.py.
SHARED_HELPERS = [name for name in cluster_helpers.__all__ if callable(getattr(cluster_helpers, name))]


def repeated_helpers(text: str) -> list[str]:
    """What a profile's __definitions__ does itself that the shared helpers do: a function of its own (a
    site's choice is data passed to a helper, e.g. choice(variable, default, other)), a copy of the
    configfile check or of the account's environment lookup, a helper used but not imported."""
    definitions = yaml.safe_load(text).get("__definitions__", [])
    code = "\n".join(definitions)
    problems = [f"defines {name}" for name in re.findall(r"^\s*def (\w+)", code, re.M)]
    problems += [
        f"uses {word}" for word in re.findall(r"\b(?:configfile_problem|os\.environ|SystemExit)\b", code)
    ]
    imports = re.findall(r"^from fedtune\.core\.clusters import (.+)$", code, re.M)
    imported = {name.strip() for line in imports for name in line.split(",")}
    if (
        "refuse_broken_configfiles" not in imported
        or "refuse_broken_configfiles(sys.argv)" not in definitions
    ):
        problems.append("no refuse_broken_configfiles(sys.argv) from fedtune.core.clusters")
    rest = text.split("__definitions__", 1)[-1]
    problems += [f"uses {name} without importing it" for name in SHARED_HELPERS
                 if re.search(rf"(?<![.\w]){name}\(", rest) and name not in imported]  # fmt: skip
    return problems


@pytest.mark.parametrize(
    "profile", sorted(path.parent.name for path in (ROOT / "profiles").glob("*/config.yaml"))
)
def test_no_profile_repeats_a_shared_helper(profile):
    """The configfile check, the account, the smoke test's switch and the scratch folder live once, in
    fedtune/core/clusters.py: every profile imports what it uses."""
    assert not repeated_helpers((ROOT / "profiles" / profile / "config.yaml").read_text()), profile


def test_the_helper_check_finds_a_copied_helper():
    """A profile as they were before the helpers moved (each carried its own copy)."""
    copied = (
        "__use_yte__: true\n__definitions__:\n  - import os, sys\n  - |\n"
        "    try:\n        from fedtune.core.config import refuse_broken_configfiles\n"
        "    except ImportError:\n        pass\n    else:\n        refuse_broken_configfiles(sys.argv)\n"
        "  - |\n    def account(cluster):\n        return os.environ.get('FEDTUNE_ACCOUNT')\n"
        "  - |\n    def scratch_results():\n        return None\n"
        "default-resources:\n  slurm_account: ?account('x')\n  runtime: ?smoke(10, 60)\n"
    )
    problems = repeated_helpers(copied)
    assert {"defines account", "defines scratch_results", "uses os.environ"} <= set(problems), problems
    assert "no refuse_broken_configfiles(sys.argv) from fedtune.core.clusters" in problems, problems
    assert "uses smoke without importing it" in problems, problems


def test_the_exchange_rules_run_where_their_kind_of_job_does(monkeypatch):
    """compress_update is CPU work after a training; the decoding and the aggregate's compression join the
    round's group job, so they ask for the evaluations' place (a group job takes its parts' largest)."""
    for cluster in CLUSTERS:
        placed = settings(monkeypatch, cluster)["set-resources"]
        for rule in ("decode_site_model", "compress_aggregate", "decode_aggregate"):
            assert placed[rule]["slurm_partition"] == placed["evaluate_round"]["slurm_partition"], (
                cluster,
                rule,
            )
        assert placed["compress_update"]["slurm_partition"] == placed["tokenize"]["slurm_partition"] or (
            cluster == "karolina" and placed["compress_update"]["gres"] == "gpu:1"
        ), cluster


def test_karolina_sends_no_gpu_less_job_to_qgpu(monkeypatch):
    """qgpu is allocated by eighths of a node (1 GPU + 16 cores): every job placed there but the trainings
    (whose GPUs the config gives) asks for a GPU."""
    for variables in SWITCHES["karolina"]:
        placed = settings(monkeypatch, "karolina", **variables)["set-resources"]
        for rule, resources in placed.items():
            if resources.get("slurm_partition") in ("qgpu", "qgpu_exp") and not rule.startswith("train"):
                assert resources.get("gres") == "gpu:1", (variables, rule, resources)


def test_meluxina_cpu_jobs_go_where_the_project_holds_node_hours(monkeypatch):
    """LuxProvide runs a job only on a partition the project holds node-hours on, and LLM projects are
    often GPU-only: by default the CPU jobs take a quarter of a GPU node; FEDTUNE_MELUXINA_CPU_PARTITION=cpu
    puts them on the cpu partition; another value is refused by name."""
    default = settings(monkeypatch, "meluxina")
    assert default["default-resources"]["slurm_partition"] == "gpu"
    for rule in ("tokenize", "compress_update"):
        assert default["set-resources"][rule]["slurm_partition"] == "gpu"
        assert default["set-resources"][rule]["gres"] == "gpu:1"
    cpu = settings(monkeypatch, "meluxina", FEDTUNE_MELUXINA_CPU_PARTITION="cpu")
    for rule in ("tokenize", "compress_update"):
        assert (
            cpu["set-resources"][rule]["slurm_partition"] == "cpu"
            and "gres" not in cpu["set-resources"][rule]
        )
    with pytest.raises(Exception, match="FEDTUNE_MELUXINA_CPU_PARTITION=fpga: use gpu"):
        settings(monkeypatch, "meluxina", FEDTUNE_MELUXINA_CPU_PARTITION="fpga")


# CINECA's limits of lrd_all_serial per user at a time.
SERIAL_CAP = {"cores": 4, "mem_mb": 30800}


def test_leonardos_serial_jobs_fill_its_per_user_cap_side_by_side(monkeypatch):
    """lrd_all_serial runs at most 1 node, 4 cores and 30,800 MB of a user's jobs at a time: the download,
    tokenize and compression jobs are sized so that jobs_per_user of them fit together, and more than one."""
    placed = settings(monkeypatch, "leonardo")
    serial = {
        rule: r for rule, r in placed["set-resources"].items() if r.get("slurm_partition") == "lrd_all_serial"
    }
    assert {"download_data", "download_model", "tokenize", "compress_update"} <= set(serial), serial
    for rule, resources in serial.items():
        together = resources["jobs_per_user"]
        threads = placed["set-threads"].get(rule, 1)
        assert together > 1 and resources["runtime"] <= 240, (rule, resources)
        assert together * max(resources.get("cpus_per_task", 1), threads) <= SERIAL_CAP["cores"], (
            rule,
            resources,
        )
        assert together * resources["mem_mb"] <= SERIAL_CAP["mem_mb"], (rule, resources)


def test_iris_gpu_jobs_other_than_training_avoid_the_16_gb_v100s_and_the_smoke_test_runs_in_batch(
    monkeypatch,
):
    """A 7B evaluation's fp16 weights (13.5 GB) leave no room on a 16 GB V100: every GPU job of a round asks
    for volta32. The smoke test's batch jobs stay on gpu with QOS normal: ULHPC ties the debug QOS to the
    interactive partition, for salloc sessions (docs/jobs/interactive.md)."""
    placed = settings(monkeypatch, "iris")["set-resources"]
    for rule, resources in placed.items():
        if resources.get("gres") or resources.get("slurm_partition") == "gpu":
            assert resources.get("constraint") == "volta32", (rule, resources)
    smoke = settings(monkeypatch, "iris", FEDTUNE_SMOKE="1")["set-resources"]
    for rule in ("train", "evaluate_base"):
        assert (smoke[rule]["slurm_partition"], smoke[rule]["qos"]) == ("gpu", "normal"), smoke[rule]
    for rule, resources in smoke.items():
        assert resources.get("slurm_partition") != "interactive" and resources.get("qos") != "debug", rule


# ------------------------------------------------------------------------------------------ host names

# IT4I's access page (docs.it4i.cz, general/shell-and-data-access): karolina.it4i.cz, a round robin over
# login1-4.karolina.it4i.cz. There is no login.karolina.it4i.cz.
KAROLINA_HOSTS = {"karolina.it4i.cz", *(f"login{n}.karolina.it4i.cz" for n in range(1, 5))}
# How the docs name the four at once.
KAROLINA_HOSTS_WRITTEN = KAROLINA_HOSTS | {"login1-4.karolina.it4i.cz"}
HOST_FILES = [
    *sorted((ROOT / "config" / "examples").glob("*.yaml")),
    ROOT / "README.md",
    ROOT / "docs" / "running.md",
    ROOT / "docs" / "transfers.md",
    ROOT / "docs" / "clusters.md",
    ROOT / "fedtune" / "schemas" / "config.schema.yaml",
]


def test_karolina_host_names_exist_and_agree_across_examples_readme_docs_and_schema():
    named = {}
    for path in HOST_FILES:
        for host in re.findall(r"[\w.-]*karolina\.it4i\.cz", path.read_text(encoding="utf-8")):
            named.setdefault(host, set()).add(path.relative_to(ROOT).as_posix())
    assert "login.karolina.it4i.cz" not in named, named["login.karolina.it4i.cz"]
    unknown = {host: files for host, files in named.items() if host not in KAROLINA_HOSTS_WRITTEN}
    assert not unknown, unknown
    examples = {p for files in named.values() for p in files if p.startswith("config/examples/llama2")}
    assert len(examples) == 3, named


def test_the_quick_starts_host_block_gives_its_host_name():
    """README's step 5 names the Host blocks that ssh and rsync use, with a HostName IT4I lists; the push
    key's alias is the host of the published example's push_path."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"`Host ([\w.-]+)`[^.]*?`HostName ([\w.-]+)`", readme)
    assert blocks, "README: a `Host ...` block without `HostName ...`"
    for alias, hostname in blocks:
        assert hostname in KAROLINA_HOSTS and alias in KAROLINA_HOSTS | {"karolina", "karolina-push"}, (
            alias,
            hostname,
        )
    remote = yaml.safe_load(PUBLISHED.read_text())["federation"]["remotes"]["karolina"]
    push_host = remote["push_path"].split(":")[0].split("@")[-1]
    assert push_host in {alias for alias, _ in blocks}, (push_host, blocks)


# ------------------------------------------------------------------------------------------ the dry run

PUBLISHED = ROOT / "config" / "examples" / "llama2-it-cs.yaml"


def dry_run_summary(tmp_path, cluster: str, monkeypatch, **variables: str) -> str:
    for name in SWITCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FEDTUNE_ACCOUNT", "p200001")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "config.yaml").write_text(PUBLISHED.read_text())
    result = snakemake(tmp_path, "-n", "--quiet", "rules", profile=cluster)
    return result.stderr.split("fedtune: what this run asks for", 1)[1]


def test_the_dry_run_gives_leonardos_serial_time(tmp_path, monkeypatch):
    """The published example on Leonardo: 128 tokenize jobs and the downloads on lrd_all_serial, 4 at a
    time, at most 4 h each: the summary says how long that is one batch after another."""
    summary = dry_run_summary(tmp_path, "leonardo", monkeypatch)
    line = next(line for line in summary.splitlines() if "on lrd_all_serial:" in line)
    assert "128 tokenize" in line and "it runs 4 of a user's jobs at a time: up to 130 h" in line, line


def test_the_dry_run_says_where_karolina_tokenizes_and_what_it_costs(tmp_path, monkeypatch):
    summary = dry_run_summary(tmp_path, "karolina", monkeypatch)
    assert "FEDTUNE_KAROLINA_CPU_PARTITION=qgpu (the default" in summary, summary
    assert re.search(r"on qgpu: 130 Slurm jobs \(128 tokenize, .*\(516 GPU-hours\)", summary), summary
    summary = dry_run_summary(tmp_path, "karolina", monkeypatch, FEDTUNE_KAROLINA_CPU_PARTITION="qcpu")
    assert "CPU jobs (tokenize, compress_update) on qcpu: FEDTUNE_KAROLINA_CPU_PARTITION=qcpu" in summary, (
        summary
    )
    assert "on qcpu: 16 Slurm jobs (128 tokenize), at most 64 job-hours" in summary, summary
