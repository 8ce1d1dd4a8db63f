"""What a run will cost, printed at the end of a dry run, one summary per cluster (workflow/rules/plan.smk
calls it): the jobs that run on the login node (in the controller: transfers, markers, manifests,
report, and the downloads unless the profile makes them Slurm jobs), the Slurm jobs before the rounds and
per round as they are submitted (a group job once, however many rules it joins), the GPU-hours the
training jobs ask for, and the scratch space the run's models need.

The cluster the dry run plans is counted from the planned jobs themselves; the other clusters of a
federation from the config (their own dry run, with their profile, lists their jobs). Scratch space
follows from the base model's config.json where this machine has it (fedtune.aggregate.adapter_size:
the downloaded base, model.architecture, a local folder or the Hugging Face cache)."""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from fedtune.core.clusters import RULE_GROUPS
from fedtune.run.config import RunConfig
from fedtune.run.round_jobs import round_trainings
from fedtune.run.scoring import cross_site

# Rules whose jobs are trainings (the rule group train of the cluster profiles): their nodes x GPUs x time
# limit are the run's GPU-hours.
TRAIN_RULES = RULE_GROUPS["train"]
# A checkpoint holds fp32 weights and AdamW's two fp32 moments (training loads the model in fp32).
CHECKPOINT_BYTES_PER_PARAM = 4 + 4 + 4
ADAM_MOMENT_BYTES_PER_PARAM = 4 + 4  # federation.site_optimizer keep: a site's moments between rounds


@dataclass(frozen=True)
class PlannedJob:
    """One job of the dry run, as the workflow planned it."""

    rule: str
    round: int | None  # the round wildcard, None for the stages before the rounds
    login: bool  # runs in the controller on the login node, not as a Slurm job
    slurm_job: object = None  # the Slurm job it is part of (a group job's jobs share one), when not login
    gpus: int = 0  # GPUs per node (gres gpu:N)
    nodes: int = 1
    runtime_min: int = 0
    partition: str | None = None  # slurm_partition
    # The profile's jobs_per_user (no Slurm option): how many of a user's jobs the partition runs at once
    # (Leonardo's lrd_all_serial: 4 of one core each, its per-user cap); 0: not capped that way.
    per_user: int = 0


def gpus_of(gres: object) -> int:
    """GPUs per node in a Slurm gres string: gpu:4, gpu:a100:4."""
    if not isinstance(gres, str) or not gres.startswith("gpu"):
        return 0
    last = gres.rsplit(":", 1)[-1]
    return int(last) if last.isdigit() else 1


def planned_jobs(workflow, login_rules: set[str]) -> list[PlannedJob]:
    """The jobs of a Snakemake workflow's planned DAG (after a dry run), a group's jobs joined into Slurm
    jobs the way Snakemake joins them: the connected parts of a group, `group-components` of them to a
    job (snakemake.dag.DAG.update_groups)."""
    dag = workflow.dag
    jobs = [job for job in dag.needrun_jobs(exclude_finished=False) if not job.rule.norun]
    parent = {job: job for job in jobs}

    def root(job):
        while parent[job] is not job:
            parent[job] = parent[parent[job]]
            job = parent[job]
        return job

    for job in jobs:
        if job.group is not None:
            for dep in dag.dependencies.get(job, {}):
                if dep in parent and dep.group == job.group:
                    parent[root(dep)] = root(job)
    chunk = {}
    for group in sorted({job.group for job in jobs if job.group is not None}):
        parts = {id(root(job)) for job in jobs if job.group == group}
        size = workflow.group_settings.group_components.get(workflow.parent_groupids.get(group, group), 1)
        for index, part in enumerate(sorted(parts)):
            chunk[part] = (group, index // size)
    planned = []
    for job in jobs:
        resources = job.resources
        round = job.wildcards_dict.get("round")
        planned.append(
            PlannedJob(
                rule=job.rule.name,
                round=int(round) if round is not None else None,
                login=job.group is None and job.rule.name in login_rules,
                slurm_job=chunk.get(id(root(job)), job),
                gpus=gpus_of(resources.get("gres")),
                nodes=int(resources.get("nodes") or 1),
                runtime_min=int(resources.get("runtime") or 0),
                partition=resources.get("slurm_partition"),
                per_user=int(resources.get("jobs_per_user") or 0),
            )
        )
    return planned


def human_bytes(n: float) -> str:
    unit = min(int(math.log(max(n, 1), 1000)), 4)
    return f"{n / 1000**unit:.1f} {['B', 'kB', 'MB', 'GB', 'TB'][unit]}"


def _counted(names: Iterable[str]) -> str:
    return ", ".join(
        f"{n} {rule}" for rule, n in sorted(Counter(names).items(), key=lambda kv: (-kv[1], kv[0]))
    )


def _shapes(trainings: list[PlannedJob]) -> str:
    counts = Counter(f"{j.nodes} nodes x {j.gpus} GPUs x {j.runtime_min / 60:g} h" for j in trainings)
    return ", ".join(f"{n} job{'s' * (n != 1)} of {shape}" for shape, n in sorted(counts.items()))


def _gpu_hours(jobs: Iterable[PlannedJob]) -> float:
    return sum(job.nodes * job.gpus * job.runtime_min / 60 for job in jobs)


def job_lines(jobs: list[PlannedJob], rounds: int) -> list[str]:
    """Login-node jobs, Slurm jobs (before the rounds and per round) and GPU-hours of planned jobs."""
    login = [job for job in jobs if job.login]
    slurm = [job for job in jobs if not job.login]
    lines = [f"  login node: {len(login)} jobs" + (f" ({_counted(j.rule for j in login)})" if login else "")]
    # One Slurm job per distinct slurm_job: a group job's rules are counted once.
    submitted: dict[object, list[PlannedJob]] = {}
    for job in slurm:
        submitted.setdefault(job.slurm_job, []).append(job)
    before = [parts for parts in submitted.values() if parts[0].round is None]
    per_round = Counter(parts[0].round for parts in submitted.values() if parts[0].round is not None)

    def describe(groups: list[list[PlannedJob]]) -> str:
        names = [
            f"group {parts[0].slurm_job[0]} ({_counted(p.rule for p in parts)})"
            if isinstance(parts[0].slurm_job, tuple)
            else parts[0].rule
            for parts in groups
        ]
        return _counted(names)

    lines.append(
        f"  Slurm jobs: {len(submitted)} in all"
        + (f"; before the rounds {len(before)} ({describe(before)})" if before else "")
    )
    if per_round:
        counts = ", ".join(str(per_round.get(r, 0)) for r in range(1, rounds + 1))
        first = min(per_round)
        example = [parts for parts in submitted.values() if parts[0].round == first]
        lines.append(f"  Slurm jobs per round: {counts} (round {first}: {describe(example)})")
    trainings = [job for job in slurm if job.rule in TRAIN_RULES]
    others = [job for job in slurm if job.rule not in TRAIN_RULES and job.gpus]
    if trainings:
        lines.append(
            f"  GPU-hours requested by the trainings: {_gpu_hours(trainings):,.0f} ({_shapes(trainings)})"
        )
    if others:
        lines.append(f"  GPU-hours of the other GPU jobs, at most: {_gpu_hours(others):,.0f}")
    return lines + partition_lines(list(submitted.values()))


# Clusters whose CPU jobs go where an environment variable says (the cluster profile reads it): its name,
# default and the other choice. A GPU-only project may not use the site's CPU partition.
CPU_PARTITION_SWITCHES = {
    "karolina": ("FEDTUNE_KAROLINA_CPU_PARTITION", "qgpu", "qcpu"),
    "meluxina": ("FEDTUNE_MELUXINA_CPU_PARTITION", "gpu", "cpu"),
}


def partition_lines(submitted: list[list[PlannedJob]]) -> list[str]:
    """The Slurm jobs other than the trainings, per partition: how many, their job-hours at their time
    limits (a group job's longest member) and GPU-hours; where the profile says the partition runs only
    jobs_per_user of a user's jobs at once, the hours they take one batch after another."""
    by_partition: dict[str, list[list[PlannedJob]]] = {}
    for parts in submitted:
        if parts[0].rule not in TRAIN_RULES:
            by_partition.setdefault(parts[0].partition or "the default partition", []).append(parts)
    lines = []
    for partition, jobs in sorted(by_partition.items()):
        hours = sum(max(p.runtime_min for p in parts) for parts in jobs) / 60
        gpu_hours = sum(max(p.gpus * p.nodes * p.runtime_min for p in parts) for parts in jobs) / 60
        rules = _counted(p.rule for parts in jobs for p in parts)
        line = f"  on {partition}: {len(jobs)} Slurm jobs ({rules}), at most {hours:,.0f} job-hours"
        line += f" ({gpu_hours:,.0f} GPU-hours)" if gpu_hours else ""
        caps = [p.per_user for parts in jobs for p in parts if p.per_user]
        if caps:
            line += (
                f"; it runs {min(caps)} of a user's jobs at a time: up to {hours / min(caps):,.0f} h"
                " one after another"
            )
        lines.append(line)
    return lines


def cpu_partition_line(cluster: str | None, environ: Mapping[str, str]) -> list[str]:
    """Which CPU partition a cluster with a switch uses, and the other choice."""
    if cluster not in CPU_PARTITION_SWITCHES:
        return []
    variable, default, other = CPU_PARTITION_SWITCHES[cluster]
    chosen = environ.get(variable) or default
    return [
        f"  CPU jobs (tokenize, compress_update) on {chosen}: {variable}={chosen}"
        + (" (the default: GPU node-hours, which every training project holds)" if chosen == default else "")
        + f"; {other if chosen == default else default} is the other choice"
        + (f" (needs {other} node-hours)" if chosen == default else "")
    ]


def config_job_lines(run: RunConfig, cluster: str) -> list[str]:
    """For a cluster this dry run does not plan: its sites' trainings from the config."""
    sites = [site for site in run.sites.values() if site.cluster == cluster]
    # The trainings each round submits there (fedtune.run.round_jobs, as the workflow counts them).
    trainings = [
        PlannedJob("train", r, False, (name, r), train.gpus_per_node, train.nodes, train.runtime)
        for r in range(1, run.rounds + 1)
        for name in round_trainings(run, cluster, r)
        for train in [run.sites[name].train]
    ]
    lines = [
        f"  its login-node and Slurm jobs: the dry run there (snakemake -n --profile profiles/{cluster}); "
        f"trainings per round: {len(sites)} ({', '.join(s.name for s in sites)})"
    ]
    lines.append(
        f"  GPU-hours requested by the trainings: {_gpu_hours(trainings):,.0f} ({_shapes(trainings)})"
    )
    return lines


def scratch_parts(run: RunConfig, cluster: str | None, model_config: Mapping) -> dict[str, int]:
    """Bytes the run keeps on `cluster`'s scratch (None: the only one), by kind. Whole models only; with
    train.adapter the site models are adapters and every round's merged start model a whole one."""
    from fedtune.aggregate.adapter_size import ITEM_BYTES, config_dtype, model_parameters, transfer_bytes

    params = model_parameters(model_config)
    dtype = run.model.dtype if run.model.dtype in ITEM_BYTES else config_dtype(model_config)
    model = params * ITEM_BYTES[dtype]
    here = cluster is None or cluster == run.aggregate_on
    local = [s for s in run.sites.values() if cluster is None or s.cluster == cluster]
    rounds = run.rounds
    adapters = any(s.train.adapter for s in run.sites.values())
    parts = {"base model": model}
    if adapters:
        site_bytes = {}
        for site in run.sites.values():
            adapter = site.train.adapter
            targets = adapter.target_modules
            lora = {
                "r": adapter.r,
                "target_modules": list(targets) if isinstance(targets, tuple) else targets,
            }
            if adapter.modules_to_save:
                lora["modules_to_save"] = list(adapter.modules_to_save)
            site_bytes[site.name] = transfer_bytes(
                model_config, lora, adapter_dtype=dtype, model_dtype=dtype
            )["adapter_bytes"]
        kept = run.sites.values() if here else local
        parts["site adapters"] = rounds * sum(site_bytes[s.name] for s in kept)
        # Where the models meet, merge_adapter writes each round's model; elsewhere each local site's
        # training of round r >= 2 merges its own start model.
        merged = rounds if here else (rounds - 1) * len(local)
        parts["merged models"] = merged * model
    else:
        kept = {s.name for s in (run.sites.values() if here else local)}
        # federation.participation: a site keeps a model of the rounds it trains in only.
        parts["site models"] = sum(len(kept & set(run.round_sites(r))) for r in range(1, rounds + 1)) * model
        # Elsewhere each round's aggregate but the last, which comes too where it is scored at home
        # (evaluate.cross_site none).
        received = rounds * (1 + len(run.aggregate.compare)) if here else rounds - cross_site(run)
        parts["aggregates" if here else "aggregates received"] = received * model
        if here:
            parts["server optimizer state"] = rounds * len(run.aggregate.server_optimizer.slots) * params * 4
        if run.site_optimizer == "keep":
            parts["site optimizer states"] = rounds * len(local) * ADAM_MOMENT_BYTES_PER_PARAM * params
        parts["checkpoints while training"] = (
            len(local) * max(s.train.keep_checkpoints for s in local) * CHECKPOINT_BYTES_PER_PARAM * params
            if local
            else 0
        )
    if here and run.pooled is not None:
        parts["pooled model" if not run.pooled_points else "pooled models"] = (
            1 + len(run.pooled_points)
        ) * model
    return {name: n for name, n in parts.items() if n}


def _count(n: int) -> str:
    """A parameter count as a reader takes it in: 6.74B, 134.5M, 160k (not 0.2M, nor 0.0M), 950."""
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 999_500:
        return f"{n / 1e6:.1f}M"
    if n >= 1e3:
        return f"{n / 1e3:.3g}k" if n < 100_000 else f"{n / 1e3:.0f}k"
    return str(n)


def scratch_line(run: RunConfig, cluster: str | None, model_config: Mapping | None, origin: str) -> str:
    if model_config is None:
        return (
            f"  scratch: follows from {origin}'s config.json, not on this machine yet (the dry run after the "
            f"download prints it, or run `hf download {origin} config.json` first)"
        )
    from fedtune.aggregate.adapter_size import model_parameters

    parts = scratch_parts(run, cluster, model_config)
    detail = ", ".join(f"{name} {human_bytes(n)}" for name, n in parts.items())
    return (
        f"  scratch: {human_bytes(sum(parts.values()))} for models ({detail}; "
        f"{_count(model_parameters(model_config))} parameters, {run.model.dtype}; data shards not counted)"
    )


def summary_lines(
    run: RunConfig, jobs: list[PlannedJob], model_config: Mapping | None, origin: str, slurm: bool
) -> list[str]:
    """The dry run's closing summary: this cluster's planned jobs, then each other cluster's from the
    config, each with its scratch space."""
    here = run.cluster
    clusters = sorted({site.cluster for site in run.sites.values()} | {run.aggregate_on}) if here else [None]
    lines = [
        "fedtune: what this run asks for"
        + (" (a group job is one Slurm job, though --dag draws each of its rules; " if slurm else " (")
        + "`snakemake -n --quiet rules` prints this without the list of jobs):"
    ]
    for cluster in sorted(clusters, key=lambda c: c != here):
        name = "this run" if cluster is None else cluster
        role = "" if cluster is None else (" (the models meet here)" if cluster == run.aggregate_on else "")
        lines.append(f"{name}{role}:")
        if cluster == here:
            if slurm:
                lines += job_lines(jobs, run.rounds) + cpu_partition_line(cluster, os.environ)
            else:
                lines.append(f"  {len(jobs)} jobs, all on this machine (no Slurm profile)")
        else:
            lines += config_job_lines(run, cluster)
        lines.append(scratch_line(run, cluster, model_config, origin))
    if here and any(job.rule.startswith("fetch") for job in jobs):
        lines.append(
            f"The fetch jobs run in the controller and wait up to federation.wait ({run.wait_s / 86400:g} days) "
            "for the other clusters: keep it running (tmux)."
        )
    return lines


def print_dry_run_summary(workflow, run: RunConfig, base_dir, login_rules: set[str]) -> None:
    """At the exit of a Snakemake dry run that planned jobs (not of one that failed, had nothing to do,
    or ran them): the summary on stderr, after Snakemake's own output."""
    import sys

    if not workflow.dryrun or getattr(workflow, "scheduler", None) is None:
        return
    try:
        from fedtune.aggregate.adapter_size import known_model_config

        jobs = planned_jobs(workflow, login_rules)
        slurm = any(
            {"slurm_partition", "slurm_account"} & set(job.resources.keys())
            for job in workflow.dag.needrun_jobs(exclude_finished=False)
        )
        try:
            model_config, origin = known_model_config(run, base_dir)
        except Exception:  # a GGUF or folder not there yet: the scratch line says where the size comes from
            model_config, origin = None, str(run.model.name or run.model.path)
        lines = summary_lines(run, jobs, model_config, origin, slurm)
    except Exception as error:  # a summary must never turn a dry run into a failure
        lines = [f"fedtune: no summary of the run ({type(error).__name__}: {error})"]
    print("\n".join(lines), file=sys.stderr)
