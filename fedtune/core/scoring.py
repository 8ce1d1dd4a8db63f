"""Which model is scored on which site's test text, and on which cluster (evaluate.cross_site): the
workflow's evaluation rules, what crosses between clusters (fedtune.core.crossings) and the report's
inputs read this one list.

With cross_site text_to_models every model is scored on every site's text where the models meet. With
none each site's text is read on its own cluster only, which scores there the models it holds anyway:
the base model, each evaluated round's aggregate (the round's next training starts from it; the last
round's is sent for this) and the site's own model. A method of aggregate.compare is made where the models
meet and scored on the text of the sites there."""

from __future__ import annotations

from fedtune.core.config import TEXT_TO_MODELS, RunConfig

BASE = "base"
AGGREGATE = "aggregate"
POOLED = "pooled"


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
