"""The command lines and CLI arguments the workflow's rules pass to the stages, built from the run's config
(workflow/rules/*.smk wire them to files): evaluation commands, training launcher arguments, tracking,
the transfers' options, the report's options, and the notes a dry run prints."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

from fedtune.run.config import RunConfig
from fedtune.run.crossings import crossing_items, transfer_mode, uses_adapters
from fedtune.workflow.layout import Layout, aggregates_here, local_sites, trains_here


class WorkflowSetupError(Exception):
    """A target the config cannot make here (the workflow raises it as a WorkflowError)."""


def to_json(value) -> str:
    """Compact JSON for a CLI option; rules quote it with {params.x:q}."""
    return json.dumps(value, separators=(",", ":"))


def scratch_lines(run: RunConfig, layout: Layout) -> list[str]:
    """Where the run folder is, said at start when it is on the cluster's scratch (scratch_results, from the
    cluster profile): the scratch's purge rule and the command that copies the final results (the report
    and last round's models where they meet; this cluster's site models elsewhere) to work or project
    space."""
    scratch = run.scratch_results
    if not scratch or not run.run_dir.resolve().is_relative_to(Path(scratch).resolve()):
        return []
    last = f"round-{run.rounds}"
    if run.smoke or not aggregates_here(run):
        kept = [f"{last}/{site}/model" for site in local_sites(run)]
    else:
        kept = ["report", f"{last}/aggregate/model", f"{last}/eval"]
    keep = run.scratch_keep or "<work or project space>"
    sources = " ".join(shlex.quote(f"{run.run_dir}/./{path}") for path in kept)
    return [
        f"fedtune: the run folder {run.run_dir} is on {run.cluster or 'this cluster'}'s scratch"
        + (f", where {run.scratch_purge}" if run.scratch_purge else "")
        + ". Copy the final results off it: "
        f"mkdir -p {keep}/{run.run} && rsync -a --relative {sources} {keep}/{run.run}/"
    ]


def start_notes(run: RunConfig, layout: Layout) -> list[str]:
    """What a controller says at start (and a dry run): the scratch's copy command (scratch_lines); with a
    hub model named by a branch (model.revision main, the default), a commit to pin (the clusters download
    it separately; issue 37); with train.adapter, what crosses between clusters per round."""
    lines = scratch_lines(run, layout)
    if run.model.source == "hf":
        from fedtune.download.hub_model import revision_advice

        if advice := revision_advice(run.model, Path(layout.base_model_dir())):
            lines.append(advice)
    if uses_adapters(run):
        from fedtune.aggregate.adapter_size import transfer_lines

        lines += transfer_lines(run, layout.base_model_dir())
    return lines


def download_flags(run: RunConfig, layout: Layout, site: str) -> str:
    """The download's flags besides its options: a classifier's labels, checked here before any expensive
    stage reads them, and --splits, what this cluster reads of the site's text. Where the site trains
    (or, with model.source init, a tokenizer is built from it): train and test; elsewhere only the test
    split that evaluation reads. A site whose text stays home (dataset.shareable false) is never
    downloaded on another cluster (build_run_config refuses every setting that would need it)."""
    cluster = run.sites[site].cluster
    if run.cluster not in (None, cluster) and not run.sites[site].dataset.shareable:
        raise WorkflowSetupError(
            f"{layout.raw_data_dir(site)}: site {site}'s text is read only on {cluster}, not on "
            f"{run.cluster} (sites.{site}.dataset.shareable: false)"
        )
    flags = [f"--num-labels {run.model.num_labels}"] if run.classification else []
    if not (trains_here(run, site) or run.model.source == "init"):
        flags.append("--splits test")
    return " ".join(flags)


def tokenizer_corpora(run: RunConfig, layout: Layout) -> list[dict]:
    """What a tokenizer built from scratch trains on: every site's templated training text."""
    return [
        {
            "path": layout.raw_data_dir(site),
            "text_field": run.sites[site].dataset.text_field,
            "template": run.sites[site].prompt_template,
        }
        for site in run.sites
    ]


def pooled_point_args(run: RunConfig) -> str:
    """The report's --pooled-point of every pooled model: its lr and embedding/head lr factor."""
    if not run.pooled:
        return ""
    points = [("pooled", run.pooled)] + [(p.label, p.options) for p in run.pooled_points]
    return "--pooled-point " + " ".join(
        f"{label}={options.lr!r},{options.embedding_lr_factor!r}" for label, options in points
    )


def train_launch_args(options, cluster: str, container: str | None) -> str:
    """scripts/launch's arguments for a training with these TrainOptions on `cluster`. Under
    --software-deployment-method apptainer (`container`) the launcher runs each training process in the
    image (not the whole train job, since the image has no Slurm)."""
    return (
        f"--cluster {cluster} --launcher {options.job_launcher}"
        f" --nodes {options.nodes} --procs-per-node {options.processes_per_node}"
        f" --cpus-per-task {options.cpus_per_task}"
        + (f" --container {shlex.quote(container)}" if container is not None else "")
    )


def round_args(run: RunConfig, layout: Layout, round, site) -> str:
    """Which round the job is, and the optimizer state it continues and leaves (the federation's rounds,
    lr schedule and token counts are in its --options: TrainOptions.RUN_KEYS)."""
    args = f"--round {round}"
    if run.site_optimizer == "keep":
        args += f" --optimizer-out {layout.site_optimizer_dir(round, site)}"
        if int(round) > 1:
            args += f" --optimizer-in {layout.site_optimizer_dir(int(round) - 1, site)}"
    return args


def token_step_manifests(run: RunConfig, layout: Layout, in_round: bool) -> list[str]:
    """federation.site_steps tokens: every site's manifest, which a round's training (`in_round`; not a
    pooled model's or a sweep point's) reads to take its share of the round's steps."""
    if run.site_steps != "tokens" or not in_round:
        return []
    return [layout.manifest_path(site) for site in run.sites]


def token_steps_args(run: RunConfig, layout: Layout, in_round: bool) -> str:
    """` --token-steps SITE=MANIFEST ...` for such a training (fedtune.train.loop.token_steps), or nothing."""
    pairs = [f"{site}={layout.manifest_path(site)}" for site in run.sites]
    return (
        " --token-steps " + " ".join(map(shlex.quote, pairs))
        if token_step_manifests(run, layout, in_round)
        else ""
    )


def tracking_args(run: RunConfig, layout: Layout) -> str:
    """`--tracking JSON --run-name NAME` for a stage CLI (dir resolved: tracking.dir or <run>/tracking), or
    nothing when tracking is off."""
    options = run.tracking
    if not options.on:
        return ""
    resolved = dataclasses.replace(options, dir=options.dir or layout.run_path("tracking"))
    return f"--tracking {shlex.quote(resolved.to_json())} --run-name {shlex.quote(run.run)}"


def round_merge_json(run: RunConfig, round, method: str | None = None) -> str:
    """The aggregate options of a round's merge: explicit weights of its participating sites only."""
    options = run.aggregate
    if run.participants and isinstance(options.weights, dict):
        sites = run.round_sites(int(round))
        options = dataclasses.replace(options, weights={site: options.weights[site] for site in sites})
    return options.merge_json() if method is None else options.compared_json(method)


def residual_args(run: RunConfig, residual_out: str | None, residual_in: list[str]) -> str:
    """The exchange's error feedback: the residual a compression leaves, and the one it continues."""
    args = f"--residual-out {shlex.quote(residual_out)}" if run.exchange.keeps_residual else ""
    if residual_in:
        args += f" --residual-in {shlex.quote(residual_in[0])}"
    return args


def eval_site(run: RunConfig, layout: Layout, site: str, out: str) -> dict:
    """One entry of evaluate's --sites: the site's test data, its fields and template, and where its
    result goes."""
    dataset = run.sites[site].dataset
    return {
        "site": site,
        "data": layout.raw_data_dir(site),
        "out": out,
        "text_field": dataset.text_field,
        "template": run.sites[site].prompt_template,
        **({"label_field": dataset.label_field} if run.classification else {}),
    }


def eval_sites(run: RunConfig, layout: Layout, outputs) -> str:
    """--sites of an evaluation job (<site>.json: each output names its site)."""
    return to_json([eval_site(run, layout, Path(out).stem, out) for out in outputs])


def evaluate_command(
    model: str, options: str, sites: str, label: str, round, tracking: str, log: str, base=""
) -> str:
    """One `python -m fedtune.evaluate` command; `log` is its redirection (`> log`), `base` (with a leading
    space) the adapter's base."""
    return (
        f"python -m fedtune.evaluate --model {model}{base} --split test --options {options} --sites {sites}"
        f" --label {label} --round {round} {tracking} {log} 2>&1"
    )


# The evaluation rules' shell (evaluate.smk): the command with the rule's placeholders.
EVAL_SHELL = evaluate_command(
    "{input.model:q}",
    "{params.options:q}",
    "{params.sites:q}",
    "{params.label}",
    "{params.round}",
    "{params.tracking}",
    "> {log:q}",
    base=" {params.base}",
)


def score_before_training(
    run: RunConfig, layout: Layout, roles: list[str], site: str, round, start: str, outputs
) -> str:
    """The commands that score, before a site's training of `round` (on a cluster where the models do not
    meet, evaluate.cross_site none), the models of `roles` (scoring.before_training) into `outputs`, each
    followed by `&&`: round r-1's aggregate (its start model `start`) and the site's model of round r-1."""
    round = int(round)
    log = shlex.quote(layout.log_path("train", f"round-{round}", site))
    # With adapters the site's previous adapter sits on the previous round's start.
    previous_start = layout.base_model_dir() if round == 2 else layout.site_start_dir(round - 1, site)
    models = {
        "aggregate": (start, "", "aggregate"),
        "site": (
            layout.site_model_dir(round - 1, site),
            f" --base {shlex.quote(previous_start)}" if uses_adapters(run) else "",
            site,
        ),
    }
    options = shlex.quote(run.evaluate.perplexity_json())
    commands = ""
    for role, out in zip(roles, outputs, strict=True):
        model, base, label = models[role]
        sites = shlex.quote(to_json([eval_site(run, layout, site, out)]))
        commands += evaluate_command(
            shlex.quote(model),
            options,
            sites,
            label,
            round - 1,
            tracking_args(run, layout),
            f">> {log}",
            base,
        )
        commands += " && "
    return commands


def task_args(run: RunConfig, layout: Layout) -> str:
    """The report's score CSVs and task names, or nothing without evaluate.tasks."""
    if not run.downstream:
        return ""
    names = " ".join(shlex.quote(task.name) for task in run.downstream)
    scores = " ".join(shlex.quote(path) for path in layout.task_results())
    return f"--tasks {scores} --task-names {names}"


def downstream_files(run: RunConfig) -> list[str]:
    """The task YAMLs and their local data files, as the config check found them."""
    from fedtune.core.lm_eval_tasks import read_task_yaml, resolve_path, task_data_files

    files = []
    for task in run.downstream:
        if task.yaml is None:
            continue
        files.append(str(task.yaml))
        document = read_task_yaml(task.yaml, "evaluate.tasks")
        for paths in task_data_files(document).values():
            files += [str(resolve_path(p, Path("."))) for p in paths if "://" not in p]
    return files


def downstream_sources(run: RunConfig) -> list[str]:
    """sha256 of the task YAMLs and their data files, a param: an edit reruns the download and the scores.
    Not inputs: a task shipped in workflow/tasks is found in the checkout, by an absolute path when the
    working directory is elsewhere, and a moved checkout would change the recorded set of input files."""
    from fedtune.core.checksums import sha256_file

    return [sha256_file(path) for path in downstream_files(run)]


# Multi-cluster federation: how crossing items move (fedtune.core.transfer's CLI).


def remote_path(run: RunConfig, cluster: str, target: str) -> str:
    """Where another cluster keeps its run folder, for rsync. What a run fetches by default has its remote
    checked at start (build_run_config); this names the entry a target asked for by hand needs."""
    remote = run.remotes.get(cluster)
    if remote is None:
        raise WorkflowSetupError(
            f"{target} is made on cluster {cluster}, which has no federation.remotes entry: add "
            f"`{cluster}: user@host:/path/to/{run.run_dir}` (its run folder, as rsync names it)"
        )
    return remote.path.rstrip("/")


def push_path(run: RunConfig, cluster: str, target: str) -> str:
    """Where this cluster pushes into `cluster`'s run folder: its push_path (the push key's Host alias),
    else its path."""
    remote_path(run, cluster, target)  # the missing entry named
    return run.remotes[cluster].push_to.rstrip("/")


def push_to(run: RunConfig) -> list[str]:
    """The clusters this one pushes to."""
    pushes = {cluster for cluster in run.remotes if transfer_mode(run, cluster) == "push"}
    return sorted({c.receiver for c in crossing_items(run) if c.maker == run.cluster} & pushes)


def logs_into(run: RunConfig) -> list[str]:
    """The clusters this one logs into: those it pushes to, and those it pulls from."""
    pulls = transfer_mode(run, run.cluster) == "pull"
    return sorted(
        set(push_to(run)) | {c.maker for c in crossing_items(run) if c.receiver == run.cluster and pulls}
    )


def sent_targets(run: RunConfig, layout: Layout) -> list[str]:
    """What this cluster owes the others: a COMPLETE marker beside each item a receiver pulls, a receipt
    of each push (sent/<cluster>/<item>.COMPLETE)."""
    return [
        (
            layout.run_path("sent", c.receiver, f"{c.item}.COMPLETE")
            if transfer_mode(run, c.receiver) == "push"
            else layout.run_path(f"{c.item}.COMPLETE")
        )
        for c in crossing_items(run)
        if c.maker == run.cluster
    ]


def _messages(what: str, round, remote: str, check: str) -> str:
    return f"--round {round} --remote {remote} --what {shlex.quote(what)} --check {shlex.quote(check)}"


def wait_args(run: RunConfig) -> str:
    return f"--wait {run.wait_s:g}"


def link_args(run: RunConfig, cluster: str) -> str:
    """ssh options and time limits of the logins into `cluster` (fedtune.core.transfer.Link)."""
    remote = run.remotes.get(cluster)
    options = remote.ssh_options if remote is not None else ()
    return " ".join(
        [f"--ssh-option {shlex.quote(option)}" for option in options]
        + [
            f"--connect-timeout {run.connect_timeout_s}",
            f"--io-timeout {run.io_timeout_s}",
            f"--transfer-timeout {run.transfer_timeout_s:g}",
        ]
    )


def receive_args(run: RunConfig, item: str, target: str) -> str:
    """The transfer CLI's command and options that bring `item` (made elsewhere) to `target` here."""
    here = run.cluster
    crossing = next(c for c in crossing_items(run) if c.item == item and c.receiver == here)
    maker, round, what = crossing.maker, crossing.round, crossing.what
    if transfer_mode(run, here) == "push":
        check = (
            f"On {maker}: is its controller running (in tmux), did its push job fail (logs/push), and can "
            f"it reach this run folder (federation.remotes.{here})?"
        )
        return (
            f"receive --run {shlex.quote(str(run.run_dir))} --item {item} --out {shlex.quote(target)} "
            f"{wait_args(run)} {_messages(what, round, maker, check)}"
        )
    source = f"{remote_path(run, maker, target)}/exchange/outbox/{item}"
    check = (
        f"On {maker}: is its controller running (in tmux), did its jobs fail ({run.run_dir}/logs), and does "
        f"`rsync {source}.COMPLETE .` work from here?"
    )
    return (
        f"fetch --source {shlex.quote(source)} --out {shlex.quote(target)} {wait_args(run)} "
        f"{link_args(run, maker)} {_messages(what, round, maker, check)}"
    )


def push_args(run: RunConfig, layout: Layout, item: str, cluster: str) -> str:
    """The transfer CLI's options that send `item` to the cluster `cluster`."""
    crossing = next(c for c in crossing_items(run) if c.item == item and c.receiver == cluster)
    to = push_path(run, cluster, layout.run_path(item))
    # A dry-run push of an empty folder: the push key may write the inbox but not list it.
    check = (
        f"Is {cluster}'s inbox {to}/exchange/inbox there (its controller's waiting jobs make it) "
        f"and writable from here: does `mkdir -p /tmp/empty && rsync -rtn /tmp/empty/ {to}/exchange/inbox/` "
        "work?"
    )
    return (
        f"--run {shlex.quote(str(run.run_dir))} --item {item} --to {shlex.quote(to)} {wait_args(run)} "
        f"{link_args(run, cluster)} {_messages(crossing.what, crossing.round, cluster, check)}"
    )
