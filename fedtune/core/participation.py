"""Which sites train each round (federation.participation; issue 39): a count or a fraction of the sites,
drawn afresh per round from (seed, round) alone; and, with federation.site_steps tokens, each site's share
of a round's steps."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

from fedtune.core.options import ConfigError


def participation_count(participation: int | float | None, sites: int, where: str) -> int:
    """How many of `sites` sites train each round: a whole number is a count, a number with a decimal
    point a fraction of the sites (rounded up), None every site. Refuses what cannot be met."""
    if participation is None:
        return sites
    if isinstance(participation, bool) or not isinstance(participation, int | float):
        raise ConfigError(f"{where}: {participation!r} is neither a count of sites nor a fraction")
    if isinstance(participation, int):
        if not 1 <= participation <= sites:
            raise ConfigError(
                f"{where}: {participation} sites per round, but the federation has {sites}; give a count "
                f"from 1 to {sites}, or a fraction such as 0.5"
            )
        return participation
    if not 0 < participation <= 1:
        raise ConfigError(
            f"{where}: {participation!r} is a fraction above 1 (or not positive); give a fraction in (0, 1] "
            f"or a whole number of sites from 1 to {sites}"
        )
    return math.ceil(participation * sites - 1e-9)


def sample_participants(
    sites: Sequence[str], count: int, rounds: int, seed: int
) -> tuple[tuple[str, ...], ...]:
    """The sites of each round: `count` of `sites` drawn afresh per round, in the sites' order. The draw
    of round r depends only on (seed, r) and the sites, never on the process (no hash randomisation), so
    every cluster and every dry run draws the same sites."""
    drawn = []
    for round in range(1, rounds + 1):
        chosen = set(random.Random(f"fedtune-participation:{seed}:{round}").sample(list(sites), count))
        drawn.append(tuple(site for site in sites if site in chosen))
    return tuple(drawn)


def participating_sites(
    sites: Sequence[str], federation: Mapping, train_seed: int, source: str, *, adapters: bool = False
) -> tuple[tuple[str, ...], ...]:
    """federation.participation as each round's sites; empty when every site trains every round."""
    where = f"{source}: federation.participation"
    count = participation_count(federation["participation"], len(sites), where)
    if count == len(sites):
        return ()
    if federation["site_optimizer"] == "keep":
        raise ConfigError(
            f"{where}: {federation['participation']!r} leaves sites out of rounds, but "
            "federation.site_optimizer: keep needs each site's optimizer state of the round before; use "
            "site_optimizer: reset"
        )
    if adapters:
        raise ConfigError(
            f"{where}: {federation['participation']!r} is not supported with train.adapter (each cluster "
            "merges its start model from its sites' previous round); leave participation null"
        )
    seed = train_seed if federation["participation_seed"] is None else federation["participation_seed"]
    return sample_participants(sites, count, federation["rounds"], seed)


def site_step_counts(steps: int, tokens: Mapping[str, int]) -> dict[str, int]:
    """federation.site_steps tokens: each site's steps a round, `steps` x M x its share of the tokens,
    rounded by largest remainder (ties in the sites' order) so that they add up to steps x M, each at
    least 1 (taken from the site with the most steps where that needs it)."""
    total, names = sum(tokens.values()), list(tokens)
    budget = steps * len(names)
    if total <= 0:
        return dict.fromkeys(names, steps)
    quotas = {name: budget * tokens[name] / total for name in names}
    counts = {name: math.floor(q) for name, q in quotas.items()}
    by_remainder = sorted(names, key=lambda n: (-(quotas[n] - counts[n]), names.index(n)))
    for name in by_remainder[: budget - sum(counts.values())]:
        counts[name] += 1
    for name in names:
        while counts[name] < 1:
            counts[max(names, key=lambda n: (counts[n], -names.index(n)))] -= 1
            counts[name] += 1
    return counts
