# The config as objects (fedtune.run.config, where every rule of the config lives), the results layout and
# the input functions every rule file uses.
import dataclasses
import functools
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

from fedtune.core.options import ConfigError
from fedtune.run.config import build_run_config

try:
    # Rules read RUN's typed objects, never `config` (tests/test_architecture.py).
    RUN = build_run_config(
        config, source=" + ".join(map(str, workflow.configfiles)) or "config"
    )
except ConfigError as error:
    raise WorkflowError(f"invalid configuration: {error}") from None

from fedtune.run.start_checks import cluster_profile_problem, placeholder_problem

CONFIG_SOURCE = " + ".join(map(str, workflow.configfiles)) or "config"
# A dry run (-n): planned, nothing run. Known while this file loads (workflow.dryrun is not, yet).
DRY_RUN = workflow.output_settings.dryrun
# A config whose sites train on real clusters, without a cluster profile: refused, dry run included (its
# plan would be every multi-node training on this machine), naming the twin that does run here.
if problem := cluster_profile_problem(
    RUN, Path(workflow.basedir) / "profiles", CONFIG_SOURCE
):
    raise WorkflowError(problem)


# Software per rule, for --software-deployment-method conda or apptainer (a plain venv is the default).
CONDA_ENV = "../../envs/fedtune.yaml"
CONTAINER = os.environ.get("FEDTUNE_CONTAINER", "fedtune.sif")
DEPLOYMENT = set(map(str, workflow.deployment_settings.deployment_method))

from fedtune.core.metrics import TASK_METRICS
from fedtune.run import round_jobs
from fedtune.workflow import commands, layout, resources

RUN_DIR = RUN.run_dir
TASK = RUN.task
CLASSIFICATION = RUN.classification
# The report's main table (fedtune.core.metrics): perplexity of language models, accuracy of classifiers.
REPORT_METRIC = TASK_METRICS[TASK].main
SITES = list(RUN.sites)
ROUNDS = list(range(1, RUN.rounds + 1))

# Multi-cluster federation: which sites train here, and whether the models meet here.
HERE = RUN.cluster
LOCAL_SITES = layout.local_sites(RUN)
REMOTE_SITES = [site for site in SITES if site not in LOCAL_SITES]


def site_cluster(site):
    return RUN.sites[site].cluster


def trains_here(site):
    return layout.trains_here(RUN, site)


def aggregates_here():
    return layout.aggregates_here(RUN)


# The run folder's paths under their own names (fedtune.workflow.layout.PATHS: run_path, log_path,
# base_model_dir, site_model_dir, ...); parts may hold {wildcards}.
LAYOUT = layout.Layout(RUN)
globals().update({name: getattr(LAYOUT, name) for name in layout.PATHS})
to_json = commands.to_json

# What the controller says at start: the scratch's copy command, a hub branch to pin, adapters' transfers.
if not workflow.remote_exec:
    for line in commands.start_notes(RUN, LAYOUT):
        print(line, file=sys.stderr)


def one_of(names):
    """A wildcard constraint matching exactly these names (or nothing when there are none)."""
    return "|".join(names) if names else "(?!)"


wildcard_constraints:
    site="[A-Za-z][A-Za-z0-9_]*",
    split="train|test",
    shard=r"\d+",
    round=r"\d+",


# The pooled model's lr sweep (federation.pooled_lr_factors): the pooled models beside pooled/model.
POOLED_POINTS = {point.label: point for point in RUN.pooled_points}


# Partial participation (federation.participation): the sites that train in a round and whose models its
# aggregate merges; the others have no model of that round.
def round_sites(round):
    return list(RUN.round_sites(int(round)))


# train.adapter: the sites train LoRA adapters (fedtune.core.adapters). Their model folders hold adapters,
# which are what moves between clusters; the round's aggregate adapter is merged into the round's start
# model on every cluster, and the next round starts from that with fresh adapters. Where the models meet
# rule merge_adapter does it in the round's merge job; on the other clusters each training job of round
# r >= 2 does it first (rule train_merging), so that a round costs one Slurm job per training there.
from fedtune.run import crossings
from fedtune.run.crossings import cost_crossings, cost_part, uses_adapters

ADAPTERS = uses_adapters(RUN)
MERGES_IN_TRAINING = ADAPTERS and not aggregates_here()


def previous_start(wildcards):
    """What train_merging merges round r-1's aggregate adapter into: round r-1's start at this site."""
    round = int(wildcards.round) - 1
    return base_model_dir() if round == 1 else site_start_dir(round, wildcards.site)


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
    cluster = site_cluster(wildcards.site if "site" in wildcards.keys() else SITES[0])
    image = CONTAINER if "apptainer" in DEPLOYMENT else None
    return commands.train_launch_args(train_job_options(wildcards), cluster, image)


# federation.site_optimizer keep: each round also saves the site's optimizer state for the next.
KEEP_OPTIMIZER = RUN.site_optimizer == "keep"
OPTIMIZER_OUTPUT = (
    {"optimizer": directory(site_optimizer_dir("{round}", "{site}"))}
    if KEEP_OPTIMIZER
    else {}
)


def round_args(wildcards):
    return commands.round_args(RUN, LAYOUT, wildcards.round, wildcards.site)


def previous_optimizer(wildcards):
    if not KEEP_OPTIMIZER or int(wildcards.round) == 1:
        return []
    return [site_optimizer_dir(int(wildcards.round) - 1, wildcards.site)]


# federation.site_steps tokens: a round's training reads every site's manifest (the train rule's input)
# and trains its share of the round's steps by the sites' training tokens (its round_args;
# fedtune.train.loop.token_steps). Not the pooled models' nor the sweep's (no round wildcard; they set
# round_args ""). One cluster only (config refuses more: manifests cross only to federation.aggregate_on).
def token_step_manifests(wildcards):
    return commands.token_step_manifests(RUN, LAYOUT, "round" in wildcards.keys())


def token_steps_args(wildcards):
    return commands.token_steps_args(RUN, LAYOUT, "round" in wildcards.keys())


# Experiment tracking (fedtune.core.tracking): `--tracking JSON --run-name NAME`, or nothing. Params use it
# through a function: the JSON's braces are no wildcards.
def tracking_args():
    return commands.tracking_args(RUN, LAYOUT)


def server_state_in(wildcards):
    round = int(wildcards.round)
    return [server_state_dir(round - 1)] if round > 1 else []


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
    return commands.round_merge_json(RUN, wildcards.round, method)


# Evaluate jobs. Which model is scored on which site's text, and where: fedtune.run.scoring
# (evaluate.cross_site).
from fedtune.run import scoring

# Merged models of a round: the aggregate and the methods aggregate.compare names.
MERGED_MODELS = scoring.merged_models(RUN)
EVAL_MODELS = [*SITES, *MERGED_MODELS]


# Whether a site's test text is read here to score models on it.
scored_here = functools.partial(layout.scored_here, RUN)


# Where the models do not meet (evaluate.cross_site none), a site's training job of rounds 2.. scores the
# previous round's aggregate (its start model) and the site's previous model on the site's text before
# it trains (fedtune.run.scoring.scored_in_training): one Slurm job per site and round there.
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
    # With adapters the job has just merged the aggregate adapter into its start (train_merging).
    start = output.start if MERGES_IN_TRAINING else input.init
    return commands.score_before_training(
        RUN,
        LAYOUT,
        SCORED_BEFORE,
        wildcards.site,
        wildcards.round,
        start,
        output.scores,
    )


# Downstream tasks (evaluate.tasks, lm-eval): fetched once into the run folder, scored on the base model
# and the last round's site models and aggregate, one CSV per model.
DOWNSTREAM = RUN.downstream
DOWNSTREAM_NAMES = [task.name for task in DOWNSTREAM]


TASK_RESULTS = LAYOUT.task_results()


# The scoring jobs' --options: every setting, the run's task and BOS choice included (build_run_config's
# EvaluateOptions.for_run). The perplexity jobs' JSON leaves out the downstream tasks' keys.
EVAL_OPTIONS = RUN.evaluate


# Multi-cluster federation: what crosses between clusters, who moves it, and how (fedtune.core.transfer).
# A crossing item is a path inside the run folder made on one cluster and needed on another: a site's model
# and manifest go to the aggregating cluster, each round's aggregate (adapter, with train.adapter) to the
# other clusters for their next round. Its maker marks it complete (rule mark_complete) for a receiver
# that pulls, or sends it (rule push) to a receiver whose federation.remotes entry says push.


def crossing_items():
    """(item, maker, receiver, round, what) of everything that crosses between clusters (round 0: data)."""
    return [dataclasses.astuple(item) for item in crossings.crossing_items(RUN)]


# The clusters this one logs into: those it pushes to, and those it pulls from.
LOGS_INTO = commands.logs_into(RUN)
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


def stage_outputs():
    """Every stage's output in this cluster's part of the run, each a target of rule all in its own right
    (fedtune.workflow.layout.stage_outputs), and the scaling sweep's where its site trains.
    """
    made = []  # the report's files, where the models meet
    if aggregates_here():
        reports = (rules.report_settings, rules.report, rules.report_cost)
        made = [str(f) for r in reports for f in r.output]
    outputs = layout.stage_outputs(RUN, LAYOUT, made, EVAL_RESULTS)
    if SWEEP_HERE:
        sweep = rules.sweep_report
        outputs += [str(f) for f in [*sweep.input.runs, *sweep.output]]
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
    targets = stage_outputs() + commands.sent_targets(RUN, LAYOUT)
    if aggregates_here() and DOWNSTREAM:
        targets += [task_table(task.name, "csv") for task in DOWNSTREAM]
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
# (Iris's V100s need its sm_70 kernels; on the A100 sites it runs on any driver >= 525.60.13): the clusters
# whose file (scripts/clusters/<name>.sh) sources _common.sh.
from fedtune.core.clusters import site_clusters

if HERE in site_clusters(CLUSTER_ENV.parent):
    CONDA_ENV = "../../envs/fedtune-cu126.yaml"


def announce_jobs_per_round():
    """The dry run (and every start) with a Slurm profile (which joins the group round-<r>) or in a
    multi-cluster federation says how many Slurm jobs each round costs on each cluster. Called while the
    DAG is built, when the profile's group settings are known (they are not yet while this file loads).
    """
    groups = workflow.group_settings.group_components
    if not workflow.remote_exec and (
        round_jobs.ROUND_GROUP in groups or HERE is not None
    ):
        for line in round_jobs.slurm_jobs_lines(RUN, groups):
            print(line, file=sys.stderr)
