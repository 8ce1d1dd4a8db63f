"""What crosses between the clusters of a federation, who makes it and who receives it: each remote site's
manifest and round models go to `federation.aggregate_on`, each round's aggregate (its adapter with
train.adapter, its update against the previous aggregate with federation.exchange compressed) to the
other clusters for their next round, and with evaluate.cross_site none the last round's too and each score
made on another cluster (fedtune.run.scoring) back to the aggregating cluster. The workflow's transfer
rules (common.smk) and `fedtune.report.status` read the same list."""

from __future__ import annotations

from dataclasses import dataclass

from fedtune.run import scoring
from fedtune.run.config import RunConfig


@dataclass(frozen=True)
class Crossing:
    item: str  # the path inside the run folder
    maker: str  # the cluster that makes it
    receiver: str  # the cluster that needs it
    round: int  # 0: the data (a manifest)
    what: str  # for messages: "beta's model", "the aggregate"


def uses_adapters(run: RunConfig) -> bool:
    return any(site.train.adapter for site in run.sites.values())


def aggregate_item(run: RunConfig) -> str:
    """The folder of round-<r>/aggregate/ that travels: the adapter with train.adapter, the compressed
    update against the previous aggregate (federation.exchange), else the model."""
    if uses_adapters(run):
        return "adapter"
    return "update" if run.exchange.compressed else "model"


def site_item(run: RunConfig) -> str:
    """The folder of round-<r>/<site>/ that travels: the compressed update (federation.exchange) or the
    model."""
    return "update" if run.exchange.compressed else "model"


def crossing_items(run: RunConfig) -> list[Crossing]:
    """Everything that crosses between clusters, in the order the rounds need it; none without a cluster."""
    if run.cluster is None:
        return []
    rounds = range(1, run.rounds + 1)
    items = []
    for name, site in run.sites.items():
        if site.cluster == run.aggregate_on:
            continue
        items.append(
            Crossing(f"data/{name}/manifest.json", site.cluster, run.aggregate_on, 0, f"{name}'s manifest")
        )
        items += [
            Crossing(
                f"round-{r}/{name}/{site_item(run)}",
                site.cluster,
                run.aggregate_on,
                r,
                f"{name}'s {site_item(run)}",
            )
            for r in rounds
            if name in run.round_sites(r)  # federation.participation
        ]
    for receiver in sorted({site.cluster for site in run.sites.values()} - {run.aggregate_on}):
        items += [
            Crossing(
                f"round-{r}/aggregate/{aggregate_item(run)}", run.aggregate_on, receiver, r, "the aggregate"
            )
            for r in rounds
            # The last round's aggregate is scored on each site's text at home (evaluate.cross_site none).
            if r < run.rounds or not scoring.cross_site(run)
        ]
    return items + score_crossings(run) + cost_crossings(run)


def cost_part(cluster: str) -> str:
    """The item that carries `cluster`'s job accounting (fedtune.report.cost --jobs-only) to the report."""
    return f"report/cost_jobs-{cluster}.csv"


def cost_crossings(run: RunConfig) -> list[Crossing]:
    """Each cluster where the models do not meet sends its jobs' accounting (its own sacct, which only it
    can read) after its last job, so that the report's cost table has every cluster's node-hours."""
    if run.cluster is None:
        return []
    others = sorted({site.cluster for site in run.sites.values()} - {run.aggregate_on})
    return [Crossing(cost_part(c), c, run.aggregate_on, run.rounds, f"{c}'s job accounting") for c in others]


def score_crossings(run: RunConfig) -> list[Crossing]:
    """The scores made on another cluster than the one where the models meet: one JSON per (model, site),
    back to the report."""
    if run.cluster is None:
        return []
    return [
        Crossing(
            scoring.made_at(run, model, site, r),
            scoring.scoring_cluster(run, site),
            run.aggregate_on,
            r,
            f"the score of {model} on {site}'s text ({scoring.made_at(run, model, site, r)})",
        )
        for r, model, site in scoring.scores(run)
        if scoring.scoring_cluster(run, site) != run.aggregate_on
    ]


def checks_start(run: RunConfig, round: int | str) -> bool:
    """Whether a model of `round` that crosses is compared on arrival with the round's start model there
    (fedtune.core.transfer.stale: training.json `start`, aggregate.json `start_identity`): whole models
    from round 2 on. Not round 1 (each cluster's own download of the base: the merge compares those),
    adapters or compressed updates (their start is checked where they are merged or decoded)."""
    return not uses_adapters(run) and not run.exchange.compressed and int(round) > 1


def transfer_mode(run: RunConfig, cluster: str) -> str:
    """How files reach `cluster`'s run folder: pull (it fetches them) or push (their maker sends them)."""
    remote = run.remotes.get(cluster)
    return remote.transfer if remote is not None else "pull"
