"""The pooled baseline (federation.pooled_baseline): one training on every site's text that sees the
federation's tokens, serial or synchronous (federation.pooled_sync), and the pooled yardstick's sweep
(federation.pooled_lr_factors, pooled_embedding_lr_factors; issue 39)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fedtune.train.options import TrainOptions, train_run_keys


def pooled_options(
    config: Mapping,
    sites: Mapping[str, TrainOptions],
    source: str,
    participants: Sequence[Sequence[str]] = (),
    *,
    sync: bool = False,
) -> TrainOptions:
    """The pooled baseline's training: the top-level train section over every site's data, with as many
    blocks as the whole federation trains (every participating site, every round), so that it sees the
    same tokens. Serial (the default): at the train section's global batch, M times a site's sequential
    steps. `sync` (federation.pooled_sync): synchronous data parallelism over the sites' GPUs, M times
    the global batch (M the sites of a round; by gradient accumulation, the micro batch kept) for a
    site's number of steps. One training, no rounds: no round warmup (train.round_warmup_steps). `sites`:
    each site's train options."""
    rounds = config["federation"]["rounds"]
    base = TrainOptions.from_mapping(config["train"], source=source, prefix="train")
    base = dataclasses.replace(base, **train_run_keys(config, federated=False), round_warmup_steps=0)
    if sync:
        width = len(participants[0]) if participants else len(sites)
        base = dataclasses.replace(base, global_batch=base.global_batch * width)
    if all(train.max_steps is not None for train in sites.values()):
        trained = participants or [list(sites)] * rounds
        blocks = sum(sites[name].max_steps * sites[name].global_batch for names in trained for name in names)
        return dataclasses.replace(base, max_steps=-(-blocks // base.global_batch))
    # Epoch-based sites: as many passes over the pooled data as each site makes over its own.
    return dataclasses.replace(base, max_steps=None, epochs=rounds * base.epochs)


@dataclass(frozen=True)
class PooledPoint:
    """One pooled model of the yardstick's sweep: its label (the report's model name and its folder
    pooled/sweep/<label>), its lr and embedding/head factor, and its train options."""

    label: str
    lr: float
    embedding_lr_factor: float
    options: TrainOptions


def pooled_point_label(lr_factor: float, embedding_lr_factor: float | None) -> str:
    """`pooled-lr2x`, or with an embedding/head factor of the sweep `pooled-lr2x-emb2x`."""
    label = f"pooled-lr{lr_factor:g}x"
    return label if embedding_lr_factor is None else f"{label}-emb{embedding_lr_factor:g}x"


def pooled_sweep(
    federation: Mapping, pooled: TrainOptions, source: str, *, sync: bool = False
) -> tuple[PooledPoint, ...]:
    """The pooled models besides the one at the user's settings (`pooled`): every lr factor crossed with
    every embedding/head factor (none: the train section's), the user's own point left out. `sync`: the
    synchronous data-parallel pooled models (federation.pooled_sync), every point, labelled
    pooled-sync-lr<f>x[-emb<e>x]."""
    embedding_factors = federation["pooled_embedding_lr_factors"] or [None]
    points = []
    for lr_factor in federation["pooled_lr_factors"]:
        for embedding in embedding_factors:
            factor = pooled.embedding_lr_factor if embedding is None else float(embedding)
            if lr_factor == 1 and factor == pooled.embedding_lr_factor and not sync:
                continue  # the pooled model at the user's settings (pooled/model)
            options = dataclasses.replace(pooled, lr=pooled.lr * lr_factor, embedding_lr_factor=factor)
            options.check(f"{source}: federation.pooled_lr_factors ({lr_factor:g}): ")
            label = pooled_point_label(lr_factor, embedding)
            if sync:
                label = label.replace(POOLED_PREFIX, SYNC_PREFIX, 1)
            points.append(PooledPoint(label, options.lr, factor, options))
    return tuple(points)


# The synchronous data-parallel pooled models' labels (federation.pooled_sync): pooled-sync-lr1x, ...
POOLED_PREFIX, SYNC_PREFIX = "pooled-", "pooled-sync-"
