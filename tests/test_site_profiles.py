"""What a site's admin and a first-time user would trip on (issue 36, part 2), checked where a dry run, the
profile as Snakemake reads it, or the cluster's environment file can show it: multi-node GPU jobs run
exclusive; the cluster files carry the runtime settings and say when they cannot load modules; the smoke
test goes to each site's debug queue; the run folder is on scratch with the purge warning; Karolina's
tokenize partition is a setting; tokenize reserves the cores it uses; evaluation memory follows the
model's size; the torch build suits the A100 sites' drivers."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from fedtune.aggregate.adapter_size import (
    FIXED_MB,
    evaluation_mem_mb,
    load_mem_mb,
    model_parameters,
    weights_mem_mb,
)
from fedtune.core.clusters import site_clusters
from fedtune.core.smoke import SMOKE_DOCUMENTS
from fedtune.run.config import build_run_config
from fedtune.train.options import TrainOptions

from .test_profiles import ACCOUNT_VARIABLES, cluster_demo, local_rules, profile_settings, sbatch_options
from .workflow_harness import ROOT, demo_config, planned_jobs, snakemake, write_config

# cluster: (GPUs per node, launcher, the smoke test's partition and QOS for training)
SITES = {
    "leonardo": (4, "torchrun", "boost_usr_prod", "boost_qos_dbg"),
    "karolina": (8, "srun", "qgpu_exp", None),
    "meluxina": (4, "srun", "gpu", "test"),
    # ULHPC ties the debug QOS to the interactive partition, for salloc: the smoke test stays in batch.
    "iris": (4, "srun", "gpu", "normal"),
}
# Nodes per site in the smoke test: Karolina's express queue with one node, as the published run there.
SMOKE_NODES = {"leonardo": 2, "karolina": 1, "meluxina": 2, "iris": 2}
# Leonardo: one core per job, four side by side under lrd_all_serial's per-user cap of 4 cores.
TOKENIZE_CORES = {"leonardo": 1, "karolina": 16, "meluxina": 16, "iris": 7}


def clean_environment(monkeypatch, **variables: str) -> None:
    """No account, scratch, smoke or partition setting from the caller's shell; then `variables`."""
    for name in [
        *ACCOUNT_VARIABLES,
        "FEDTUNE_SMOKE",
        "FEDTUNE_SCRATCH",
        "SCRATCH",
        "CINECA_SCRATCH",
        "FEDTUNE_KAROLINA_CPU_PARTITION",
    ]:
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def with_account(monkeypatch):
    """What the profiles need to be read (tests/test_profiles.py's helpers read them)."""
    clean_environment(monkeypatch, FEDTUNE_ACCOUNT="p200001")


# 1. Multi-node GPU jobs run exclusive.


def test_only_a_gpu_training_over_several_nodes_asks_for_whole_nodes():
    def options(**train):
        return TrainOptions.from_mapping({"micro_batch": 1, "global_batch": 64, **train})

    assert options(nodes=2, gpus_per_node=4, processes_per_node=4).slurm_extra == "--exclusive"
    assert options(nodes=1, gpus_per_node=4, processes_per_node=4).slurm_extra is None
    assert options(nodes=2, gpus_per_node=0, processes_per_node=1).slurm_extra is None


# The cluster files (scripts/clusters/<cluster>.sh): runtime settings, modules said out loud.


def source(cluster: str, tmp_path: Path, before: str = "", **variables: str) -> subprocess.CompletedProcess:
    """Source the cluster's file in a fresh bash (after `before`), then print its environment and limits."""
    script = ROOT / "scripts" / "clusters" / f"{cluster}.sh"
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "FEDTUNE_ACCOUNT": "p200001", **variables}
    command = (
        f"{before}\nsource {shlex.quote(str(script))}\necho NOFILE=$(ulimit -Sn) HARD=$(ulimit -Hn)\nenv"
    )
    return subprocess.run(["bash", "-euc", command], env=env, capture_output=True, text=True)


def variables_of(result: subprocess.CompletedProcess) -> dict[str, str]:
    lines = result.stdout.splitlines()
    limits = dict(item.split("=") for item in lines[0].split())
    return {**limits, **dict(line.split("=", 1) for line in lines[1:] if "=" in line)}


@pytest.mark.parametrize("cluster", SITES)
def test_cluster_file_sets_the_runtime_settings(cluster, tmp_path):
    """Unbuffered Python, NCCL on InfiniBand, the open-files limit raised from a low soft limit (to 131072
    or the hard limit), Slurm's own CUDA_VISIBLE_DEVICES kept."""
    result = source(cluster, tmp_path, "ulimit -Sn 256", CUDA_VISIBLE_DEVICES="2,3")
    assert result.returncode == 0, result.stderr
    env = variables_of(result)
    assert env["PYTHONUNBUFFERED"] == "1" and env["NCCL_IB_DISABLE"] == "0", env
    hard = env["HARD"]
    assert env["NOFILE"] == ("131072" if hard == "unlimited" or int(hard) >= 131072 else hard), env
    assert int(env["NOFILE"]) > 256, env
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3", env
    if cluster == "leonardo":  # as published multi-node runs on the Booster set them
        assert env["NCCL_NET_GDR_LEVEL"] == "2" and env["NCCL_P2P_LEVEL"] == "SYS", env


@pytest.mark.parametrize("value", ["", "NoDevFiles"])
def test_a_cuda_visible_devices_that_names_no_gpu_is_dropped(value, tmp_path):
    result = source("leonardo", tmp_path, CUDA_VISIBLE_DEVICES=value)
    assert result.returncode == 0, result.stderr
    assert "CUDA_VISIBLE_DEVICES" not in variables_of(result)
    assert "names no GPU: unset" in result.stderr, result.stderr


def test_modules_are_loaded_or_their_absence_said_out_loud(tmp_path):
    """FEDTUNE_MODULES with no `module` command: a warning on stderr, the rest of the file still applies.
    With one: it is called with the modules; when it fails, sourcing fails with the reason."""
    missing = source("leonardo", tmp_path, FEDTUNE_MODULES="cuda/12.2")
    assert missing.returncode == 0, missing.stderr
    assert 'FEDTUNE_MODULES="cuda/12.2" but this shell has no `module` command' in missing.stderr
    assert "modules are NOT loaded" in missing.stderr and "HF_HOME" in variables_of(missing)

    log = tmp_path / "module.log"
    works = f'module() {{ echo "$@" >> {log}; }}'
    loaded = source("karolina", tmp_path, works, FEDTUNE_MODULES="CUDA/12.1.1 NCCL")
    assert loaded.returncode == 0, loaded.stderr
    assert log.read_text().split() == ["load", "CUDA/12.1.1", "NCCL"]
    assert "warning" not in loaded.stderr, loaded.stderr

    failing = source("meluxina", tmp_path, "module() { return 1; }", FEDTUNE_MODULES="Nope/1.0")
    assert failing.returncode != 0
    assert "`module load Nope/1.0` failed: fix FEDTUNE_MODULES" in failing.stderr, failing.stderr


def test_the_module_init_script_is_sourced_when_the_shell_lacks_module(tmp_path):
    """A batch shell without the `module` function gets it from $MODULESHOME/init/bash (Lmod's and
    Environment Modules' layout), as a login shell would."""
    home = tmp_path / "modules"
    (home / "init").mkdir(parents=True)
    log = tmp_path / "module.log"
    (home / "init" / "bash").write_text(f'module() {{ echo "$@" >> {log}; }}\n')
    result = source("iris", tmp_path, FEDTUNE_MODULES="system/CUDA", MODULESHOME=str(home))
    assert result.returncode == 0, result.stderr
    assert log.read_text().split() == ["load", "system/CUDA"], result.stderr


# 2., 3., 5. and 1. seen in one dry run per cluster: the smoke test's jobs, with the run folder on scratch.


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    """Per cluster: the demo (its sites on that cluster, each trained on 3 whole nodes) dry-run with
    FEDTUNE_SMOKE=1 and FEDTUNE_SCRATCH set; (jobs, stderr, scratch folder)."""
    runs = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        for cluster, (gpus, launcher, *_) in SITES.items():
            workdir = tmp_path_factory.mktemp(f"smoke-{cluster}")
            scratch = workdir / "scratch" / "fedtune"
            clean_environment(monkeypatch, FEDTUNE_ACCOUNT="p200001", FEDTUNE_SMOKE="1",
                              FEDTUNE_SCRATCH=str(scratch))  # fmt: skip
            train = {"nodes": 3, "gpus_per_node": gpus, "processes_per_node": gpus, "launcher": launcher,
                     "cpus_per_process": 2, "runtime": 1440, "micro_batch": 1, "global_batch": 48 * gpus}  # fmt: skip
            cluster_demo(workdir, cluster, train)
            # --cores: a dry run caps every job's threads at --cores, 1 unless given; a real run with a
            # cluster profile leaves them uncapped (and the job's own Snakemake gets --cores all).
            result = snakemake(workdir, "-n", "--cores", "256", profile=cluster, timeout=300)
            runs[cluster] = (planned_jobs(result.stdout), result.stderr, scratch)
    return runs


@pytest.mark.parametrize("cluster", SITES)
def test_smoke_test_trains_two_nodes_for_ten_minutes_on_the_debug_queue(cluster, smoke_runs, with_account):
    """FEDTUNE_SMOKE=1: each site's training, and nothing after it, goes to the site's debug queue on 2
    whole nodes (Karolina: 1 node on qgpu_exp; Iris: gpu, whose debug QOS is for salloc only) with a
    10-minute limit and 10 steps, into its own run folder <run>-smoke."""
    jobs, _, scratch = smoke_runs[cluster]
    gpus, launcher, partition, qos = SITES[cluster]
    jobs = [job for job in jobs if job.name not in local_rules(cluster)]
    names = {job.name for job in jobs}
    assert "train" in names and not names & {"aggregate", "evaluate_base", "evaluate_round"}, names
    trains = [job for job in jobs if job.name == "train"]
    assert {job.wildcards["site"] for job in trains} == {"alpha", "beta"}
    for job in trains:
        options = sbatch_options(job)
        nodes = SMOKE_NODES[cluster]
        assert f"-p {partition}" in options and "-t 10" in options and f"--nodes={nodes}" in options, options
        assert (f"--qos={qos}" in options) if qos else ("--qos" not in options), options
        # --exclusive for several nodes; one node of 8 GPUs is the whole node anyway.
        assert ("--exclusive" in options) == (nodes > 1) and f"--gres=gpu:{gpus}" in options, options
        assert '"max_steps":10' in job.shell and f"--nodes {nodes}" in job.shell, job.shell
        assert f"{scratch}/results/demo-smoke/round-1/" in job.shell, job.shell
    tokenize = [job for job in jobs if job.name == "tokenize"]
    assert len(tokenize) == 4, [job.wildcards for job in tokenize]  # one shard per site and split


def test_smoke_config_caps_each_site_and_keeps_the_real_runs_folder_apart():
    config = demo_config(smoke=True)
    config["sites"]["alpha"]["dataset"]["max_documents"] = 50
    config["federation"] = {"rounds": 3, "pooled_baseline": True}
    run = build_run_config(config)
    assert run.run == "demo-smoke" and run.rounds == 1 and run.pooled is None
    assert {site.train.nodes for site in run.sites.values()} == {2}
    assert {(site.train.runtime, site.train.max_steps) for site in run.sites.values()} == {(10, 10)}
    assert run.sites["alpha"].dataset.max_documents == 50
    assert run.sites["beta"].dataset.max_documents == SMOKE_DOCUMENTS
    assert build_run_config(run.raw).run == "demo-smoke"  # not made smaller twice


@pytest.mark.parametrize("cluster", SITES)
def test_tokenize_uses_the_cores_its_job_reserves(cluster, smoke_runs, with_account):
    """The rule's threads (its --num-proc) are the job's --cpus-per-task, from the profile's set-threads."""
    jobs, _, _ = smoke_runs[cluster]
    cores = TOKENIZE_CORES[cluster]
    assert profile_settings(cluster)["set-threads"]["tokenize"] == cores
    for job in (job for job in jobs if job.name == "tokenize"):
        assert job.threads == cores and f"--num-proc {cores} " in job.shell, (job.threads, job.shell)
        assert f"--cpus-per-task={cores}" in sbatch_options(job), sbatch_options(job)


@pytest.mark.parametrize("cluster", SITES)
def test_run_folder_is_on_scratch_with_the_purge_rule_and_the_copy_command(cluster, smoke_runs):
    jobs, stderr, scratch = smoke_runs[cluster]
    run_dir = f"{scratch}/results/demo-smoke"
    outputs = [job for job in jobs if job.name in ("tokenize", "train")]
    assert outputs and all(run_dir in job.shell for job in outputs), [job.shell for job in outputs]
    (line,) = [line for line in stderr.splitlines() if "is on" in line and "scratch" in line]
    assert f"the run folder {run_dir} is on {cluster}'s scratch" in line, line
    assert "rsync -a --relative" in line and f"{run_dir}/./round-1/alpha/model" in line, line
    if cluster == "leonardo":
        assert "files older than 40 days are deleted" in line and "$WORK/fedtune/demo-smoke/" in line, line


def test_scratch_folder_follows_each_sites_variables(monkeypatch):
    """Without FEDTUNE_SCRATCH: Leonardo's $SCRATCH (older $CINECA_SCRATCH), Iris's $SCRATCH, Karolina's
    and MeluXina's project scratch named by the account where it exists; no scratch known: `results` as
    configured."""
    clean_environment(monkeypatch, FEDTUNE_ACCOUNT="OPEN-29-12", CINECA_SCRATCH="/leonardo_scratch/u1")
    assert profile_settings("leonardo")["config"]["scratch_results"] == "/leonardo_scratch/u1/fedtune/results"
    assert "scratch_results" not in profile_settings("iris")["config"]
    monkeypatch.setenv("SCRATCH", "/scratch/users/me")
    assert profile_settings("iris")["config"]["scratch_results"] == "/scratch/users/me/fedtune/results"
    # Karolina's and MeluXina's project scratch where it exists (on the sites), not on this machine.
    assert "scratch_results" not in profile_settings("karolina")["config"]
    assert "scratch_results" not in profile_settings("meluxina")["config"]
    real_isdir = os.path.isdir
    sites = {"/scratch/project/open-29-12", "/project/scratch/OPEN-29-12"}
    monkeypatch.setattr(os.path, "isdir", lambda path: path in sites or real_isdir(path))
    karolina = profile_settings("karolina")["config"]
    assert karolina["scratch_results"] == "/scratch/project/open-29-12/fedtune/results"
    assert karolina["scratch_keep"] == "$(it4i-get-project-dir OPEN-29-12)/fedtune"
    assert (
        profile_settings("meluxina")["config"]["scratch_results"]
        == "/project/scratch/OPEN-29-12/fedtune/results"
    )


def test_a_configs_own_results_folder_wins_over_the_scratch_default():
    own = build_run_config(demo_config(results="/work/mine", scratch_results="/scratch/x/results"))
    assert str(own.run_dir) == "/work/mine/demo"
    default = build_run_config(demo_config(scratch_results="/scratch/x/results"))
    assert str(default.run_dir) == "/scratch/x/results/demo"
    assert str(build_run_config(demo_config()).run_dir) == "results/demo"


# 4. Karolina's tokenize partition.


def test_karolina_tokenizes_on_a_gpu_eighth_unless_told_qcpu(monkeypatch, smoke_runs):
    """Default (a GPU-only project): each tokenize job on qgpu with one GPU and 16 cores, no whole-node
    group; FEDTUNE_KAROLINA_CPU_PARTITION=qcpu brings back eight jobs to a qcpu node; anything else is
    refused by name."""
    jobs, _, _ = smoke_runs["karolina"]
    for job in (job for job in jobs if job.name == "tokenize"):
        options = sbatch_options(job)
        assert "-p qgpu" in options and "--gres=gpu:1" in options and "--cpus-per-task=16" in options, options
    clean_environment(monkeypatch, FEDTUNE_ACCOUNT="OPEN-29-12")
    default = profile_settings("karolina")
    assert "groups" not in default and "tokenize" not in default["group-components"]
    monkeypatch.setenv("FEDTUNE_KAROLINA_CPU_PARTITION", "qcpu")
    qcpu = profile_settings("karolina")
    assert qcpu["groups"] == {"tokenize": "tokenize"} and qcpu["group-components"]["tokenize"] == 8
    assert qcpu["set-resources"]["tokenize"]["slurm_partition"] == "qcpu"
    assert "gres" not in qcpu["set-resources"]["tokenize"]
    monkeypatch.setenv("FEDTUNE_KAROLINA_CPU_PARTITION", "qfat")
    with pytest.raises(Exception, match="FEDTUNE_KAROLINA_CPU_PARTITION=qfat: use qgpu"):
        profile_settings("karolina")


# 6. Evaluation memory from the model's size.

LLAMA2_7B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000, "tie_word_embeddings": False,
    "torch_dtype": "float16",
}  # fmt: skip


def test_evaluation_memory_of_a_7b_model_holds_its_weights():
    """Llama-2-7B: 6.74e9 parameters, 13.5 GB in bf16 (more than the old fixed 16000 MB once loaded with
    the process around it), twice that in float32."""
    assert model_parameters(LLAMA2_7B) == 6_738_415_616
    bf16 = evaluation_mem_mb(LLAMA2_7B, "bfloat16")
    assert bf16 == load_mem_mb(2 * 6_738_415_616) and bf16 > 16000
    assert bf16 * 2**20 > 1.25 * 13.4e9
    assert abs(evaluation_mem_mb(LLAMA2_7B, "float32") - FIXED_MB - 2 * (bf16 - FIXED_MB)) <= 1


def test_a_layout_the_formula_does_not_know_is_sized_from_its_files(tmp_path):
    """OPT, DistilBERT, ...: the downloaded safetensors' bytes, scaled from their stored dtype to the
    evaluation's; nothing downloaded yet: None (the rule then asks for 16000 MB)."""
    assert weights_mem_mb(tmp_path, "bfloat16", {"torch_dtype": "float32"}) is None
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 3_000_000)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"\0" * 1_000_000)
    assert weights_mem_mb(tmp_path, "bfloat16", {"torch_dtype": "float32"}) == load_mem_mb(2_000_000)
    assert weights_mem_mb(tmp_path, None, {"dtype": "float32"}) == load_mem_mb(4_000_000)


def test_evaluation_jobs_ask_for_the_memory_of_their_model(tmp_path):
    """The dry run plans the evaluations with the model's size, here known from model.architecture: the
    demo's tiny model asks little; the same config with Llama-2-7B's shapes (trained from scratch, bf16)
    asks for its weights."""
    sizes = {}
    for name, architecture in {"tiny": None, "7b": LLAMA2_7B}.items():
        workdir = tmp_path / name
        workdir.mkdir()
        config = demo_config()
        if architecture:
            shape = {k: v for k, v in architecture.items() if k not in ("vocab_size", "torch_dtype")}
            config["model"].update(architecture=shape, dtype="bfloat16")
        write_config(workdir, config)
        result = snakemake(workdir, "-n", "--forceall", "results/demo/eval/base/alpha.json")
        (job,) = [job for job in planned_jobs(result.stdout) if job.name == "evaluate_base"]
        sizes[name] = job.resources["mem_mb"]
    assert FIXED_MB < sizes["tiny"] < FIXED_MB + 10, sizes
    tokenizer_vocab = 1024  # model.tokenizer.vocab_size of the demo
    shape = {**LLAMA2_7B, "vocab_size": tokenizer_vocab}
    assert sizes["7b"] == evaluation_mem_mb(shape, "bfloat16") > 16000, sizes


# 7. The torch build of the A100 sites.


@pytest.mark.parametrize("cluster", site_clusters())
def test_every_gpu_site_gets_the_cuda_12_build(cluster):
    """CUDA 12.6 wheels run on drivers >= 525.60.13 (CUDA 12 minor-version compatibility), CUDA 13 ones
    need >= 580, which no site publishes: all four sites get the 12.6 build (sm_70 to sm_90)."""
    result = subprocess.run(
        [str(ROOT / "scripts" / "setup-env"), "--print-torch"],
        env={**os.environ, "FEDTUNE_CLUSTER": cluster}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["torch==2.13.0", "--index-url", "https://download.pytorch.org/whl/cu126"]


@pytest.mark.parametrize(
    ("cluster", "driver", "ok"),
    [("leonardo", "535.104.05", True), ("leonardo", "470.57.02", False), ("local", "570.86.10", False),
     ("local", "580.65.06", True)],
)  # fmt: skip
def test_setup_env_checks_this_nodes_driver_against_the_build(cluster, driver, ok, tmp_path):
    """Where nvidia-smi answers (a GPU node, or a login node with GPUs), `setup-env --check-driver` says
    whether the build runs on its driver and, when not, what to do."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\necho {driver}\n")
    fake.chmod(0o755)
    result = subprocess.run(
        [str(ROOT / "scripts" / "setup-env"), "--check-driver"],
        env={**os.environ, "FEDTUNE_CLUSTER": cluster, "PATH": f"{tmp_path}:{os.environ['PATH']}"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (result.returncode == 0) == ok, result.stderr
    if not ok:
        assert f"driver {driver}" in result.stderr and "FEDTUNE_TORCH_INDEX" in result.stderr, result.stderr
    else:
        assert re.search(rf"driver {re.escape(driver)} runs the .* build", result.stderr), result.stderr
