# The config as objects (fedtune.core.config, where every rule of the config lives), the results layout and
# the input functions every rule file uses.
import dataclasses
import functools
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

from fedtune.core.config import ConfigError, build_run_config

try:
    # Rules read RUN's typed objects, never `config` (tests/test_architecture.py).
    RUN = build_run_config(
        config, source=" + ".join(map(str, workflow.configfiles)) or "config"
    )
except ConfigError as error:
    raise WorkflowError(f"invalid configuration: {error}") from None

from fedtune.core.config import cluster_profile_problem, placeholder_problem

CONFIG_SOURCE = " + ".join(map(str, workflow.configfiles)) or "config"
# A dry run (-n): planned, nothing run. Known while this file loads (workflow.dryrun is not, yet).
DRY_RUN = workflow.output_settings.dryrun
# A config whose sites train on real clusters, without a cluster profile: refused, dry run included (its
# plan would be every multi-node training on this machine), naming the twin that does run here.
if problem := cluster_profile_problem(
    RUN, Path(workflow.basedir) / "profiles", CONFIG_SOURCE
):
    raise WorkflowError(problem)
# federation.site_steps tokens: measured by benchmarks/federation_yardstick.py, not yet planned here.
from fedtune.core.config import site_steps_problem

if problem := site_steps_problem(RUN, CONFIG_SOURCE):
    raise WorkflowError(problem)


# Software per rule, for --software-deployment-method conda or apptainer (a plain venv is the default).
CONDA_ENV = "../../envs/fedtune.yaml"
CONTAINER = os.environ.get("FEDTUNE_CONTAINER", "fedtune.sif")
DEPLOYMENT = set(map(str, workflow.deployment_settings.deployment_method))

RUN_DIR = RUN.run_dir
TASK = RUN.task
CLASSIFICATION = RUN.classification
# The report's main table: perplexity of language models, accuracy of classifiers.
REPORT_METRIC = "accuracy" if CLASSIFICATION else "perplexity"
SITES = list(RUN.sites)
ROUNDS = list(range(1, RUN.rounds + 1))
SPLITS = ["train", "test"]

# Multi-cluster federation: which sites train here, and whether the models meet here.
HERE = RUN.cluster
AGGREGATE_ON = RUN.aggregate_on


def site_cluster(site):
    return RUN.sites[site].cluster


def trains_here(site):
    return HERE is None or site_cluster(site) == HERE


def aggregates_here():
    return HERE is None or HERE == AGGREGATE_ON


LOCAL_SITES = [site for site in SITES if trains_here(site)]
REMOTE_SITES = [site for site in SITES if not trains_here(site)]


def scratch_lines():
    """Where the run folder is, said at start when it is on the cluster's scratch (scratch_results, from the
    cluster profile): the scratch's purge rule and the command that copies the final results (the report
    and last round's models where they meet; this cluster's site models elsewhere) to work or project
    space."""
    scratch = RUN.scratch_results
    if not scratch or not RUN_DIR.resolve().is_relative_to(Path(scratch).resolve()):
        return []
    last = f"round-{RUN.rounds}"
    if RUN.smoke:
        kept = [f"{last}/{site}/model" for site in LOCAL_SITES]
    elif HERE is None or HERE == AGGREGATE_ON:
        kept = ["report", f"{last}/aggregate/model", f"{last}/eval"]
    else:
        kept = [f"{last}/{site}/model" for site in LOCAL_SITES]
    keep = RUN.scratch_keep or "<work or project space>"
    sources = " ".join(shlex.quote(f"{RUN_DIR}/./{path}") for path in kept)
    return [
        f"fedtune: the run folder {RUN_DIR} is on {HERE or 'this cluster'}'s scratch"
        + (f", where {RUN.scratch_purge}" if RUN.scratch_purge else "")
        + ". Copy the final results off it: "
        f"mkdir -p {keep}/{RUN.run} && rsync -a --relative {sources} {keep}/{RUN.run}/"
    ]


if not workflow.remote_exec:
    for line in scratch_lines():
        print(line, file=sys.stderr)


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


def download_flags(wildcards):
    """The download's flags besides its options: a classifier's labels, checked here before any expensive
    stage reads them, and --splits, what this cluster reads of the site's text. Where the site trains
    (or, with model.source init, a tokenizer is built from it): train and test; elsewhere only the test
    split that evaluation reads. A site whose text stays home (dataset.shareable false) is never
    downloaded on another cluster (build_run_config refuses every setting that would need it).
    """
    site = wildcards.site
    if HERE not in (None, site_cluster(site)) and not RUN.sites[site].dataset.shareable:
        raise WorkflowError(
            f"{raw_data_dir(site)}: site {site}'s text is read only on {site_cluster(site)}, not on "
            f"{HERE} (sites.{site}.dataset.shareable: false)"
        )
    flags = [f"--num-labels {RUN.model.num_labels}"] if CLASSIFICATION else []
    if not (trains_here(site) or RUN.model.source == "init"):
        flags.append("--splits test")
    return " ".join(flags)


def tokenizer_corpora():
    """What a tokenizer built from scratch trains on: every site's templated training text."""
    return [
        {
            "path": raw_data_dir(site),
            "text_field": RUN.sites[site].dataset.text_field,
            "template": RUN.sites[site].prompt_template,
        }
        for site in SITES
    ]


def shard_dirs(site, split):
    shards = RUN.tokenize.shards
    return [run_path("data", site, split, f"shard-{k}") for k in range(shards)]


def manifest_path(site):
    return run_path("data", site, "manifest.json")


def site_model_dir(round, site):
    return run_path(f"round-{round}", site, "model")


def site_optimizer_dir(round, site):
    return run_path(f"round-{round}", site, "optimizer")


def pooled_model_dir():
    return run_path("pooled", "model")


# The pooled model's lr sweep (federation.pooled_lr_factors): the pooled models beside pooled/model.
POOLED_POINTS = {point.label: point for point in RUN.pooled_points}


def pooled_point_dir(label, *parts):
    return run_path("pooled", "sweep", label, *parts)


def pooled_point_args():
    """The report's --pooled-point of every pooled model: its lr and embedding/head lr factor."""
    if not RUN.pooled:
        return ""
    points = [("pooled", RUN.pooled)] + [
        (p.label, p.options) for p in POOLED_POINTS.values()
    ]
    return "--pooled-point " + " ".join(
        f"{label}={options.lr!r},{options.embedding_lr_factor!r}"
        for label, options in points
    )


# Partial participation (federation.participation): the sites that train in a round and whose models its
# aggregate merges; the others have no model of that round.
def round_sites(round):
    return list(RUN.round_sites(int(round)))


def trains_in(round, site):
    return site in RUN.round_sites(int(round))


def aggregate_model_dir(round):
    return run_path(f"round-{round}", "aggregate", "model")


def init_model_dir(round):
    """Where round `round` starts: the base model, then the previous round's aggregate."""
    round = int(round)
    return base_model_dir() if round == 1 else aggregate_model_dir(round - 1)


# train.adapter: the sites train LoRA adapters (fedtune.core.adapters). Their model folders hold adapters,
# which are what moves between clusters; the round's aggregate adapter is merged into the round's start
# model on every cluster, and the next round starts from that with fresh adapters. Where the models meet
# rule merge_adapter does it in the round's merge job; on the other clusters each training job of round
# r >= 2 does it first (rule train_merging), so that a round costs one Slurm job per training there.
from fedtune.core.crossings import cost_crossings, cost_part, uses_adapters

ADAPTERS = uses_adapters(RUN)
MERGES_IN_TRAINING = ADAPTERS and not aggregates_here()


# A hub model named by a branch (model.revision main, the default): the dry run says so, with a commit to
# pin (the clusters download it separately; issue 37).
if RUN.model.source == "hf" and not workflow.remote_exec:
    from fedtune.download.hub_model import revision_advice

    if advice := revision_advice(RUN.model, Path(base_model_dir())):
        print(advice, file=sys.stderr)

if ADAPTERS and not workflow.remote_exec:
    from fedtune.aggregate.adapter_size import transfer_lines

    for line in transfer_lines(RUN, base_model_dir()):
        print(line, file=sys.stderr)


def aggregate_adapter_dir(round):
    return run_path(f"round-{round}", "aggregate", "adapter")


def site_start_dir(round, site):
    """train_merging's copy of round `round`'s start model at `site` (the previous round's start with
    its aggregate adapter merged in; bit for bit the aggregating cluster's merge_adapter output).
    """
    return run_path(f"round-{round}", site, "start")


def previous_start(wildcards):
    """What train_merging merges round r-1's aggregate adapter into: round r-1's start at this site."""
    round = int(wildcards.round) - 1
    return base_model_dir() if round == 1 else site_start_dir(round, wildcards.site)


def adapter_base(wildcards):
    """The base an evaluated adapter sits on: the start model of its round (or the pooled baseline's).
    Empty where the model is a full model."""
    if not ADAPTERS:
        return []
    if "model" not in wildcards.keys():
        return [base_model_dir()]  # the pooled baseline
    if wildcards.model not in SITES:
        # A merged model: the aggregate (merged on every cluster that scores it, merge_adapter) or a method.
        return []
    if MERGES_IN_TRAINING:
        # Where the models do not meet: round r's start is train_merging's copy at the site.
        round = int(wildcards.round)
        return [
            base_model_dir() if round == 1 else site_start_dir(round, wildcards.model)
        ]
    return [init_model_dir(wildcards.round)]


def base_arg(wildcards, input):
    return f"--base {shlex.quote(input.base[0])}" if input.get("base") else ""


# Train jobs (rules train and train_sweep): Slurm resources and launcher arguments from the job's
# train options, a site's (TrainOptions) or a sweep point's.
# The launcher reaches the train rule's shell through the environment, as the package does through
# PYTHONPATH: a param or a literal path would be the checkout's absolute path, which Snakemake records with
# every training, so that a moved or renamed checkout (or a scratch mount that resolves differently) made
# every train job "Params have changed" (issue 37). Jobs inherit it; a Slurm job's Snakemake sets it again.
os.environ.update(FEDTUNE_LAUNCH=str(Path(workflow.basedir) / "scripts" / "launch"))
# Every fedtune command of a job leaves a record (Slurm job id, start, end) for the report's cost table
# (fedtune.core.job_record); through the environment too, so that no rule's command changes.
os.environ.update(FEDTUNE_JOB_RECORDS=str(RUN_DIR.resolve() / "logs" / "jobs"))
SWEEP_POINTS = {point.label: point for point in RUN.sweep}
SWEEP_HERE = bool(SWEEP_POINTS) and RUN.sweep_site in LOCAL_SITES


def train_job_options(wildcards):
    """The TrainOptions of a train job, a sweep job (which has a `label` wildcard) or the pooled
    baseline's (no site wildcard)."""
    if "label" in wildcards.keys():
        return SWEEP_POINTS[wildcards.label].options
    if "point" in wildcards.keys():
        return POOLED_POINTS[wildcards.point].options
    if "site" not in wildcards.keys():
        return RUN.pooled
    return RUN.sites[wildcards.site].train


def train_launch_args(wildcards):
    options = train_job_options(wildcards)
    cluster = site_cluster(wildcards.site if "site" in wildcards.keys() else SITES[0])
    return (
        f"--cluster {cluster} --launcher {options.job_launcher}"
        f" --nodes {options.nodes} --procs-per-node {options.processes_per_node}"
        f" --cpus-per-task {options.cpus_per_task}"
        # Under --software-deployment-method apptainer the launcher runs each training process in the
        # image (not the whole train job, since the image has no Slurm).
        + (
            f" --container {shlex.quote(CONTAINER)}"
            if "apptainer" in DEPLOYMENT
            else ""
        )
    )


# federation.site_optimizer keep: each round also saves the site's optimizer state for the next.
KEEP_OPTIMIZER = RUN.site_optimizer == "keep"
OPTIMIZER_OUTPUT = (
    {"optimizer": directory(site_optimizer_dir("{round}", "{site}"))}
    if KEEP_OPTIMIZER
    else {}
)


def round_args(wildcards):
    """Which round the job is, and the optimizer state it continues and leaves (the federation's rounds,
    lr schedule and token counts are in its --options: TrainOptions.RUN_KEYS)."""
    args = f"--round {wildcards.round}"
    if KEEP_OPTIMIZER:
        args += (
            f" --optimizer-out {site_optimizer_dir(wildcards.round, wildcards.site)}"
        )
        if int(wildcards.round) > 1:
            previous = site_optimizer_dir(int(wildcards.round) - 1, wildcards.site)
            args += f" --optimizer-in {previous}"
    return args


def previous_optimizer(wildcards):
    if not KEEP_OPTIMIZER or int(wildcards.round) == 1:
        return []
    return [site_optimizer_dir(int(wildcards.round) - 1, wildcards.site)]


# Experiment tracking (fedtune.core.tracking): the stage CLIs' options from the config's tracking section.


def tracking_args():
    """`--tracking JSON --run-name NAME` for a stage CLI (dir resolved: tracking.dir or <run>/tracking), or
    nothing when tracking is off. Params use it through a function: the JSON's braces are no wildcards.
    """
    options = RUN.tracking
    if not options.on:
        return ""
    resolved = dataclasses.replace(options, dir=options.dir or run_path("tracking"))
    return f"--tracking {shlex.quote(resolved.to_json())} --run-name {shlex.quote(RUN.run)}"


# Aggregate jobs.


def server_state_dir(round):
    """The server optimizer's state after round `round` (read by the next round's aggregate)."""
    return run_path(f"round-{round}", "aggregate", "server_state")


def server_state_in(wildcards):
    round = int(wildcards.round)
    return [server_state_dir(round - 1)] if round > 1 else []


def compare_model_dir(round, method):
    """Round `round`'s site models merged by `method` (aggregate.compare), beside the aggregate."""
    return run_path(f"round-{round}", "compare", method, "model")


def site_model_args(wildcards):
    return [
        f"{site}={merge_input_dir(wildcards.round, site)}"
        for site in round_sites(wildcards.round)
    ]


def round_model_dirs(wildcards):
    """What a round's merge reads of its participating sites: their models or updates."""
    return [
        merge_input_dir(wildcards.round, site) for site in round_sites(wildcards.round)
    ]


def round_manifests(wildcards):
    return [manifest_path(site) for site in round_sites(wildcards.round)]


def round_manifest_args(wildcards):
    return [f"{site}={manifest_path(site)}" for site in round_sites(wildcards.round)]


def round_merge_json(wildcards, method=None):
    """The aggregate options of a round's merge: explicit weights of its participating sites only."""
    options = RUN.aggregate
    if RUN.participants and isinstance(options.weights, dict):
        sites = round_sites(wildcards.round)
        options = dataclasses.replace(
            options, weights={site: options.weights[site] for site in sites}
        )
    return options.merge_json() if method is None else options.compared_json(method)


# federation.exchange (exchange.smk): with a compressed dtype the sites send their updates, and the merge
# reads them; with error feedback each site keeps a residual for its next round.
EXCHANGE = RUN.exchange
COMPRESSED = EXCHANGE.compressed


def site_update_dir(round, site):
    return run_path(f"round-{round}", site, "update")


def site_residual_dir(round, site):
    return run_path(f"round-{round}", site, "residual")


def merge_input_dir(round, site):
    """What the merge reads of a site: its compressed update, or its model."""
    return site_update_dir(round, site) if COMPRESSED else site_model_dir(round, site)


RESIDUAL_OUTPUT = (
    {"residual_out": directory(site_residual_dir("{round}", "{site}"))}
    if EXCHANGE.keeps_residual
    else {}
)


# The aggregate goes back compressed too, as an update against the previous aggregate (round 1: the base
# model), which every cluster holds: the merge writes round-<r>/aggregate/merged, compress_aggregate its
# update, and decode_aggregate rebuilds round-<r>/aggregate/model from it on every cluster, the aggregating
# one included, so that the next round starts from the same bits everywhere (exchange.smk).
def aggregate_update_dir(round):
    return run_path(f"round-{round}", "aggregate", "update")


def aggregate_residual_dir(round):
    return run_path(f"round-{round}", "aggregate", "residual")


def merge_output_dir(round):
    """Where the merge writes the round's aggregate: as it is (dtype full), or to be compressed."""
    if COMPRESSED:
        return run_path(f"round-{round}", "aggregate", "merged")
    return aggregate_model_dir(round)


AGGREGATE_RESIDUAL_OUTPUT = (
    {"residual_out": directory(aggregate_residual_dir("{round}"))}
    if EXCHANGE.keeps_residual
    else {}
)


def previous_aggregate_residual(wildcards):
    if not EXCHANGE.keeps_residual or int(wildcards.round) == 1:
        return []
    return [aggregate_residual_dir(int(wildcards.round) - 1)]


def previous_residual(wildcards):
    if not EXCHANGE.keeps_residual or int(wildcards.round) == 1:
        return []
    return [site_residual_dir(int(wildcards.round) - 1, wildcards.site)]


def residual_args(wildcards, input, output):
    args = (
        f"--residual-out {shlex.quote(output.residual_out)}"
        if EXCHANGE.keeps_residual
        else ""
    )
    if input.residual:
        args += f" --residual-in {shlex.quote(input.residual[0])}"
    return args


# Evaluate jobs. Which model is scored on which site's text, and where: fedtune.core.scoring
# (evaluate.cross_site).
from fedtune.core import scoring

# Merged models of a round: the aggregate and the methods aggregate.compare names.
MERGED_MODELS = scoring.merged_models(RUN)
EVAL_MODELS = [*SITES, *MERGED_MODELS]


def round_models(round):
    """The models evaluated after `round` (scoring.round_models: evaluate.intermediate)."""
    return scoring.round_models(RUN, int(round))


def scored_here(site):
    """Whether `site`'s test text is read here to score models on it."""
    return HERE is None or scoring.scoring_cluster(RUN, site) == HERE


def sites_scored_here(model):
    """The sites on whose text `model` is scored here (each result one file of the job)."""
    return [site for site in scoring.scored_sites(RUN, model) if scored_here(site)]


def round_model_dir(round, model):
    """A model of round `round` by its name in the report: a site, aggregate or a compared method."""
    if model == "aggregate":
        # With adapters, merged where it is scored (merge_adapter, on every cluster that scores it).
        return aggregate_model_dir(round)
    if model in SITES:
        return site_model_dir(round, model)
    return compare_model_dir(round, model)


def eval_outputs(*folder):
    """One result per site, in `folder` (which may hold wildcards)."""
    return [run_path(*folder, f"{site}.json") for site in SITES]


def eval_site(site, out):
    """One entry of evaluate's --sites: the site's test data, its fields and template, and where its
    result goes."""
    return {
        "site": site,
        "data": raw_data_dir(site),
        "out": out,
        "text_field": RUN.sites[site].dataset.text_field,
        "template": RUN.sites[site].prompt_template,
        **(
            {"label_field": RUN.sites[site].dataset.label_field}
            if CLASSIFICATION
            else {}
        ),
    }


def eval_sites(wildcards, output):
    """--sites of an evaluation job (<site>.json: each output names its site)."""
    return to_json([eval_site(Path(out).stem, out) for out in output])


# Where the models do not meet (evaluate.cross_site none), a site's training job of rounds 2.. scores the
# previous round's aggregate (its start model) and the site's previous model on the site's text before
# it trains (fedtune.core.scoring.scored_in_training): one Slurm job per site and round there.
SCORED_BEFORE = scoring.before_training(RUN) if not aggregates_here() else []
SCORE_OUTPUT = (
    {
        "scores": [
            run_path(scoring.before_training_path("{site}", "{round}", role))
            for role in SCORED_BEFORE
        ]
    }
    if SCORED_BEFORE
    else {}
)


def scored_previous_model(wildcards):
    """The site's previous model, which its training job scores before it trains (SCORE_OUTPUT)."""
    if "site" not in SCORED_BEFORE:
        return []
    return [site_model_dir(int(wildcards.round) - 1, wildcards.site)]


def score_before_training(wildcards, input, output):
    """The commands that make SCORE_OUTPUT, each followed by `&&`: what the training job runs before
    training (the train rule's `merge` param, after train_merging's merge)."""
    if not SCORED_BEFORE:
        return ""
    site, round = wildcards.site, int(wildcards.round)
    log = shlex.quote(log_path("train", f"round-{round}", site))
    # With adapters the job has just merged the aggregate adapter into its start (train_merging); the
    # site's previous adapter sits on the previous round's start.
    start = output.start if MERGES_IN_TRAINING else input.init
    previous_start = base_model_dir() if round == 2 else site_start_dir(round - 1, site)
    models = {
        "aggregate": (start, "", "aggregate"),
        "site": (
            site_model_dir(round - 1, site),
            f" --base {shlex.quote(previous_start)}" if ADAPTERS else "",
            site,
        ),
    }
    commands = ""
    for role, out in zip(SCORED_BEFORE, output.scores):
        model, base, label = models[role]
        commands += (
            f"python -m fedtune.evaluate --model {shlex.quote(model)}{base} --split test"
            f" --options {shlex.quote(EVAL_OPTIONS.perplexity_json())}"
            f" --sites {shlex.quote(to_json([eval_site(site, out)]))}"
            f" --label {label} --round {round - 1} {tracking_args()} >> {log} 2>&1 && "
        )
    return commands


def pooled_eval(site):
    return run_path("pooled", "eval", f"{site}.json")


def pooled_point_evals():
    return [
        pooled_point_dir(label, "eval", f"{site}.json")
        for label in POOLED_POINTS
        for site in SITES
    ]


# Evaluation jobs: host memory from the model's size (fedtune.aggregate.adapter_size.evaluation_mem_mb:
# weights in the evaluation dtype x 1.25 + 4 GB), read from the config.json this machine has (the
# downloaded base, model.architecture, a local or GGUF model, the Hugging Face cache). Snakemake evaluates
# the resources of a job again once its inputs exist, so a hub model's jobs are sized from its download
# even where the dry run before it could not know (it then shows EVAL_MEM_MB_UNKNOWN).
EVAL_MEM_MB_UNKNOWN = 16000


@functools.cache
def _evaluation_mem_mb(downloaded):
    """evaluation_mem_mb for one state of the downloaded base (the mtime of its model config file, or
    None before the download): read once per state, not once per job."""
    from fedtune.aggregate.adapter_size import (
        AdapterSizeError,
        evaluation_mem_mb,
        known_model_config,
        weights_mem_mb,
    )

    dtype = RUN.evaluate.dtype or RUN.model.dtype
    try:
        model_config, _ = known_model_config(RUN, base_model_dir())
    except ImportError:  # a GGUF model without the gguf extra: its download says so
        model_config = None
    if model_config is not None:
        try:
            return evaluation_mem_mb(model_config, dtype)
        # A layout the formula does not know: the size of the downloaded files, if here.
        except AdapterSizeError:
            pass
    return weights_mem_mb(base_model_dir(), dtype, model_config) or EVAL_MEM_MB_UNKNOWN


@functools.cache
def _exchange_mem_mb(downloaded):
    """exchange_mem_mb for one state of the downloaded base, as _evaluation_mem_mb."""
    from fedtune.aggregate.adapter_size import (
        AdapterSizeError,
        exchange_mem_mb,
        known_model_config,
    )

    try:
        model_config, _ = known_model_config(RUN, base_model_dir())
        return exchange_mem_mb(model_config)
    except (ImportError, AdapterSizeError):
        return exchange_mem_mb(None)


def exchange_mem_mb(wildcards=None):
    """--mem of the exchange's compress and decode jobs: several fp32 copies of the largest tensor."""
    downloaded = Path(base_model_dir(), "config.json")
    return _exchange_mem_mb(
        downloaded.stat().st_mtime_ns if downloaded.is_file() else None
    )


def evaluation_mem_mb(wildcards=None):
    downloaded = Path(base_model_dir(), "config.json")
    return _evaluation_mem_mb(
        downloaded.stat().st_mtime_ns if downloaded.is_file() else None
    )


# Downstream tasks (evaluate.tasks, lm-eval): fetched once into the run folder, scored on the base model
# and the last round's site models and aggregate, one CSV per model.
DOWNSTREAM = RUN.downstream
DOWNSTREAM_NAMES = [task.name for task in DOWNSTREAM]
DOWNSTREAM_MODELS = [*SITES, "aggregate"]


def tasks_dir():
    return run_path("tasks")


def task_scores(model, round=None):
    if model == "base":
        return run_path("eval", "tasks", "base.csv")
    return run_path(f"round-{round}", "eval", "tasks", f"{model}.csv")


TASK_RESULTS = (
    [task_scores("base")]
    + [task_scores(model, ROUNDS[-1]) for model in DOWNSTREAM_MODELS]
    if DOWNSTREAM
    else []
)


def task_table(name, ext):
    """The report's table of one downstream task."""
    return run_path("report", "tasks", f"{name}.{ext}")


# The scoring jobs' --options: every setting, the run's task and BOS choice included (build_run_config's
# EvaluateOptions.for_run). The perplexity jobs' JSON leaves out the downstream tasks' keys.
EVAL_OPTIONS = RUN.evaluate


def task_args():
    """The report's score CSVs and task names, or nothing without evaluate.tasks."""
    if not DOWNSTREAM:
        return ""
    names = " ".join(shlex.quote(name) for name in DOWNSTREAM_NAMES)
    scores = " ".join(shlex.quote(path) for path in TASK_RESULTS)
    return f"--tasks {scores} --task-names {names}"


def downstream_files():
    """The task YAMLs and their local data files, as the config check found them."""
    from fedtune.core.config import read_task_yaml, resolve_path, task_data_files

    files = []
    for task in DOWNSTREAM:
        if task.yaml is None:
            continue
        files.append(str(task.yaml))
        document = read_task_yaml(task.yaml, "evaluate.tasks")
        for paths in task_data_files(document).values():
            files += [str(resolve_path(p, Path("."))) for p in paths if "://" not in p]
    return files


def downstream_sources(wildcards):
    """sha256 of the task YAMLs and their data files, a param: an edit reruns the download and the scores.
    Not inputs: a task shipped in workflow/tasks is found in the checkout, by an absolute path when the
    working directory is elsewhere, and a moved checkout would change the recorded set of input files.
    """
    from fedtune.core.checksums import sha256_file

    return [sha256_file(path) for path in downstream_files()]


# Multi-cluster federation: what crosses between clusters, who moves it, and how (fedtune.core.transfer).
# A crossing item is a path inside the run folder made on one cluster and needed on another: a site's model
# and manifest go to the aggregating cluster, each round's aggregate (adapter, with train.adapter) to the
# other clusters for their next round. Its maker marks it complete (rule mark_complete) for a receiver
# that pulls, or sends it (rule push) to a receiver whose federation.remotes entry says push.


def transfer_mode(cluster):
    """How files reach `cluster`'s run folder: pull (it fetches them) or push (their maker sends them)."""
    remote = RUN.remotes.get(cluster)
    return remote.transfer if remote is not None else "pull"


def remote_path(cluster, target):
    """Where another cluster keeps its run folder, for rsync. What a run fetches by default has its remote
    checked at start (build_run_config); this names the entry a target asked for by hand needs.
    """
    remote = RUN.remotes.get(cluster)
    if remote is None:
        raise WorkflowError(
            f"{target} is made on cluster {cluster}, which has no federation.remotes entry: add "
            f"`{cluster}: user@host:/path/to/{RUN_DIR}` (its run folder, as rsync names it)"
        )
    return remote.path.rstrip("/")


# The aggregate that crosses: its adapter (train.adapter), its compressed update (federation.exchange), or
# the model.
AGGREGATE_ITEM = "adapter" if ADAPTERS else "update" if COMPRESSED else "model"
# What of a site's round crosses: its compressed update (federation.exchange) or its model folder.
SITE_ITEM = "update" if COMPRESSED else "model"


def crossing_items():
    """(item, maker, receiver, round, what) of everything that crosses between clusters (round 0: data)."""
    from fedtune.core.crossings import crossing_items

    return [dataclasses.astuple(item) for item in crossing_items(RUN)]


# The paths an item may have (a wildcard constraint), and the clusters this one pushes to.
CROSSING_ITEM = (
    r"data/[A-Za-z][A-Za-z0-9_]*/manifest\.json|round-\d+/[A-Za-z][A-Za-z0-9_]*/(model|adapter|update)"
    # Scores made where a site's text is (evaluate.cross_site none).
    r"|eval/base/[A-Za-z][A-Za-z0-9_]*\.json|round-\d+/eval/[A-Za-z][A-Za-z0-9_-]*/[A-Za-z][A-Za-z0-9_]*\.json"
    # ... and by a site's training job, before it trains (scoring.before_training_path).
    r"|round-\d+/[A-Za-z][A-Za-z0-9_]*/before/(aggregate|site)\.json"
    # A cluster's job accounting, for the report's cost table (fedtune.core.crossings.cost_part).
    r"|report/cost_jobs-[A-Za-z][A-Za-z0-9_-]*\.csv"
)
PUSH_TO = sorted(
    {receiver for _, maker, receiver, *_ in crossing_items() if maker == HERE}
    & {cluster for cluster in RUN.remotes if transfer_mode(cluster) == "push"}
)
# The clusters this one logs into: those it pushes to, and those it pulls from.
LOGS_INTO = sorted(
    set(PUSH_TO)
    | {
        maker
        for _, maker, receiver, *_ in crossing_items()
        if receiver == HERE and transfer_mode(HERE) == "pull"
    }
)
# The examples' placeholder remote (me@login...:/scratch/project/dd-00-00/...) would fail only at the first
# transfer, after round 1's training: a run refuses it at start; a dry run, which the examples must pass
# unedited, says so.
if HERE is not None and not workflow.remote_exec:
    if problem := placeholder_problem(RUN, LOGS_INTO, CONFIG_SOURCE):
        if not DRY_RUN:
            raise WorkflowError(problem)
        print(
            f"fedtune: note: {problem}; the run will refuse to start until then",
            file=sys.stderr,
        )


def sent_targets():
    """What this cluster owes the others: a COMPLETE marker beside each item a receiver pulls, a receipt
    of each push (sent/<cluster>/<item>.COMPLETE)."""
    return [
        (
            run_path("sent", receiver, f"{item}.COMPLETE")
            if transfer_mode(receiver) == "push"
            else run_path(f"{item}.COMPLETE")
        )
        for item, maker, receiver, *_ in crossing_items()
        if maker == HERE
    ]


def _messages(what, round, remote, check):
    return f"--round {round} --remote {remote} --what {shlex.quote(what)} --check {shlex.quote(check)}"


def wait_args():
    return f"--wait {RUN.wait_s:g}"


def link_args(cluster):
    """ssh options and time limits of the logins into `cluster` (fedtune.core.transfer.Link)."""
    remote = RUN.remotes.get(cluster)
    options = remote.ssh_options if remote is not None else ()
    return " ".join(
        [f"--ssh-option {shlex.quote(option)}" for option in options]
        + [
            f"--connect-timeout {RUN.connect_timeout_s}",
            f"--io-timeout {RUN.io_timeout_s}",
            f"--transfer-timeout {RUN.transfer_timeout_s:g}",
        ]
    )


def outbox_path(item):
    """Where this cluster publishes `item` for the others to pull: all they read is under exchange/."""
    return run_path("exchange", "outbox", item)


def receive_args(item, target):
    """The transfer CLI's command and options that bring `item` (made elsewhere) to `target` here."""
    maker, round, what = next(
        (m, r, w) for i, m, rc, r, w in crossing_items() if i == item and rc == HERE
    )
    if transfer_mode(HERE) == "push":
        check = (
            f"On {maker}: is its controller running (in tmux), did its push job fail (logs/push), and can "
            f"it reach this run folder (federation.remotes.{HERE})?"
        )
        return (
            f"receive --run {shlex.quote(str(RUN_DIR))} --item {item} --out {shlex.quote(target)} "
            f"{wait_args()} {_messages(what, round, maker, check)}"
        )
    source = f"{remote_path(maker, target)}/exchange/outbox/{item}"
    check = (
        f"On {maker}: is its controller running (in tmux), did its jobs fail ({RUN_DIR}/logs), and does "
        f"`rsync {source}.COMPLETE .` work from here?"
    )
    return (
        f"fetch --source {shlex.quote(source)} --out {shlex.quote(target)} {wait_args()} "
        f"{link_args(maker)} {_messages(what, round, maker, check)}"
    )


def push_args(wildcards):
    """The transfer CLI's options that send `item` to the cluster `cluster`."""
    round, what = next(
        (r, w)
        for i, m, rc, r, w in crossing_items()
        if i == wildcards.item and rc == wildcards.cluster
    )
    to = remote_path(wildcards.cluster, run_path(wildcards.item))
    check = (
        f"Is {wildcards.cluster}'s inbox {to}/exchange/inbox there (its controller's waiting jobs make it) "
        f"and reachable from here: does `rsync {to}/exchange/inbox/` list it?"
    )
    return (
        f"--run {shlex.quote(str(RUN_DIR))} --item {wildcards.item} --to {shlex.quote(to)} {wait_args()} "
        f"{link_args(wildcards.cluster)} {_messages(what, round, wildcards.cluster, check)}"
    )


def tokenized_outputs():
    """Every shard and this cluster's manifests."""
    shards = [
        d for site in LOCAL_SITES for split in SPLITS for d in shard_dirs(site, split)
    ]
    return shards + [manifest_path(site) for site in LOCAL_SITES]


def stage_outputs():
    """Every stage's output in this cluster's part of the run, each a target of rule all in its own right.
    Snakemake reruns a job whose output is missing only when that output is a target: a missing
    intermediate output alone triggers nothing while what was made from it exists (that is how `temp()`
    works), so a deleted site model, aggregate or evaluation would otherwise never be redone (issue 37).
    As targets, each is redone when deleted, and everything made from it after it (docs/reliability.md).
    Not the optimizers' states (an aggregate's server_state, a site's optimizer): only the next round
    reads them, and docs/federation.md lets the older rounds' be deleted to save space. The list is the
    DAG's own files, no more: a target that no rule here makes would stop the run.
    """
    if not aggregates_here() and not LOCAL_SITES:
        return []  # nothing of this run is made here
    # The sites whose text is read here (config.data_read_on).
    raw_sites = [
        site for site in SITES if HERE is None or HERE in RUN.data_read_on[site]
    ]
    outputs = [base_model_dir(), *(raw_data_dir(site) for site in raw_sites)]
    outputs += tokenized_outputs()
    if not aggregates_here():
        outputs += [
            site_model_dir(r, site)
            for r in ROUNDS
            for site in LOCAL_SITES
            if trains_in(r, site)
        ]
        if COMPRESSED:
            outputs += [
                site_update_dir(r, site)
                for r in ROUNDS
                for site in LOCAL_SITES
                if trains_in(r, site)
            ]
        # What the models' cluster sends back for the next round (and with evaluate.cross_site none the
        # last round's, to score it here); with adapters, each local site's start model that its
        # training job merges from it.
        outputs += [
            aggregate_adapter_dir(r) if ADAPTERS else aggregate_model_dir(r)
            for r in (ROUNDS if not scoring.cross_site(RUN) else ROUNDS[:-1])
        ]
        # The scores made here on this cluster's sites' text, which go back to the report.
        outputs += [
            run_path(scoring.made_at(RUN, model, site, r))
            for r, model, site in scoring.scores(RUN)
            if scored_here(site)
        ]
        if MERGES_IN_TRAINING:
            outputs += [
                site_start_dir(r, site) for r in ROUNDS[1:] for site in LOCAL_SITES
            ]
    else:
        # Other clusters' manifests and models arrive here (fetch_manifest, fetch_site_model).
        outputs += [manifest_path(site) for site in REMOTE_SITES]
        outputs += [site_model_dir(r, site) for r in ROUNDS for site in round_sites(r)]
        if COMPRESSED:
            outputs += [
                site_update_dir(r, site) for r in ROUNDS for site in round_sites(r)
            ]
        for r in ROUNDS:
            outputs.append(aggregate_model_dir(r))
            if ADAPTERS:
                outputs.append(aggregate_adapter_dir(r))
            outputs += [round_model_dir(r, model) for model in round_models(r)]
        if RUN.pooled:
            outputs.append(pooled_model_dir())
            outputs += [pooled_point_dir(label, "model") for label in POOLED_POINTS]
        outputs += EVAL_RESULTS
        if DOWNSTREAM:
            outputs += [tasks_dir(), *TASK_RESULTS]
        outputs += [
            str(f)
            for f in [
                *rules.report_settings.output,
                *rules.report.output,
                *rules.report_cost.output,
            ]
        ]
    if SWEEP_HERE:
        outputs += [
            str(f) for f in [*rules.sweep_report.input.runs, *rules.sweep_report.output]
        ]
    return list(dict.fromkeys(outputs))


def get_final_output(wildcards=None):
    """Every stage's output of this cluster's part of the run (stage_outputs): where the models meet the
    report, which needs every stage, and with evaluate.tasks the task scores and their report tables;
    elsewhere this cluster's sites' models of every round. Everywhere in a multi-cluster federation: what
    the other clusters need from this one, marked or sent. Plus the scaling sweep's report where its
    site trains.
    """
    if wildcards is not None:  # as rule all's input function, while the DAG is built
        announce_jobs_per_round()
    if RUN.smoke:
        # The smoke test (config key smoke): this cluster's training jobs, nothing after them.
        return [site_model_dir(1, site) for site in LOCAL_SITES]
    targets = stage_outputs() + sent_targets()
    if aggregates_here() and DOWNSTREAM:
        targets += [task_table(name, "csv") for name in DOWNSTREAM_NAMES]
    return targets


# Every job's shell (download, tokenize, evaluate, the downstream tasks, aggregate; training again through
# scripts/launch) first sources the cluster's environment file: the caches (HF_HOME, TORCH_EXTENSIONS_DIR,
# TRITON_CACHE_DIR) go to the cluster's scratch, not to $HOME, whose quota is small on all four sites.
CLUSTER_ENV = Path(workflow.basedir) / "scripts" / "clusters" / f"{HERE}.sh"
# The prefix replaces Snakemake's own ("set -euo pipefail; "), so it starts with it: without pipefail a
# `... | tee log` rule (the transfers) would exit 0 on failure (tests/test_transfer.py).
if HERE is not None and CLUSTER_ENV.is_file():
    shell.prefix(
        f"set -euo pipefail; set +u; source {shlex.quote(str(CLUSTER_ENV))}; set -u; "
    )

# The conda environment's torch build per cluster (envs/README.md): the CUDA 12.6 build on the GPU clusters
# (Iris's V100s need its sm_70 kernels; on the A100 sites it runs on any driver >= 525.60.13).
if HERE in ("iris", "leonardo", "karolina", "meluxina"):
    CONDA_ENV = "../../envs/fedtune-cu126.yaml"


def slurm_jobs_per_round(cluster, round):
    """Slurm jobs of `round` on `cluster` (None: the only one): its sites' trainings, and where the models
    meet the round's merges and evaluations, one job when the profile joins the group round-<r>. Rules
    marked local (the transfers) run in the controller and are no Slurm jobs."""
    trains = sum(
        1
        for site in round_sites(round)
        if cluster is None or site_cluster(site) == cluster
    )
    if cluster is not None and cluster != AGGREGATE_ON:
        # With adapters, each training merges its start model first (train_merging). With
        # evaluate.cross_site none, the scores on its sites' text of the models of the round that no
        # training of the next round makes (the last round's): one job when the profile joins the group
        # round-<r>.
        scored = [
            model
            for model in round_models(round)
            if any(
                scoring.scoring_cluster(RUN, s) == cluster
                and not scoring.scored_in_training(RUN, model, s, round)
                for s in scoring.scored_sites(RUN, model)
            )
            and (
                model == "aggregate"
                or model in SITES
                and site_cluster(model) == cluster
            )
        ]
        if not scored:
            return trains
        joined = workflow.group_settings.group_components.get(
            "round-{round}", 1
        ) >= len(scored)
        return trains + (1 if joined else len(scored))
    parts = (
        (2 if ADAPTERS else 1) + len(RUN.aggregate.compare) + len(round_models(round))
    )
    joined = workflow.group_settings.group_components.get("round-{round}", 1) >= parts
    return trains + (1 if joined else parts)


def slurm_jobs_lines():
    clusters = (
        sorted({site_cluster(site) for site in SITES}) if HERE is not None else [None]
    )
    lines = []
    for cluster in clusters:
        counts = [slurm_jobs_per_round(cluster, r) for r in ROUNDS]
        trains = sum(1 for s in SITES if cluster is None or site_cluster(s) == cluster)
        where = "" if cluster is None else f" on {cluster}"
        merges = cluster in (None, AGGREGATE_ON)
        rest = (
            f", the rest {'merge-and-evaluate' if merges else 'evaluate'}"
            if max(counts) > trains
            else ""
        )
        lines.append(
            f"fedtune: Slurm jobs per round{where}: {', '.join(map(str, counts))} (rounds 1-{ROUNDS[-1]}: "
            f"{trains} training{'s' * (trains != 1)}{rest})"
        )
    return lines


def announce_jobs_per_round():
    """The dry run (and every start) with a Slurm profile (which joins the group round-<r>) or in a
    multi-cluster federation says how many Slurm jobs each round costs on each cluster. Called while the
    DAG is built, when the profile's group settings are known (they are not yet while this file loads).
    """
    grouped = "round-{round}" in workflow.group_settings.group_components
    if not workflow.remote_exec and (grouped or HERE is not None):
        for line in slurm_jobs_lines():
            print(line, file=sys.stderr)
