"""The Slurm jobs each round of a run submits on each cluster, decided from the config: the workflow says
them at start (common.smk), and fedtune.report.plan counts the trainings of the clusters a dry run does
not plan with them."""

from __future__ import annotations

from collections.abc import Mapping

from fedtune.run import scoring
from fedtune.run.config import RunConfig
from fedtune.run.crossings import uses_adapters

# The group of a round's merge and evaluations (and elsewhere of the last round's scores): one Slurm job
# when the profile's group-components joins its parts.
ROUND_GROUP = "round-{round}"


def round_trainings(run: RunConfig, cluster: str | None, round: int) -> list[str]:
    """The sites that train in `round` on `cluster` (None: the only one), one Slurm job each."""
    return [
        site for site in run.round_sites(int(round)) if cluster is None or run.sites[site].cluster == cluster
    ]


def round_job_parts(run: RunConfig, cluster: str | None, round: int) -> list[str]:
    """The parts of `round`'s group job on `cluster` besides its trainings. Where the models meet: the
    merge (and merge_adapter with adapters), the compared merges and the round's evaluations. Elsewhere,
    with evaluate.cross_site none, the scores on its sites' text of the models of the round that no
    training of the next round makes (the last round's). Rules marked local (the transfers) run in the
    controller and are no Slurm jobs."""
    round = int(round)
    if cluster is not None and cluster != run.aggregate_on:
        return [
            model
            for model in scoring.round_models(run, round)
            if any(
                scoring.scoring_cluster(run, s) == cluster
                and not scoring.scored_in_training(run, model, s, round)
                for s in scoring.scored_sites(run, model)
            )
            and (model == "aggregate" or model in run.sites and run.sites[model].cluster == cluster)
        ]
    merges = ["merge_adapter", "aggregate"] if uses_adapters(run) else ["aggregate"]
    return merges + list(run.aggregate.compare) + scoring.round_models(run, round)


def slurm_jobs_per_round(
    run: RunConfig, cluster: str | None, round: int, group_components: Mapping[str, int]
) -> int:
    """Slurm jobs of `round` on `cluster` (None: the only one): its sites' trainings, and the round's group
    (round_job_parts), one job when the profile joins the group round-<r> (group_components)."""
    trains = len(round_trainings(run, cluster, round))
    parts = round_job_parts(run, cluster, round)
    if not parts:
        return trains
    joined = group_components.get(ROUND_GROUP, 1) >= len(parts)
    return trains + (1 if joined else len(parts))


def slurm_jobs_lines(run: RunConfig, group_components: Mapping[str, int]) -> list[str]:
    """`fedtune: Slurm jobs per round on <cluster>: ...`, one line per cluster that trains a site."""
    clusters = sorted({site.cluster for site in run.sites.values()}) if run.cluster is not None else [None]
    lines = []
    for cluster in clusters:
        counts = [slurm_jobs_per_round(run, cluster, r, group_components) for r in range(1, run.rounds + 1)]
        trains = sum(1 for s in run.sites.values() if cluster is None or s.cluster == cluster)
        where = "" if cluster is None else f" on {cluster}"
        merges = cluster in (None, run.aggregate_on)
        rest = f", the rest {'merge-and-evaluate' if merges else 'evaluate'}" if max(counts) > trains else ""
        lines.append(
            f"fedtune: Slurm jobs per round{where}: {', '.join(map(str, counts))} (rounds 1-{run.rounds}: "
            f"{trains} training{'s' * (trains != 1)}{rest})"
        )
    return lines
