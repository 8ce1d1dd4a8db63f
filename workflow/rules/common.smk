# Config validation, the results layout and the input functions every rule file uses.
import json
import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, workflow.basedir)
# Jobs run `python -m fedtune.<stage>` from any working directory and in any software environment
# (venv, conda, container): the package is found through PYTHONPATH, which jobs inherit.
os.environ.update(
    PYTHONPATH=os.pathsep.join(
        filter(None, [workflow.basedir, os.environ.get("PYTHONPATH")])
    )
)

from fedtune.config import ConfigError, check_config, site_train_options

try:
    check_config(config, source=" + ".join(map(str, workflow.configfiles)) or "config")
except ConfigError as error:
    raise WorkflowError(f"invalid configuration: {error}") from None


# Software per rule, for --software-deployment-method conda or apptainer (a plain venv is the default).
CONDA_ENV = "../../envs/fedtune.yaml"
CONTAINER = os.environ.get("FEDTUNE_CONTAINER", "fedtune.sif")
DEPLOYMENT = set(map(str, workflow.deployment_settings.deployment_method))

RUN_DIR = Path(config["results"]) / config["run"]
TASK = config["task"]
CLASSIFICATION = TASK == "sequence-classification"
# The report's main table: perplexity of language models, accuracy of classifiers.
REPORT_METRIC = "accuracy" if CLASSIFICATION else "perplexity"
SITES = list(config["sites"])
ROUNDS = list(range(1, config["federation"]["rounds"] + 1))
SPLITS = ["train", "test"]

# Multi-cluster federation: which sites train here, and whether the models meet here.
HERE = config["cluster"]
AGGREGATE_ON = (
    config["federation"]["aggregate_on"] or config["sites"][SITES[0]]["cluster"]
)


def site_cluster(site):
    return config["sites"][site]["cluster"]


def trains_here(site):
    return HERE is None or site_cluster(site) == HERE


def aggregates_here():
    return HERE is None or HERE == AGGREGATE_ON


LOCAL_SITES = [site for site in SITES if trains_here(site)]
REMOTE_SITES = [site for site in SITES if not trains_here(site)]


def one_of(names):
    """A wildcard constraint matching exactly these names (or nothing when there are none)."""
    return "|".join(names) if names else "(?!)"


wildcard_constraints:
    site="[A-Za-z][A-Za-z0-9_]*",
    split="train|test",
    shard=r"\d+",
    round=r"\d+",


def run_path(*parts):
    """A path under results/<run>/; parts may hold {wildcards}."""
    return str(RUN_DIR.joinpath(*parts))


def log_path(rule_name, *parts):
    return run_path("logs", rule_name, *parts) + ".log"


def to_json(value):
    """Compact JSON for a CLI option; rules quote it with {params.x:q}."""
    return json.dumps(value, separators=(",", ":"))


def base_model_dir():
    return run_path("model", "base")


def raw_data_dir(site):
    return run_path("data", site, "raw")


def tokenizer_corpora():
    """What a tokenizer built from scratch trains on: every site's templated training text."""
    return [
        {
            "path": raw_data_dir(site),
            "text_field": config["sites"][site]["dataset"]["text_field"],
            "template": config["sites"][site]["prompt_template"],
        }
        for site in SITES
    ]


def shard_dirs(site, split):
    shards = config["tokenize"]["shards"]
    return [run_path("data", site, split, f"shard-{k}") for k in range(shards)]


def manifest_path(site):
    return run_path("data", site, "manifest.json")


def site_model_dir(round, site):
    return run_path(f"round-{round}", site, "model")


def aggregate_model_dir(round):
    return run_path(f"round-{round}", "aggregate", "model")


def init_model_dir(round):
    """Where round `round` starts: the base model, then the previous round's aggregate."""
    round = int(round)
    return base_model_dir() if round == 1 else aggregate_model_dir(round - 1)


_TRAIN_OPTIONS = {}


def train_options(site):
    """The train section with the site's overrides merged over it, validated (once per site: input
    functions ask for it for every job)."""
    if site not in _TRAIN_OPTIONS:
        _TRAIN_OPTIONS[site] = site_train_options(config, site)
    return _TRAIN_OPTIONS[site]


# Train jobs: Slurm resources and launcher arguments from the site's train options, or from the
# options given (a sweep job's: the site's with one key changed).
LAUNCH = str(Path(workflow.basedir) / "scripts" / "launch")


def _job_options(site, options):
    return train_options(site) if options is None else options


def train_slurm_tasks(site, options=None):
    """Slurm tasks the launcher starts: one per node (torchrun) or one per process (srun)."""
    options = _job_options(site, options)
    if options["launcher"] == "torchrun":
        return options["nodes"]
    if options["launcher"] == "srun":
        return options["nodes"] * options["processes_per_node"]
    return 1


def train_launcher(site, options=None):
    # A single task needs no srun step (the job already runs on its node): torchrun starts it directly.
    options = _job_options(site, options)
    return options["launcher"] if train_slurm_tasks(site, options) > 1 else "local"


def train_launch_args(site, options=None):
    options = _job_options(site, options)
    return (
        f"--cluster {config['sites'][site]['cluster']} --launcher {train_launcher(site, options)}"
        f" --nodes {options['nodes']} --procs-per-node {options['processes_per_node']}"
        f" --cpus-per-task {train_cpus_per_task(site, options)}"
        # Under --software-deployment-method apptainer the launcher runs each training process in the
        # image (not the whole train job, since the image has no Slurm).
        + (
            f" --container {shlex.quote(CONTAINER)}"
            if "apptainer" in DEPLOYMENT
            else ""
        )
    )


def train_cpus_per_task(site, options=None):
    options = _job_options(site, options)
    per_task = 1 if options["launcher"] == "srun" else options["processes_per_node"]
    return options["cpus_per_process"] * per_task


def train_gres(site, options=None):
    gpus = _job_options(site, options)["gpus_per_node"]
    return f"gpu:{gpus}" if gpus else None


def train_tasks_per_gpu(site, options=None):
    # The Slurm plugin otherwise reads `tasks` as tasks per GPU; torchrun's one task per node drives
    # all of the node's GPUs (0 = do not set).
    options = _job_options(site, options)
    if not options["gpus_per_node"]:
        return None
    return 1 if train_launcher(site, options) == "srun" else 0


def remote_source(cluster, relative, target):
    """Where another cluster keeps `relative` (a path inside its run folder), for rsync. Without a
    remote for that cluster, the error says what to run where instead."""
    remote = config["federation"]["remotes"].get(cluster)
    if remote is None:
        raise WorkflowError(
            f"{target} is missing: it is made on cluster {cluster}. Either run there "
            f"`snakemake --profile profiles/{cluster} {target}` and copy it here, or set "
            f"federation.remotes.{cluster} to that run's folder (user@host:/path/{RUN_DIR}) so this "
            f"run fetches it with rsync."
        )
    return f"{remote.rstrip('/')}/{relative}"


def fetch_hint(cluster, target):
    return f"Produce it first on {cluster}: snakemake --profile profiles/{cluster} {target}"


def tokenized_outputs():
    """Every shard is a target in its own right: Snakemake then notices a deleted shard and redoes it
    and what depends on it (a missing intermediate file alone does not trigger a rerun).
    """
    shards = [
        d for site in LOCAL_SITES for split in SPLITS for d in shard_dirs(site, split)
    ]
    return shards + [manifest_path(site) for site in LOCAL_SITES]


def get_final_output():
    """Where the models meet: the report (which needs every stage). Elsewhere: this cluster's sites'
    models of every round, which the aggregating cluster fetches. Plus the scaling sweep's report
    where its site trains (SWEEP_TARGETS: sweep.smk, included before rule all)."""
    targets = tokenized_outputs()
    if aggregates_here():
        targets.append(run_path("report", f"{REPORT_METRIC}.csv"))
    else:
        targets += [site_model_dir(r, site) for r in ROUNDS for site in LOCAL_SITES]
    return targets + SWEEP_TARGETS


# Evaluate rules.
def eval_task_args(site):
    """A classifier reads its labels and sees each document cut where training cut it."""
    if not CLASSIFICATION:
        return ""
    label_field = config["sites"][site]["dataset"]["label_field"]
    return (
        f"--task {TASK} --label-field {shlex.quote(label_field)}"
        f" --max-length {config['tokenize']['block_size']}"
    )
