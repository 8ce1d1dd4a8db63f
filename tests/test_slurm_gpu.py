"""The GPU training job as each cluster profile submits it (issue 36).

A site's training job is a multi-node GPU job whose shell, scripts/launch, starts the ranks with its own
`srun`. Slurm refuses some task geometries only at that inner srun, after the job has waited in the
queue: a job submitted with --ntasks-per-gpu has SLURM_NTASKS_PER_GPU in its batch step, and srun then
refuses --ntasks-per-node (Slurm 22.05, seen on slurm-local) and, from 23.11 on, with --cpus-per-task,
stops at once ("SLURM_TRES_PER_TASK is mutually exclusive with --ntasks-per-gpu and
SLURM_NTASKS_PER_GPU"; snakemake-executor-plugin-slurm issues 342 and 373, Slurm 24.05).

- Without a cluster: the llama2 example's training job on each of the four cluster profiles, both
  launchers, its sbatch options built by the executor plugin's own code from the dry run, checked
  against those rules; and scripts/launch started with the batch step's environment that Slurm 23.11+
  gives those options, under a stand-in srun that applies srun's checks.
- On the local cluster with stand-in GPUs (scripts/slurm-local declares gpu:8 per node): each profile's
  geometry scaled to two nodes, submitted by Snakemake's slurm executor, reaches the training command
  on every rank with the rank, local rank, world size and GPUs that real GPUs would give.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from .slurm_harness import VENV_BIN, running_cluster
from .test_profiles import sbatch_options
from .workflow_harness import ROOT, demo_config, planned_jobs, snakemake, write_config

pytestmark = pytest.mark.slurm

LAUNCH = ROOT / "scripts" / "launch"
EXAMPLE = ROOT / "config" / "examples" / "llama2-it-cs.yaml"
# Each cluster profile: the example's site that trains there, and, for a cluster the example does not
# name, that site's node geometry there (the "Train config for whole nodes" line of the profile).
PROFILES = {
    "leonardo": ("it", {}),
    "karolina": ("cs", {}),
    "iris": ("it", {"gpus_per_node": 4, "processes_per_node": 4, "cpus_per_process": 7}),
    "meluxina": ("it", {"gpus_per_node": 4, "processes_per_node": 4, "cpus_per_process": 16}),
}
LAUNCHERS = ("srun", "torchrun")

# srun's checks of a step's task geometry against what it inherits (Slurm's src/common/slurm_opt.c);
# the 22.05 one was seen on slurm-local, the 23.11+ one is in the plugin's issues 342 and 373.
STAND_IN_SRUN = r"""#!/usr/bin/env bash
env > "$SRUN_RECORD.env"
printf '%s\n' "$@" > "$SRUN_RECORD.args"
per_gpu=${SLURM_NTASKS_PER_GPU:-}
[[ " $* " == *" --ntasks-per-gpu"* ]] && per_gpu=yes
if [[ -n $per_gpu && -n ${SLURM_TRES_PER_TASK:-} ]]; then
    echo "srun: fatal: SLURM_TRES_PER_TASK is mutually exclusive with --ntasks-per-gpu and SLURM_NTASKS_PER_GPU" >&2
    exit 1
fi
if [[ -n $per_gpu && " $* " == *" --ntasks-per-node "* ]]; then
    echo "srun: fatal: --ntasks-per-node is mutually exclusive with --ntasks-per-gpu and SLURM_NTASKS_PER_GPU" >&2
    exit 1
fi
"""


def batch_step_environment(options: str) -> dict[str, str]:
    """The task-geometry variables Slurm 23.11+ puts into the batch step of a job submitted with these
    sbatch options (sbatch(1), "OUTPUT ENVIRONMENT VARIABLES": --cpus-per-task also sets
    SLURM_TRES_PER_TASK from 23.11 on). The executor's job step (jobstep plugin 0.6) clears SLURM_*
    before the rule's shell; older versions, and a job submitted by hand, hand them on as they are."""
    environment = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "n[1-4]"}
    for option, variable in (
        ("--ntasks-per-gpu", "SLURM_NTASKS_PER_GPU"),
        ("--ntasks-per-node", "SLURM_NTASKS_PER_NODE"),
        ("--ntasks", "SLURM_NTASKS"),
        ("--cpus-per-task", "SLURM_CPUS_PER_TASK"),
    ):
        if match := re.search(rf"{option}=(\d+)", options):
            environment[variable] = match.group(1)
    if "SLURM_CPUS_PER_TASK" in environment:
        environment["SLURM_TRES_PER_TASK"] = f"cpu={environment['SLURM_CPUS_PER_TASK']}"
    return environment


def run_launch(launch_args: list[str], environment: dict[str, str], folder: Path):
    """scripts/launch with a stand-in srun that records what it was given and applies srun's checks;
    returns the launcher's result, srun's environment and its arguments."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(STAND_IN_SRUN)
    (bin_dir / "srun").chmod(0o755)
    (folder / "clusters").mkdir(exist_ok=True)  # no cluster file: this is about srun, not the site
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    env.update(
        environment,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SRUN_RECORD=str(folder / "srun"),
        FEDTUNE_CLUSTERS_DIR=str(folder / "clusters"),
        FEDTUNE_SIGNAL_BEFORE="0",  # no time-limit watch (it would ask squeue)
    )
    result = subprocess.run(
        ["bash", str(LAUNCH), *launch_args, "--", "true"], env=env, capture_output=True, text=True, timeout=60
    )
    seen = {}
    if (folder / "srun.env").exists():
        seen = dict(
            line.split("=", 1) for line in (folder / "srun.env").read_text().splitlines() if "=" in line
        )
    args = (folder / "srun.args").read_text().split("\n") if (folder / "srun.args").exists() else []
    return result, seen, args


def launch_args(shell: str) -> list[str]:
    """The options the train rule's shell gives scripts/launch (up to `--`); the shell names the launcher
    as "$FEDTUNE_LAUNCH" (common.smk: no checkout path in a rule's command)."""
    words = shlex.split(shell)
    start = next(i for i, word in enumerate(words) if word in ("$FEDTUNE_LAUNCH", "${FEDTUNE_LAUNCH}"))
    return words[start + 1 : words.index("--", start)]


def example_on(profile: str) -> dict:
    """The llama2 example with its site for this profile on it (with the profile's own geometry where the
    example names another cluster), once per launcher: sites <site>_srun and <site>_torchrun."""
    config = yaml.safe_load(EXAMPLE.read_text())
    site, geometry = PROFILES[profile]
    settings = config["sites"][site]
    config["sites"] = {}
    for launcher in LAUNCHERS:
        train = {**settings["train"], **geometry, "launcher": launcher}
        config["sites"][f"{site}_{launcher}"] = {**settings, "cluster": profile, "train": train}
    config["federation"] = {"rounds": 1}
    return config


@pytest.mark.parametrize("profile", PROFILES)
def test_profiles_gpu_jobs_have_a_geometry_their_own_srun_accepts(profile, tmp_path, monkeypatch):
    """The options the plugin builds for the example's training job (both launchers) carry no
    --ntasks-per-gpu and state the geometry as nodes, tasks per node (or tasks: one per node with
    torchrun) and GPUs per node; and scripts/launch, started with the batch step's environment of those
    options, gets its srun through srun's checks with the job's own layout."""
    monkeypatch.setenv("FEDTUNE_ACCOUNT", "proj123")
    config = example_on(profile)
    write_config(tmp_path, config)
    targets = [f"results/{config['run']}/round-1/{site}/model" for site in config["sites"]]
    result = snakemake(tmp_path, "-n", *targets, profile=profile, timeout=300)
    jobs = {job.wildcards["site"]: job for job in planned_jobs(result.stdout) if job.name == "train"}
    assert sorted(jobs) == sorted(config["sites"]), result.stdout[-3000:]
    for site, job in jobs.items():
        options = sbatch_options(job)  # the plugin's get_submit_command + set_gres_string
        train = {**config["train"], **config["sites"][site]["train"]}
        nodes, per_node, gpus = train["nodes"], train["processes_per_node"], train["gpus_per_node"]
        srun = train["launcher"] == "srun"
        cpus = train["cpus_per_process"] * (1 if srun else per_node)
        tasks_per_node = per_node if srun else 1
        assert "--ntasks-per-gpu" not in options, options
        for expected in (f"--nodes={nodes}", f"--gres=gpu:{gpus}", f"--cpus-per-task={cpus}"):
            assert expected in options, (expected, options)
        if tasks_per_node > 1:
            assert f"--ntasks-per-node={tasks_per_node}" in options and "--ntasks=" not in options, options
        else:
            assert f"--ntasks={nodes}" in options and "--ntasks-per-node" not in options, options

        folder = tmp_path / site
        folder.mkdir()
        launched, seen, args = run_launch(launch_args(job.shell), batch_step_environment(options), folder)
        assert launched.returncode == 0, (options, launched.stderr)
        assert "SLURM_NTASKS_PER_GPU" not in seen and "SLURM_TRES_PER_TASK" not in seen, seen
        step = " ".join(args)
        expected = f"--nodes {nodes} --cpus-per-task {cpus} --ntasks {nodes * tasks_per_node}"
        assert f"{expected} --ntasks-per-node {tasks_per_node}" in step, step


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_launch_clears_the_per_gpu_task_variables_before_its_srun(launcher, tmp_path):
    """A job submitted with --ntasks-per-gpu and --cpus-per-task (an older executor plugin, a batch script
    by hand) hands both variables to the launcher on Slurm 23.11+: its srun gets neither, and keeps the
    job's CPUs per task."""
    hostile = {
        "SLURM_JOB_ID": "4242",
        "SLURM_NTASKS_PER_GPU": "1",
        "SLURM_TRES_PER_TASK": "cpu=8",
        "SLURM_CPUS_PER_TASK": "8",
    }
    args = ["--launcher", launcher, "--nodes", "2", "--procs-per-node", "4"]
    launched, seen, srun_args = run_launch(args, hostile, tmp_path)
    assert launched.returncode == 0, launched.stderr
    assert "SLURM_NTASKS_PER_GPU" not in seen and "SLURM_TRES_PER_TASK" not in seen, seen
    assert seen["SLURM_CPUS_PER_TASK"] == "8" and "--cpus-per-task 8" in " ".join(srun_args), srun_args


# --- on the local cluster with stand-in GPUs ----------------------------------------------------------

# Stands in for `python -m fedtune.train` on every rank: records what the rank sees, and rank 0 writes
# the model folder the rule expects. Any other python command runs the real interpreter.
STAND_IN_PYTHON = r"""#!/usr/bin/env bash
if [[ "$1 $2" != "-m fedtune.train" ]]; then exec "$REAL_PYTHON" "$@"; fi
exec "$REAL_PYTHON" - "$@" <<'EOF'
import json, os, sys
args = sys.argv[1:]
out = args[args.index("--out") + 1]
site = args[args.index("--site") + 1]
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "SLURMD_NODENAME",
        "CUDA_VISIBLE_DEVICES", "SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_JOB_ID",
        "SLURM_NTASKS_PER_GPU", "SLURM_TRES_PER_TASK"]
record = {key: os.environ.get(key) for key in keys}
folder = os.path.join(os.environ["GPU_RANKS_DIR"], site)
os.makedirs(folder, exist_ok=True)
with open(os.path.join(folder, f"rank-{record['RANK']}.json"), "w") as stream:
    json.dump(record, stream)
if record["RANK"] == "0":
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, "training.json"), "w").write("{}")
EOF
"""


@pytest.fixture(scope="module")
def slurm_cluster():
    yield from running_cluster()


def scaled_geometries() -> dict[str, tuple[int, list[str]]]:
    """Each profile's training geometry scaled to two nodes of one CPU per rank: GPUs (= ranks) per node,
    as the example (or the profile, where the example names another cluster) gives it. Profiles that
    scale to the same job share it: {"gpus4": (4, ["leonardo", "iris", "meluxina"]), "gpus8": ...}."""
    example = yaml.safe_load(EXAMPLE.read_text())["sites"]
    shapes: dict[str, tuple[int, list[str]]] = {}
    for profile, (site, geometry) in PROFILES.items():
        train = {**example[site]["train"], **geometry}
        assert train["processes_per_node"] == train["gpus_per_node"], (profile, train)
        gpus = train["gpus_per_node"]
        shapes.setdefault(f"gpus{gpus}", (gpus, []))[1].append(profile)
    return shapes


def scaled_sites(base: dict) -> dict[str, dict]:
    """A site per scaled geometry and launcher (site gpus4_srun: 2 nodes x 4 GPUs x 4 ranks, srun)."""
    sites = {}
    for name, (gpus, _) in scaled_geometries().items():
        for launcher in LAUNCHERS:
            train = {
                "nodes": 2, "gpus_per_node": gpus, "processes_per_node": gpus, "cpus_per_process": 1,
                "launcher": launcher, "micro_batch": 1, "global_batch": 2 * gpus, "mem_mb": 500, "runtime": 10,
            }  # fmt: skip
            sites[f"{name}_{launcher}"] = {**base, "cluster": "slurm-local", "train": train}
    return sites


def test_every_profiles_gpu_training_reaches_each_rank_on_the_gpu_cluster(slurm_cluster, tmp_path):
    """Each profile's training geometry on 2 nodes of the local cluster (Leonardo, Iris and MeluXina scale
    to the same job: 4 GPUs and 4 ranks per node; Karolina: 8), with both launchers, through Snakemake's
    slurm executor (the train rule's own resources and shell): every rank starts once, with the rank,
    local rank and world size of its place, on the node it belongs to, and sees its node's GPUs as Slurm
    allocated them to the job."""
    assert sorted(p for _, profiles in scaled_geometries().values() for p in profiles) == sorted(PROFILES)
    config = demo_config()
    config["tokenize"]["shards"] = 1
    config["sites"] = scaled_sites(config["sites"]["alpha"])
    write_config(tmp_path, config)
    run = tmp_path / "results" / config["run"]
    (run / "model" / "base").mkdir(parents=True)
    for site in config["sites"]:
        (run / "data" / site / "train" / "shard-0").mkdir(parents=True)
        (run / "data" / site / "manifest.json").write_text("{}")
    stand_in = tmp_path / "stand-in"
    stand_in.mkdir()
    (stand_in / "python").write_text(STAND_IN_PYTHON)
    (stand_in / "python").chmod(0o755)
    # The launcher sources the cluster file from here: the real one, then the stand-in first on PATH.
    clusters = tmp_path / "clusters"
    clusters.mkdir()
    (clusters / "slurm-local.sh").write_text(
        f"source {ROOT}/scripts/clusters/slurm-local.sh\nexport PATH={stand_in}:$PATH\n"
    )
    ranks_dir = tmp_path / "ranks"
    env = slurm_cluster.env(
        FEDTUNE_CLUSTERS_DIR=str(clusters), GPU_RANKS_DIR=str(ranks_dir), REAL_PYTHON=f"{VENV_BIN}/python",
        TMPDIR=str(tmp_path),
    )  # fmt: skip
    targets = [f"results/{config['run']}/round-1/{site}/model" for site in config["sites"]]
    command = [
        f"{VENV_BIN}/snakemake", "--snakefile", str(ROOT / "Snakefile"), "--configfile", "config.yaml",
        "--profile", str(ROOT / "profiles" / "slurm-local"), "--allowed-rules", "train", "--retries", "0",
        *targets,
    ]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-5000:])

    jobs = {job["Comment"]: job for job in slurm_cluster.jobs(workdir=tmp_path)}
    for site, settings in config["sites"].items():
        train = settings["train"]
        per_node, gpus = train["processes_per_node"], train["gpus_per_node"]
        job = jobs[f"rule_train_wildcards_1_{site}"]
        assert job["State"] == "COMPLETED" and job["NodeList"] == "n[1-2]", job
        # Accounting's view of the allocation: a GPU training over two nodes runs exclusive
        # (TrainOptions.slurm_extra), so it holds both nodes whole, every GPU and CPU they declare.
        node = dict(
            field.split("=", 1) for field in slurm_cluster.run("scontrol", "-o", "show", "node", "n1").stdout.split()
            if "=" in field
        )  # fmt: skip
        whole = dict(item.split("=", 1) for item in node["CfgTRES"].split(","))
        assert int(whole["gres/gpu"]) >= gpus and int(whole["cpu"]) >= per_node, node
        assert f"gres/gpu={2 * int(whole['gres/gpu'])}" in job["AllocTRES"].split(","), job
        assert f"cpu={2 * int(whole['cpu'])}" in job["AllocTRES"].split(","), job
        # The controller's record of what the plugin submitted: GPUs and tasks per node, and no tasks per
        # GPU (NtasksPerTRES), which would reach the job's srun as SLURM_NTASKS_PER_GPU.
        record = slurm_cluster.job_record(job["JobID"])
        tasks_per_node = per_node if train["launcher"] == "srun" else 1
        assert record["TresPerNode"] == f"gres:gpu:{gpus}", record
        assert record["NumTasks"] == str(2 * tasks_per_node), record
        assert record["NtasksPerN:B:S:C"].split(":")[0] == str(tasks_per_node if tasks_per_node > 1 else 0), (
            record
        )
        assert record.get("NtasksPerTRES", "0") == "0", record
        records = [json.loads(path.read_text()) for path in (ranks_dir / site).glob("rank-*.json")]
        world = 2 * per_node
        assert sorted(int(r["RANK"]) for r in records) == list(range(world)), (site, records)
        by_node: dict[str, list[dict]] = {}
        for record in records:
            by_node.setdefault(record["SLURMD_NODENAME"], []).append(record)
            assert record["SLURM_JOB_ID"] == job["JobID"], (site, record)
            assert (record["WORLD_SIZE"], record["LOCAL_WORLD_SIZE"]) == (str(world), str(per_node)), record
            assert record["SLURM_NTASKS_PER_GPU"] is None and record["SLURM_TRES_PER_TASK"] is None, record
        assert sorted(by_node) == ["n1", "n2"], (site, records)
        for node, here in by_node.items():
            # Each node holds one block of ranks, its local ranks 0..P-1 (srun: n1 has the first block;
            # torchrun's rendezvous numbers the nodes in the order they join).
            assert sorted(int(r["LOCAL_RANK"]) for r in here) == list(range(per_node)), (site, node, here)
            first = {int(r["RANK"]) - int(r["LOCAL_RANK"]) for r in here}
            assert len(first) == 1 and first.pop() % per_node == 0, (site, node, here)
            if train["launcher"] == "srun":
                assert {int(r["RANK"]) // per_node + 1 for r in here} == {int(node[1:])}, (site, here)
                assert {r["MASTER_ADDR"] for r in here} == {"n1"}, (site, here)
            # The node's GPUs as Slurm allocated them to the job, the same for every rank there; each
            # local rank has one of its own among them (fedtune.train: cuda:LOCAL_RANK).
            (visible,) = {r["CUDA_VISIBLE_DEVICES"] for r in here}
            assert visible and len(visible.split(",")) == gpus, (site, node, here)
            assert {(r["SLURM_GPUS_ON_NODE"], r["SLURM_STEP_GPUS"]) for r in here} == {
                (str(gpus), visible)
            }, here
