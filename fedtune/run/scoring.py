"""Which model is scored on which site's test text, and on which cluster (evaluate.cross_site): the
workflow's evaluation rules, what crosses between clusters (fedtune.run.crossings) and the report's
inputs read this one list.

With cross_site text_to_models every model is scored on every site's text where the models meet. With
none each site's text is read on its own cluster only, which scores there the models it holds anyway:
the base model, each evaluated round's aggregate (the round's next training starts from it; the last
round's is sent for this) and the site's own model. A method of aggregate.compare is made where the models
meet and scored on the text of the sites there.

On a cluster where the models do not meet, a site's next training job scores the previous round's
aggregate (its start model) and the site's previous model before it trains (`scored_in_training`), so
that cluster runs one Slurm job per site and round; only the last round's models get an evaluation job
of their own there. Such a score is written where the training job's outputs are (`made_at`) and is
fetched into its usual place (`score_path`) where the models meet."""

from __future__ import annotations

from fedtune.core.residency import TEXT_TO_MODELS
from fedtune.run.config import RunConfig

BASE = "base"
AGGREGATE = "aggregate"
POOLED = "pooled"
SITE = "site"  # a site's own model, as the role of a score made before training


def cross_site(run: RunConfig) -> bool:
    """Whether every model is scored on every site's text (evaluate.cross_site text_to_models)."""
    return run.evaluate.cross_site == TEXT_TO_MODELS


def merged_models(run: RunConfig) -> list[str]:
    """A round's merged models: the aggregate and the methods aggregate.compare names."""
    return [AGGREGATE, *run.aggregate.compare]


def round_models(run: RunConfig, round: int) -> list[str]:
    """The models evaluated after `round`: all of the last round's, and before it what
    evaluate.intermediate says; a site's model only in the rounds it trains in (federation.participation)."""
    every = [*run.round_sites(round), *merged_models(run)]
    if round == run.rounds or run.evaluate.intermediate == "all":
        return every
    return merged_models(run) if run.evaluate.intermediate == AGGREGATE else []


def scoring_cluster(run: RunConfig, site: str) -> str:
    """The cluster that reads `site`'s test text to score the models on it."""
    return run.aggregate_on if cross_site(run) else run.sites[site].cluster


def scored_sites(run: RunConfig, model: str) -> list[str]:
    """The sites on whose test text `model` (base, pooled, a site, aggregate or a compared method) is
    scored."""
    sites = list(run.sites)
    if cross_site(run) or model in (BASE, AGGREGATE, POOLED):
        return sites
    if model in run.sites:
        return [model]
    return [site for site in sites if run.sites[site].cluster == run.aggregate_on]


def score_path(model: str, site: str, round: int = 0) -> str:
    """Where the score of `model` on `site`'s text is, inside the run folder."""
    if model == BASE:
        return f"eval/{BASE}/{site}.json"
    if model == POOLED:
        return f"{POOLED}/eval/{site}.json"
    return f"round-{round}/eval/{model}/{site}.json"


def before_training(run: RunConfig) -> list[str]:
    """What a site's training job of rounds 2.. scores on its site's text before it trains, where the
    models do not meet (see `scored_in_training`): the previous round's aggregate unless
    evaluate.intermediate is none, and the site's previous model with intermediate all."""
    if cross_site(run) or run.participants or run.evaluate.intermediate == "none":
        return []
    return [AGGREGATE, SITE] if run.evaluate.intermediate == "all" else [AGGREGATE]


def scored_in_training(run: RunConfig, model: str, site: str, round: int) -> bool:
    """Whether the score of `model` (of `round`) on `site`'s text is made by the site's training job of
    round + 1, before it trains: on a cluster where the models do not meet (evaluate.cross_site none),
    for the aggregate and the site's own model of every round but the last. Not with
    federation.participation, where the site may not train in the next round (nor have trained in this
    one): its scores are evaluation jobs, in the round's group."""
    if run.sites[site].cluster == run.aggregate_on or int(round) >= run.rounds:
        return False
    return _role(model, site) in before_training(run)


def _role(model: str, site: str) -> str | None:
    """The role of `model` among the scores a training makes before it trains, None for any other."""
    return AGGREGATE if model == AGGREGATE else SITE if model == site else None


def before_training_path(site: str, round: int, role: str) -> str:
    """Where the training job of `round` at `site` writes a score it makes before it trains: of the
    previous round's aggregate (role aggregate) or of the site's previous model (role site)."""
    return f"round-{round}/{site}/before/{role}.json"


def made_at(run: RunConfig, model: str, site: str, round: int = 0) -> str:
    """Where the score of `model` on `site`'s text is written on the cluster that makes it (on the
    cluster where the models meet it is fetched into `score_path`)."""
    if scored_in_training(run, model, site, round):
        return before_training_path(site, int(round) + 1, _role(model, site))
    return score_path(model, site, round)


def scores(run: RunConfig) -> list[tuple[int, str, str]]:
    """(round, model, site) of every score the report reads, the base model's first (round 0)."""
    listed = [(0, BASE, site) for site in scored_sites(run, BASE)]
    for r in range(1, run.rounds + 1):
        listed += [(r, model, site) for model in round_models(run, r) for site in scored_sites(run, model)]
    if run.pooled:
        listed += [(run.rounds, POOLED, site) for site in scored_sites(run, POOLED)]
    return listed


def score_paths(run: RunConfig) -> list[str]:
    return [score_path(model, site, r) for r, model, site in scores(run)]
