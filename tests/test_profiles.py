"""The cluster profiles: each dry-runs the demo (and every example config that names its cluster), and the
sbatch options the slurm executor would submit for each job carry the cluster's partition, GPUs and
nodes. The options come from the executor plugin's own builder (get_submit_command), fed
with the resources Snakemake resolved in the dry run, so profile, rules and plugin are tested together.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
import yte
from snakemake_executor_plugin_slurm.submit_string import get_submit_command
from snakemake_executor_plugin_slurm.utils import set_gres_string
from snakemake_executor_plugin_slurm.validation import validate_slurm_extra

from fedtune.core.clusters import site_clusters

from .workflow_harness import (
    ROOT,
    VENV_BIN,
    PlannedJob,
    demo_config,
    planned_jobs,
    slurm_jobs_per_round,
    snakemake,
    write_config,
)

CLUSTERS = {
    # cluster: CPU partition (tokenize), GPU partition (train, evaluate), GPUs and cores per node, the
    # launcher the test trains with, options every GPU job carries
    "leonardo": ("lrd_all_serial", "boost_usr_prod", 4, 32, "torchrun", ["--qos=normal"]),
    # Karolina tokenizes on a qgpu eighth (1 GPU + 16 cores) unless FEDTUNE_KAROLINA_CPU_PARTITION=qcpu.
    "karolina": ("qgpu", "qgpu", 8, 128, "torchrun", []),
    "iris": ("batch", "gpu", 4, 28, "srun", ["--qos=normal", "-C volta32"]),
    # MeluXina's CPU jobs take a quarter of a GPU node (1 GPU) unless FEDTUNE_MELUXINA_CPU_PARTITION=cpu.
    "meluxina": ("gpu", "gpu", 4, 64, "srun", ["--qos=default"]),
}
ACCOUNT_VARIABLES = ["FEDTUNE_ACCOUNT"] + [f"FEDTUNE_{name.upper()}_ACCOUNT" for name in site_clusters()]


DOWNLOAD_RULES = ("download_data", "download_model", "download_tasks")


def local_rules(profile: str | None = None) -> set[str]:
    """Rules that never reach sbatch (the slurm-local demo test checks that against sacct), though a dry
    run lists them like the others: `all`, those marked `localrule: True`, and the download rules unless
    the profile gives them a partition (workflow/rules/download.smk; test_download_rules_are_jobs_...)."""
    names, rule = {"all"}, None
    for path in (ROOT / "workflow" / "rules").glob("*.smk"):
        for line in path.read_text().splitlines():
            if match := re.match(r"^\s*(?:rule (\w+):|use rule \w+ as (\w+) with:)", line):
                rule = match.group(1) or match.group(2)
            elif rule and re.match(r"^\s+localrule: True", line):
                names.add(rule)
    overrides = profile_settings(profile).get("set-resources", {}) if profile else {}
    names |= {rule for rule in DOWNLOAD_RULES if "slurm_partition" not in overrides.get(rule, {})}
    return names


def sbatch_options(job: PlannedJob) -> str:
    """The sbatch command line the slurm executor would run for job (without --wrap)."""
    validate_slurm_extra(job)
    resources = job.resources
    params = {
        "run_uuid": "RUN",
        "slurm_logfile": "LOG",
        "comment_str": f"rule_{job.name}",
        "account": f" -A {shlex.quote(str(resources['slurm_account']))}"
        if "slurm_account" in resources
        else "",
        "partition": f" -p {shlex.quote(str(resources['slurm_partition']))}"
        if "slurm_partition" in resources
        else "",
        "workdir": "WORKDIR",
    }
    return get_submit_command(job, params) + set_gres_string(job)


def profile_settings(profile: str) -> dict:
    """The profile file as Snakemake reads it (a yte template)."""
    with open(ROOT / "profiles" / profile / "config.yaml") as stream:
        return yte.process_yaml(stream, require_use_yte=True)


@pytest.fixture
def account(monkeypatch):
    for variable in ACCOUNT_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("FEDTUNE_ACCOUNT", "proj123")
    return "proj123"


@pytest.fixture(scope="module")
def demo_workdir(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("profiles")
    write_config(workdir, demo_config())
    return workdir


def cluster_demo(workdir: Path, cluster: str, train: dict, **evaluate) -> None:
    """The demo with its sites on cluster and the given train (and evaluate) settings."""
    config = demo_config()
    for site in config["sites"].values():
        site["cluster"] = cluster
    config["train"].update(train)
    config["evaluate"].update(evaluate)
    write_config(workdir, config)


# With evaluate.tasks (lm-eval installed): the downstream jobs of the base model and a round-1 model.
DOWNSTREAM = importlib.util.find_spec("lm_eval") is not None
TASK_TARGETS = (
    ["results/demo/eval/tasks/base.csv", "results/demo/round-1/eval/tasks/alpha.csv"] if DOWNSTREAM else []
)


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_profile_dry_runs_the_demo_with_the_clusters_sbatch_options(cluster, account, tmp_path):
    """The demo's sites on this cluster, trained on 2 whole GPU nodes: tokenize on the CPU partition,
    train on the GPU partition with every GPU of both nodes, its tasks (one per node with torchrun,
    one per GPU with srun) and SIGUSR1 5 minutes before the time limit."""
    cpu_partition, gpu_partition, gpus, cores, launcher, gpu_extra = CLUSTERS[cluster]
    train = {
        "nodes": 2,
        "gpus_per_node": gpus,
        "processes_per_node": gpus,
        "cpus_per_process": cores // gpus,
        "launcher": launcher,
        "mem_mb": 200000,
        "runtime": 720,
        "global_batch": 8 * 2 * gpus,
    }
    tasks = {"tasks": ["fedtune_demo_alpha"]} if DOWNSTREAM else {}
    cluster_demo(tmp_path, cluster, train, **tasks)
    result = snakemake(
        tmp_path, "-n", "--forceall", "results/demo/round-1/alpha/model", *TASK_TARGETS, profile=cluster
    )
    jobs = [job for job in planned_jobs(result.stdout) if job.name not in local_rules(cluster)]
    assert {"tokenize", "train"} <= {job.name for job in jobs}, result.stdout[-3000:]
    if DOWNSTREAM:
        evaluations = {job.name for job in jobs if job.name.startswith("evaluate_tasks")}
        assert evaluations == {"evaluate_tasks_base", "evaluate_tasks_round"}, result.stdout[-3000:]
    for job in jobs:
        options = sbatch_options(job)
        assert f"-A {account}" in options, options
        assert re.search(r" -t \d+", options) and "--mem " in options, options
        if job.name == "tokenize" or job.name in DOWNLOAD_RULES:
            assert f"-p {cpu_partition}" in options, options
            gpu_eighth = cluster == "karolina" or (cluster == "meluxina" and job.name == "tokenize")
            assert ("--gres=gpu:1" in options) if gpu_eighth else ("gres" not in options), options
        else:
            assert f"-p {gpu_partition}" in options, options
        if job.name == "train":
            assert all(extra in options for extra in gpu_extra), options
            # The geometry: one task per node (torchrun) or one per GPU (srun) as tasks per node, the
            # node's GPUs; never --ntasks-per-gpu, which the job's own srun refuses (test_slurm_gpu.py).
            tasks = "--ntasks=2" if launcher == "torchrun" else f"--ntasks-per-node={gpus}"
            cpus = cores if launcher == "torchrun" else cores // gpus
            for expected in [
                "--nodes=2",
                tasks,
                f"--gres=gpu:{gpus}",
                f"--cpus-per-task={cpus}",
                "--mem 200000",
                "-t 720",
            ]:
                assert expected in options, (expected, options)
            assert "--ntasks-per-gpu" not in options, options
            # No Slurm --signal: on a one-task job it would kill the job's inner Snakemake; the launcher
            # signals the training processes itself (test_time_limit_... in test_slurm_local.py).
            assert "--signal" not in options, options
        if job.name.startswith("evaluate"):
            # One GPU; on Iris a 32 GB V100 (-C volta32): a 7B model's fp16 weights fill a 16 GB one.
            assert "--gres=gpu:1" in options, options
            assert all(extra in options for extra in gpu_extra), options


def test_slurm_local_profile_trains_one_site_on_both_nodes(tmp_path):
    train = {"nodes": 2, "processes_per_node": 1, "launcher": "srun", "mem_mb": 2000, "runtime": 20}
    cluster_demo(tmp_path, "slurm-local", train)
    result = snakemake(
        tmp_path, "-n", "--forceall", "results/demo/round-1/alpha/model", profile="slurm-local"
    )
    jobs = {
        job.name: sbatch_options(job)
        for job in planned_jobs(result.stdout)
        if job.name not in local_rules("slurm-local")
    }
    assert "-A fedtune" in jobs["tokenize"] and "-p debug" in jobs["tokenize"], jobs
    assert "--cpus-per-task=1" in jobs["tokenize"], jobs
    for expected in ["-p debug", "--nodes=2", "--ntasks=2", "--cpus-per-task=1", "-t 20"]:
        assert expected in jobs["train"], (expected, jobs["train"])
    assert "gres" not in jobs["train"] and "gpu" not in jobs["train"] and "--signal" not in jobs["train"]


def test_unset_account_variable_fails_with_a_clear_message(monkeypatch, capsys, demo_workdir):
    """One line, without Snakemake's usage text (118 lines of it before the message once)."""
    for variable in ACCOUNT_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    result = snakemake(demo_workdir, "-n", profile="leonardo", check=False, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) <= 2 and "usage:" not in result.stderr, result.stderr[-3000:]
    assert lines[-1].startswith(
        "error: no Slurm account for leonardo: set FEDTUNE_ACCOUNT (or FEDTUNE_LEONARDO_ACCOUNT)"
    ), lines
    for cluster in set(CLUSTERS) - {"iris"}:  # the same check in every profile, as Snakemake reads it
        with pytest.raises(SystemExit) as stop:
            profile_settings(cluster)
        assert stop.value.code == 2
        assert f"error: no Slurm account for {cluster}: set FEDTUNE_ACCOUNT" in capsys.readouterr().err


def test_a_clusters_own_account_variable_wins(monkeypatch):
    monkeypatch.setenv("FEDTUNE_ACCOUNT", "generic")
    monkeypatch.setenv("FEDTUNE_KAROLINA_ACCOUNT", "OPEN-29-12")
    assert profile_settings("karolina")["default-resources"]["slurm_account"] == "OPEN-29-12"
    assert profile_settings("leonardo")["default-resources"]["slurm_account"] == "generic"


def example_configs(cluster: str) -> list[Path]:
    """The example configs (config/examples/) with at least one site on this cluster."""
    examples = []
    for path in sorted((ROOT / "config" / "examples").glob("*.yaml")):
        sites = (yaml.safe_load(path.read_text()) or {}).get("sites", {})
        if any(site.get("cluster") == cluster for site in sites.values()):
            examples.append(path)
    return examples


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_profile_dry_runs_every_example_config_for_its_cluster(cluster, account, tmp_path):
    """Each example config that puts a site on this cluster: the dry run to that site's first-round model
    plans its train job on the GPU partition, with the nodes and GPUs its config asks for."""
    _, gpu_partition, _, _, _, gpu_extra = CLUSTERS[cluster]
    for example in example_configs(cluster):
        workdir = tmp_path / example.stem
        workdir.mkdir()
        (workdir / "config.yaml").write_text(example.read_text())
        config = yaml.safe_load(example.read_text())
        here = [name for name, site in config["sites"].items() if site.get("cluster") == cluster]
        run_dir = f"{config.get('results', 'results')}/{config['run']}"
        targets = [f"{run_dir}/round-1/{site}/model" for site in here]
        result = snakemake(workdir, "-n", *targets, profile=cluster, check=False, timeout=300)
        assert result.returncode == 0, f"{example.name} with profile {cluster}:\n{result.stderr[-3000:]}"
        jobs = [job for job in planned_jobs(result.stdout) if job.name not in local_rules(cluster)]
        trained = set()
        for job in jobs:
            options = sbatch_options(job)  # raises on options the plugin refuses
            if job.name != "train":
                continue
            site = job.wildcards["site"]
            trained.add(site)
            train = {**config.get("train", {}), **config["sites"][site].get("train", {})}
            gpus = train.get("gpus_per_node", 0)
            assert f"-p {gpu_partition}" in options and "--signal" not in options, options
            assert f"--nodes={train.get('nodes', 1)}" in options, options
            assert (f"--gres=gpu:{gpus}" in options) if gpus else ("gres" not in options), options
            assert all(extra in options for extra in gpu_extra), options
        assert trained == set(here), (example.name, trained, here)


def test_set_resources_name_rules_that_exist(account):
    """Snakemake ignores set-resources of a rule that does not exist: a typo would go unnoticed."""
    rules = {
        match.group(1) or match.group(2)
        for path in (ROOT / "workflow" / "rules").glob("*.smk")
        for match in re.finditer(r"^\s*(?:rule (\w+):|use rule \w+ as (\w+))", path.read_text(), re.M)
    }
    for profile in [*CLUSTERS, "slurm-local"]:
        unknown = set(profile_settings(profile).get("set-resources", {})) - rules
        assert not unknown, f"profiles/{profile} sets resources of unknown rules {unknown}"


@pytest.mark.parametrize("cluster", [*CLUSTERS, "slurm-local"])
def test_cluster_environment_file_sources_cleanly(cluster, tmp_path):
    script = ROOT / "scripts" / "clusters" / f"{cluster}.sh"
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "FEDTUNE_ACCOUNT": "p200001"}
    result = subprocess.run(
        ["bash", "-euc", f"source {shlex.quote(str(script))}; env"], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    variables = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    assert (variables.get("FEDTUNE_NO_BF16") == "1") == (cluster == "iris"), variables
    if cluster != "slurm-local":
        assert variables["HF_HOME"].startswith(variables["FEDTUNE_SCRATCH"]), variables
        assert "NCCL_DEBUG" in variables and "TORCH_EXTENSIONS_DIR" in variables, variables


def workflow_local_rules(workdir: Path, profile: str) -> set[str]:
    """The rules the workflow itself marks local when started with this profile's set-resources (the
    dry run's listing does not say), read from Snakemake's own workflow object."""
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import ConfigSettings, OutputSettings, ResourceSettings, StorageSettings

    overrides = profile_settings(profile).get("set-resources", {})
    with SnakemakeApi(OutputSettings(quiet=True)) as api:
        workflow = api.workflow(
            resource_settings=ResourceSettings(overwrite_resources=overrides),
            config_settings=ConfigSettings(configfiles=[workdir / "config.yaml"]),
            storage_settings=StorageSettings(),
            snakefile=ROOT / "Snakefile",
            workdir=workdir,
        )
        workflow.dag()
        return set(workflow._workflow._localrules)


def test_download_rules_are_jobs_only_where_the_profile_gives_them_a_partition(account, demo_workdir):
    """Leonardo's login nodes kill a process after 10 minutes of CPU time: there the downloads are jobs on
    lrd_all_serial (which reaches the internet); elsewhere they stay on the login node."""
    for profile in [*CLUSTERS, "slurm-local"]:
        local = workflow_local_rules(demo_workdir, profile)
        assert {"tokenize_manifest", "report"} <= local, (profile, local)
        assert (set(DOWNLOAD_RULES) <= local) == (profile != "leonardo"), (profile, local)
        assert (set(DOWNLOAD_RULES) & local) == (set(DOWNLOAD_RULES) & local_rules(profile)), profile
    download = profile_settings("leonardo")["set-resources"]["download_model"]
    assert download["slurm_partition"] == "lrd_all_serial" and download["cpus_per_task"] <= 4, download


def test_iris_needs_no_account(monkeypatch, tmp_path):
    """Every ULHPC user has a default account: without FEDTUNE_ACCOUNT the Iris jobs go without -A."""
    for variable in ACCOUNT_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    assert "slurm_account" not in profile_settings("iris")["default-resources"]
    cluster_demo(
        tmp_path, "iris", {"gpus_per_node": 4, "processes_per_node": 4, "launcher": "srun", "micro_batch": 4}
    )
    result = snakemake(tmp_path, "-n", "--forceall", "results/demo/round-1/alpha/model", profile="iris")
    jobs = [job for job in planned_jobs(result.stdout) if job.name not in local_rules("iris")]
    assert jobs and all("slurm_account" not in job.resources for job in jobs), result.stdout[-2000:]
    train = next(sbatch_options(job) for job in jobs if job.name == "train")
    assert " -A " not in train and "-C volta32" in train and "-p gpu" in train, train
    monkeypatch.setenv("FEDTUNE_IRIS_ACCOUNT", "p-lux")
    assert profile_settings("iris")["default-resources"]["slurm_account"] == "p-lux"


def test_karolina_runs_tokenize_jobs_eight_to_a_node(account, tmp_path, monkeypatch):
    """qcpu (FEDTUNE_KAROLINA_CPU_PARTITION=qcpu) charges whole 128-core nodes: the llama2-it-cs example's
    2 x 64 tokenize jobs of Karolina's site run as 16 group jobs of 8 (16 cores each); other profiles keep
    one job per shard."""
    monkeypatch.setenv("FEDTUNE_KAROLINA_CPU_PARTITION", "qcpu")
    example = ROOT / "config" / "examples" / "llama2-it-cs.yaml"
    (tmp_path / "config.yaml").write_text(example.read_text())
    groups = {}
    for profile in ("karolina", "leonardo"):
        output = snakemake(tmp_path, "-n", profile=profile, timeout=300).stdout
        sizes, current = [], None
        for line in output.splitlines():
            if "Group job tokenize" in line:
                current = 0
                sizes.append(current)
            elif current is not None and re.match(r"^\s+rule tokenize:$", line):
                sizes[-1] += 1
            elif re.match(r"^(?:local)?rule \w+:$|^Job stats", line):  # a job outside any group
                current = None
        groups[profile] = sizes
    assert groups["karolina"] == [8] * 16, groups["karolina"]
    assert groups["leonardo"] == [], groups["leonardo"]
    settings = profile_settings("karolina")
    assert settings["groups"] == {"tokenize": "tokenize"}
    assert settings["group-components"] == {"tokenize": 8, "round-{round}": 1000}
    assert settings["set-threads"]["tokenize"] * 8 == 128


def test_apptainer_deployment_trains_inside_the_image(monkeypatch, tmp_path):
    """With --software-deployment-method apptainer every rule but train runs in the image; train's
    launcher is told to run each training process in it (scripts/launch --container)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "apptainer").write_text('#!/bin/sh\necho "apptainer version 1.3.4"\n')
    (fake / "apptainer").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    monkeypatch.setenv("FEDTUNE_CONTAINER", "/images/fedtune.sif")
    cluster_demo(tmp_path, "local", {})
    for method in ("apptainer", None):
        extra = ["--software-deployment-method", method] if method else []
        result = snakemake(tmp_path, "-n", "-p", "--forceall", "results/demo/round-1/alpha/model", *extra)
        (launch,) = [line for line in result.stdout.splitlines() if "$FEDTUNE_LAUNCH" in line]
        in_image = "--container /images/fedtune.sif -- python -m fedtune.train" in launch
        assert in_image == (method == "apptainer"), launch


def source_cluster_file(cluster: str, home: Path, **variables: str) -> subprocess.CompletedProcess:
    script = ROOT / "scripts" / "clusters" / f"{cluster}.sh"
    env = {"PATH": os.environ["PATH"], "HOME": str(home), **variables}
    return subprocess.run(
        ["bash", "-euc", f"source {shlex.quote(str(script))}; echo $FEDTUNE_SCRATCH"],
        env=env, capture_output=True, text=True,
    )  # fmt: skip


@pytest.mark.parametrize(
    "cluster, template",
    [("karolina", "/scratch/project/{}/fedtune"), ("meluxina", "/project/scratch/{}/fedtune")],
)
def test_project_scratch_uses_the_profiles_account(cluster, template, tmp_path):
    """The scratch path takes the account the profile used (FEDTUNE_<CLUSTER>_ACCOUNT first), then Slurm's
    (which the mpi job path clears); with none, sourcing stops with a message instead of using
    /scratch/project//fedtune. Karolina's project folders are lower case."""
    specific = f"FEDTUNE_{cluster.upper()}_ACCOUNT"
    expect = {
        (("FEDTUNE_ACCOUNT", "P200001"), (specific, "OPEN-29-12")): "OPEN-29-12",
        (("FEDTUNE_ACCOUNT", "p200001"), ("SLURM_JOB_ACCOUNT", "other")): "p200001",
        (("SLURM_JOB_ACCOUNT", "p200002"),): "p200002",
    }
    for variables, account in expect.items():
        result = source_cluster_file(cluster, tmp_path, **dict(variables))
        assert result.returncode == 0, result.stderr
        wanted = template.format(account.lower() if cluster == "karolina" else account)
        assert result.stdout.strip() == wanted, (variables, result.stdout)
    result = source_cluster_file(cluster, tmp_path)
    assert result.returncode != 0 and result.stdout.strip() == "", result.stdout
    assert f"export FEDTUNE_ACCOUNT (or {specific})" in result.stderr, result.stderr
    own = source_cluster_file(cluster, tmp_path, FEDTUNE_SCRATCH="/fast/me")
    assert own.returncode == 0 and own.stdout.strip() == "/fast/me", own.stderr


@pytest.mark.parametrize("cluster", [*CLUSTERS, "slurm-local"])
def test_cluster_file_sets_the_time_limit_lead_and_container_gpu(cluster, tmp_path):
    script = ROOT / "scripts" / "clusters" / f"{cluster}.sh"
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "FEDTUNE_ACCOUNT": "p200001"}
    result = subprocess.run(
        ["bash", "-euc", f"source {shlex.quote(str(script))}; echo $FEDTUNE_SIGNAL_BEFORE $FEDTUNE_CONTAINER_GPU"],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == (["60", "none"] if cluster == "slurm-local" else ["300", "nv"])


# Karolina's partitions that allocate (and charge) whole 128-core nodes (docs.it4i.cz,
# resources-allocation-policy): qcpu and its variants but the express queue.
WHOLE_NODE_PARTITIONS = {"qcpu", "qcpu_biz", "qcpu_free", "qcpu_long", "qcpu_preempt"}


def test_karolina_charges_no_whole_node_for_a_small_job(account, tmp_path):
    """Every Karolina job that needs at most 16 cores either shares a node job with others (the tokenize
    group) or runs where nodes are allocated by part (qgpu eighths): never alone on a whole qcpu node.
    Every job of the demo with compared merge methods and of demo-lora, planned by a dry run."""
    configs = {
        "demo": demo_config(),
        "lora": yaml.safe_load((ROOT / "config/examples/demo-lora.yaml").read_text()),
    }
    for site in configs["lora"]["sites"].values():
        files = site["dataset"]["data_files"]
        files.update({split: str(ROOT / path) for split, path in files.items()})
    configs["demo"]["aggregate"]["compare"] = ["ties"]
    configs["demo"]["federation"] = {**configs["demo"].get("federation", {}), "pooled_baseline": True}
    seen = set()
    for name, config in configs.items():
        workdir = tmp_path / name
        workdir.mkdir()
        for site in config["sites"].values():
            site["cluster"] = "karolina"
        write_config(workdir, config)
        result = snakemake(workdir, "-n", "--forceall", profile="karolina", timeout=300)
        groups = profile_settings("karolina").get("groups", {})
        for job in planned_jobs(result.stdout):
            if job.name in local_rules("karolina") or job.name in groups:
                continue
            options = sbatch_options(job)
            cpus = int(job.resources.get("cpus_per_task", 1)) * int(job.resources.get("tasks", 1) or 1)
            partition = re.search(r" -p (\S+)", options).group(1)
            seen.add(job.name)
            if cpus <= 16:
                assert partition not in WHOLE_NODE_PARTITIONS, (name, job.name, options)
    assert {"aggregate", "aggregate_compare", "aggregate_adapters", "merge_adapter"} <= seen, seen
    small = profile_settings("karolina")["set-resources"]["aggregate"]
    assert small["slurm_partition"] == "qgpu" and small["gres"] == "gpu:1" and small["cpus_per_task"] <= 16


def test_jobs_other_than_training_keep_their_caches_on_the_clusters_scratch(tmp_path):
    """download_data run for cluster leonardo (its profile's `cluster`, on this machine): the datasets
    cache lands under $SCRATCH/fedtune/hf-home (scripts/clusters/leonardo.sh, sourced by every job's
    shell), none under $HOME."""
    config = demo_config()
    for site in config["sites"].values():
        site["cluster"] = "leonardo"
    write_config(tmp_path, config)
    home, scratch = tmp_path / "home", tmp_path / "scratch"
    home.mkdir()
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "FEDTUNE_", "TORCH_EXTENSIONS"))}
    env.update(HOME=str(home), SCRATCH=str(scratch), PATH=f"{VENV_BIN}:{env['PATH']}")
    result = subprocess.run(
        [
            f"{VENV_BIN}/snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory", str(tmp_path),
            "--configfile", str(tmp_path / "config.yaml"), "--profile", str(ROOT / "profiles" / "local"),
            "--config", "cluster=leonardo", "--cores", "1", "results/demo/data/alpha/raw",
        ],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert (scratch / "fedtune" / "hf-home" / "datasets").is_dir(), list(scratch.rglob("*"))[:20]
    assert not (home / ".cache" / "huggingface").exists(), list(home.rglob("*"))[:20]


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_a_round_costs_one_training_per_site_and_one_merge_and_evaluate_job(cluster, account, tmp_path):
    """Each cluster profile joins a round's merges and evaluations (the group round-<r>) into one Slurm
    job, whose parts ask for the same partition and GPU; the dry run prints the count."""
    cpu_partition, gpu_partition, gpus, cores, launcher, gpu_extra = CLUSTERS[cluster]
    cluster_demo(tmp_path, cluster, {"gpus_per_node": 1, "processes_per_node": 1}, intermediate="all")
    config = yaml.safe_load((tmp_path / "config.yaml").read_text())
    config["federation"] = {"rounds": 2}
    config["aggregate"] = {"compare": ["ties"]}
    write_config(tmp_path, config)
    result = snakemake(tmp_path, "-n", profile=cluster, timeout=300)
    assert slurm_jobs_per_round(result.stdout) == {1: 3, 2: 3}
    assert f"fedtune: Slurm jobs per round on {cluster}: 3, 3 " in result.stderr
    grouped = [job for job in planned_jobs(result.stdout) if job.name in ("aggregate", "evaluate_round")]
    assert {job.resources.get("slurm_partition") for job in grouped} == {gpu_partition}
