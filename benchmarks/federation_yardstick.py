"""The federation benchmark on the product's own code, against a tuned yardstick (issue 39).

    python benchmarks/federation_yardstick.py --half tuning --sites 4 --seeds 0 1 2
    python benchmarks/federation_yardstick.py --half tuning --sites 4 --iid --seeds 0 1 2
    python benchmarks/federation_yardstick.py --half tuning --sites 16 --participation 0.5 --seeds 0
    python benchmarks/federation_yardstick.py --half confirmation --sites 2 --chosen <tuning CSV>...
    python benchmarks/federation_yardstick.py --regime finetune --half tuning --sets de-fr --seeds 0 1 2

Each stage runs as the workflow runs it, in this process, through the function its CLI calls: the
base model from fedtune.download.fetch.download_model (source: init, or gguf to fine-tune), the sites'
shards from fedtune.tokenize.shards (tokenize_shard, write_manifest), every site's round and the
pooled model from fedtune.train.loop.train (the train stage's step loop, backend, checkpoint and
export, token counts included), the merge from fedtune.aggregate.merge.aggregate (the streamed
per-tensor merge, vocab rows and server optimizer state) and the perplexity from
fedtune.evaluate.scores (build_stream, score). The settings come from config/config.yaml (the demo; to
fine-tune, the SmolLM2 example) through fedtune.run.config, with the cell's sites, rounds, steps and
strategy; nothing here trains or merges by itself.

The yardstick is tuned: the pooled model sweeps --pooled-lr-factors (times the config's lr) crossed
with --pooled-embedding-factors (train.embedding_lr_factor, the embedding and LM-head rows' lr
multiplier, set on the pooled TrainOptions as federation.pooled_embedding_lr_factors sets it); the
strategies sweep --lr-factors crossed with --embedding-factors (the sites' train.embedding_lr_factor,
1 unless asked: the default strategy's vocab step is what gives those rows a larger step). Each model
is read at its own best point (lowest geometric mean perplexity over the sites). The CSV holds every
grid point (`lr_factor`, `embedding_factor` columns; a CSV written before the embedding factor reads
as 1); benchmarks/results/federation/yardstick.md summarises. On the confirmation half nothing is
swept: each model runs once at the point it won on the tuning half (--chosen).

Regimes: `scratch` (default) builds the demo's model from scratch on manual pages split into sites by
topic (benchmarks/federation_corpora.py). `finetune` fine-tunes SmolLM2-135M-Instruct's full weights from
its GGUF file (scripts/fetch-smollm2; the product's gguf download, converted once into --work) with the
settings of config/examples/smollm2-it-cs.yaml, cut as the retired federation_bench.py cut them
(federation_sets.cut_for_fine_tuning: blocks of 64 tokens, steps of 4 blocks, 4 rounds of 3 steps
unless --rounds / --steps say otherwise), on the fine-tuning sets of benchmarks/federation_sets.py
(FINETUNE: de-fr and ref-en+code tune, it-cs and ref-fr+code confirm; text from `federation_sets.py
prepare` in --text) with 40 test documents a site (37 for the English Debian Reference) cut to 1,500
characters as in the scratch regime, or (`--sets topics`) on the half's corpus family split into
--sites sites by topic, as the scratch regime splits it.

`lora` is the fine-tuning regime with config/examples/smollm2-it-cs-lora.yaml's rank-8 adapters (lr
5e-4): every round the sites train adapters on the round's start model, the aggregate stage's
aggregate_adapters merges them (exactly, with the server step) and merge_adapter folds the result into
the start, the next round's start model, as the workflow does; the pooled model trains one adapter on
the base and is scored as base + adapter, as the evaluate stage scores it.

Partial participation (--participation < 1) is the product's federation.participation: the cell's
config sets it, build_run_config draws each round's sites (fedtune.core.participation.sample_participants,
seeded by train.seed, here the cell's seed) and the benchmark trains and merges RunConfig.round_sites(r)
only. The pooled model's token count is the product's too (federation.pooled_baseline's max_steps from
the same draw): as many blocks as the sampled sites trained over all rounds, so at half participation
half of what every site's every round would be.

--exchange JSON is the product's federation.exchange for every strategy: each round's site models and
aggregate cross the product's codec as files (benchmarks/federation_exchange.py), rows named
<strategy>+<dtype>[+ef]. Training follows the config's train.device (auto: CUDA when present) and the
scores are computed on the same device, recorded in the CSV's `device` column (benchmarks/gpu-checks/
yardstick.sh runs cells on one GPU).

Issue 51 (benchmarks/results/federation/plan-issue-51.md): --pooled-modes serial sync trains, beside the
serial pooled model (`pooled`, pooled/model: a site's batch, M times a site's steps), the synchronous
data-parallel one (`pooled-sync`, federation.pooled_sync: M times the batch by gradient accumulation, a
site's steps, the same tokens), swept on the same pooled grid; --summarise then adds each model's gap to
it (`geo_sync_*`, `site_sync_worst`). The strategies `fedavg-keep` (federation.site_optimizer keep) and
`diloco-olr<outer>` (keep plus aggregate.server_optimizer nesterov, momentum 0.9, outer lr 0.5, 0.7 or
1) are the issue's arms B and C; --round-warmup-steps K (train.round_warmup_steps, rows <strategy>+rwK)
and --site-steps tokens (federation.site_steps, each site's steps a round from its manifest's tokens by
RunConfig.token_steps, rows <strategy>+tok) set the other two recipes for every strategy of the run.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import federation_corpora as corpora  # noqa: E402
import federation_sets as fine_sets  # noqa: E402
from federation_exchange import Exchange  # noqa: E402

from fedtune.run import config as fconfig  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TRAIN_DOCS, TEST_DOCS = 60, 40
BATCH = 8  # blocks of 128 tokens a step (the demo's 16, halved for time)
TOPICS = "topics"  # --sets: the half's corpus family by topic (federation_corpora), in any regime
REGIME_CONFIGS = {
    "scratch": "config/config.yaml",
    "finetune": "config/examples/smollm2-it-cs.yaml",
    "lora": "config/examples/smollm2-it-cs-lora.yaml",
}
# Each regime's rounds, steps a round and grids, where the command line leaves them out (argparse's
# names). The fine-tuning grids are those yardstick.md's v3 tables measured, the LoRA ones v4's.
REGIME_DEFAULTS = {
    "scratch": dict(rounds=4, steps=4, lr_factors=[1.0, 2.0, 4.0],
                    pooled_lr_factors=[0.25, 0.5, 1.0, 2.0, 4.0],
                    pooled_embedding_factors=[1.0, 2.0, 4.0, 8.0, 16.0]),
    "finetune": dict(rounds=4, steps=3, lr_factors=[0.5, 1.0, 2.0, 4.0, 8.0],
                     pooled_lr_factors=[1.0, 2.0, 4.0, 8.0], pooled_embedding_factors=[1.0]),
    # times the LoRA example's 5e-4 (5 times full fine-tuning's lr); this cut's bests were 8x-16x
    "lora": dict(rounds=4, steps=3, lr_factors=[1.0, 2.0, 4.0, 8.0, 16.0],
                 pooled_lr_factors=[1.0, 2.0, 4.0, 8.0, 16.0], pooled_embedding_factors=[1.0]),
}  # fmt: skip
STRATEGIES = {
    # plain FedAvg: the sites' weighted mean every round, every row with the sites' weights
    "fedavg": {"server_optimizer": {"name": "sgd", "lr": 1.0}, "vocab_rows": "weights"},
    "default": {},  # the schema's aggregate section as it stands
    # the default until 2026-11-28 (the rows named `default` in CSVs written before then): server
    # momentum 0.5, the vocab rows by token counts, stepped M times
    "fedavgm-vocab": {
        "server_optimizer": {"name": "fedavgm", "lr": 1.0, "momentum": 0.5},
        "vocab_rows": "counts",
        "vocab_step": "sites",
    },
    # the default until 2026-11-28 without the vocab rows' extra step: for sites that give those rows a
    # larger lr themselves (train.embedding_lr_factor), where the step on top overshoots (yardstick.md, v3)
    "default-step1": {
        "server_optimizer": {"name": "fedavgm", "lr": 1.0, "momentum": 0.5},
        "vocab_rows": "counts",
        "vocab_step": 1,
    },
    # FedExP's extrapolation per tensor (aggregate.server_optimizer fedexp), every row with the weights
    "fedexp": {"server_optimizer": {"name": "fedexp"}, "vocab_rows": "weights"},
    # Issue 51's arm B: FedAvg with each site's AdamW state kept across rounds (federation.site_optimizer
    # keep; `_federation` holds the federation keys a strategy sets beside its aggregate section)
    "fedavg-keep": {
        "server_optimizer": {"name": "sgd", "lr": 1.0},
        "vocab_rows": "weights",
        "_federation": {"site_optimizer": "keep"},
    },
    # Issue 51's arm C: DiLoCo, kept site state plus the outer Nesterov step (aggregate.server_optimizer
    # nesterov, momentum 0.9) at outer lr 0.5, 0.7 (DiLoCo's) or 1.0
    **{
        f"diloco-olr{outer:g}": {
            "server_optimizer": {"name": "nesterov", "lr": outer, "momentum": 0.9},
            "vocab_rows": "weights",
            "_federation": {"site_optimizer": "keep"},
        }
        for outer in (0.5, 0.7, 1.0)
    },
}
# The pooled models (--pooled-modes): serial (every block at a site's batch, M times a site's steps;
# the product's pooled/model) and sync (federation.pooled_sync: M times the batch, a site's steps).
POOLED_MODELS = {"serial": "pooled", "sync": "pooled-sync"}


def cell_config(
    sites: list[str],
    data: Path,
    rounds: int,
    steps: int,
    seed: int,
    strategy: str,
    participation: float = 1.0,
    regime: str = "scratch",
    exchange: dict | None = None,
    recipe: dict | None = None,
) -> dict:
    """The regime's config (the demo's, or the SmolLM2 example's) with the cell's sites (their text in
    `data`), rounds, steps, seed, strategy, participation (a fraction of the sites each round; 1: every
    site, federation.participation null), federation.exchange (None: the config's) and issue 51's
    settings (`recipe`: round_warmup_steps, site_steps, pooled_sync; None: the product's defaults)."""
    config = yaml.safe_load((ROOT / REGIME_CONFIGS[regime]).read_text())
    template = next(iter(config["sites"].values()))
    config["sites"] = {}
    for site in sites:
        entry = copy.deepcopy(template)
        entry["dataset"]["data_files"] = {s: str(data / site / f"{s}.jsonl") for s in ("train", "test")}
        config["sites"][site] = entry
    if regime == "scratch":
        config["model"]["seed"] = seed
        # Cut to what 2 cores shared by seven engineers allow (confirmation.md, "Amended"): batches of 8
        # blocks, no periodic checkpoint, disjoint evaluation windows.
        config["train"].update(
            max_steps=steps, seed=seed, remove_checkpoints=True, global_batch=BATCH, micro_batch=BATCH,
            checkpoint_every=0, warmup_steps=min(config["train"]["warmup_steps"], steps),
            embedding_lr_factor=1.0,  # each grid point sets its own (--embedding-factors)
        )  # fmt: skip
        config["evaluate"]["stride"] = config["evaluate"]["max_length"]
    else:
        # The pretrained base is the same for every seed; the seed orders the data. The example's GGUF
        # path is relative to the checkout: made absolute, so the download reads it from any folder.
        config["model"]["path"] = str(ROOT / config["model"]["path"])
        fine_sets.cut_for_fine_tuning(config)
        config["train"].update(max_steps=steps, seed=seed, remove_checkpoints=True, checkpoint_every=0)
        config["evaluate"]["batch_size"] = 16
    config["federation"]["rounds"] = rounds
    config["federation"]["participation"] = None if participation >= 1 else float(participation)
    config["aggregate"] = copy.deepcopy(STRATEGIES[strategy])
    config["federation"].update(config["aggregate"].pop("_federation", {}))
    if exchange is not None:
        config["federation"]["exchange"] = dict(exchange)
    recipe = recipe or {}
    if recipe.get("round_warmup_steps"):
        config["train"]["round_warmup_steps"] = recipe["round_warmup_steps"]
    if recipe.get("site_steps", "equal") != "equal":
        config["federation"]["site_steps"] = recipe["site_steps"]
    if recipe.get("pooled_sync"):
        config["federation"].update(pooled_baseline=True, pooled_sync=True)
    return config


class Cell:
    """One cell: a split of a half's corpus into sites, one seed; its base model, shards and test ids."""

    def __init__(self, args, seed: int, work: Path):
        self.args, self.seed, self.work = args, seed, work
        if args.regime == "scratch" or args.set == TOPICS:
            family_sites = corpora.split_sites(args.half, args.sites, args.train_docs, TEST_DOCS, args.iid)
        else:
            family_sites = fine_tuning_sites(args.half, args.set, args.text)
        self.data = {s.name: s for s in family_sites}
        self.sites = list(self.data)
        self._write_text()
        self.run = cell_runs(self.sites, work / "text", args, seed)
        self.base = work / "base"
        # Scored where the train stage trains (its device: auto, cuda or cpu), as the evaluate stage does.
        import torch

        train_device = next(iter(self.run.values())).pooled.device
        self.device = "cpu" if train_device == "cpu" or not torch.cuda.is_available() else "cuda"
        self._base_model()
        self.manifests = self._tokenize()
        self.test_ids = self._test_ids()

    def _write_text(self) -> None:
        from datasets import Dataset, DatasetDict

        for name, site in self.data.items():
            folder = self.work / "text" / name
            folder.mkdir(parents=True, exist_ok=True)
            for split, texts in (("train", site.train), ("test", site.test)):
                with (folder / f"{split}.jsonl").open("w") as f:
                    f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
            splits = {
                "train": Dataset.from_dict({"text": site.train}),
                "test": Dataset.from_dict({"text": site.test}),
            }
            DatasetDict(splits).save_to_disk(str(self.work / "raw" / name))

    def _base_model(self) -> None:
        from fedtune.download.fetch import download_model

        run = next(iter(self.run.values()))
        if self.args.regime == "scratch":
            download_model(run.model, self.base, [{"path": str(self.work / "raw" / s)} for s in self.sites])
            return
        # A pretrained base does not depend on the cell: converted from its GGUF once, then shared.
        self.base = self.args.work / "smollm2-base"
        if not self.base.is_dir():
            download_model(run.model, self.base)

    def _tokenize(self) -> dict[str, Path]:
        from fedtune.tokenize.shards import ShardJob, tokenize_shard, write_manifest

        run, manifests = next(iter(self.run.values())), {}
        for site in self.sites:
            options = run.sites[site].tokenize
            shards = []
            for k in range(options.shards):
                out = self.work / "tokens" / site / f"train-{k}"
                tokenize_shard(
                    ShardJob(self.work / "raw" / site, "train", k, self.base, out, site=site), options
                )
                shards.append(out)
            manifests[site] = self.work / "tokens" / site / "manifest.json"
            write_manifest(shards, manifests[site])
        return manifests

    def _test_ids(self) -> dict:
        from fedtune.core.models import load_tokenizer
        from fedtune.evaluate.scores import build_stream

        tokenizer = load_tokenizer(self.base)
        add_bos = next(iter(self.run.values())).tokenize.add_bos
        return {s: build_stream(self.data[s].test, tokenizer, add_bos=add_bos).ids for s in self.sites}

    # -- the stages, as the workflow runs them ------------------------------------------------------
    def train(self, site: str, init: Path, manifests, options, plan, out: Path, optimizer=None) -> Path:
        from fedtune.train.loop import TrainJob, train

        job = TrainJob(
            site=site, init=init, manifest=tuple(manifests), checkpoints=out.with_name(out.name + ".ckpt"),
            out=out, optimizer_in=optimizer[0] if optimizer else None,
            optimizer_out=optimizer[1] if optimizer else None,
        )  # fmt: skip
        # train() installs the train stage's SIGTERM/SIGUSR1 handlers (checkpoint, then exit) and leaves
        # them, since its CLI exits next; restored here, or a SIGTERM between two trainings is lost.
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
        try:
            status = train(job, options, plan)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        if status != 0:
            raise SystemExit(f"error: training {site} stopped early")
        return out

    def perplexity(self, model_dir: Path, base: Path | None = None) -> dict[str, float]:
        """Each site's test perplexity of a model folder, or (`base`) of a base model + adapter folder,
        loaded as the evaluate stage loads it."""
        from fedtune.evaluate.scores import load, score

        options = next(iter(self.run.values())).evaluate
        model, _ = load(model_dir, options, self.device, base)
        result = {}
        for site, ids in self.test_ids.items():
            nll, scored, _ = score(
                model, ids, options.max_length, options.stride, options.batch_size, desc=site
            )
            result[site] = math.exp(nll / scored)
        return result

    def pooled(self, factor: float, embedding: float = 1.0, mode: str = "serial") -> dict[str, float]:
        from fedtune.train.loop import RoundPlan

        options = pooled_options(next(iter(self.run.values())), factor, embedding, mode)
        out = self.work / f"{POOLED_MODELS[mode]}-x{factor:g}-emb{embedding:g}"
        self.train("pooled", self.base, [self.manifests[s] for s in self.sites], options, RoundPlan(), out)
        result = self.perplexity(out, base=self.base if options.adapter else None)
        shutil.rmtree(out)
        return result

    def federate(self, strategy: str, factor: float, embedding: float = 1.0) -> dict[str, float]:
        from fedtune.train.loop import RoundPlan

        run = self.run[strategy]
        root = self.work / f"{strategy}-x{factor:g}-emb{embedding:g}"
        start, state = self.base, None
        keep = run.site_optimizer == "keep"
        # federation.site_steps tokens: each site's steps by its share of the tokens (its manifest's).
        trains = run.token_steps({s: manifest_tokens(self.manifests[s]) for s in run.sites})
        # federation.exchange compressed: the sites' updates and the aggregate cross the product's codec.
        exchange = Exchange(run.exchange, root / "exchange") if run.exchange.compressed else None
        for r in range(1, run.rounds + 1):
            plan = RoundPlan(r, run.rounds, run.lr_schedule)
            trained = {}
            for site in run.round_sites(r):
                options = trains[site]
                options = dataclasses.replace(options, lr=options.lr * factor, embedding_lr_factor=embedding)
                moments = None
                if keep:
                    previous = root / "optimizer" / site
                    moments = (previous if previous.is_dir() else None, root / "optimizer-next" / site)
                out = root / f"round-{r}" / site
                trained[site] = self.train(site, start, [self.manifests[site]], options, plan, out, moments)
                if exchange is not None:  # what the merge rebuilds from the site's compressed update
                    trained[site] = exchange.send(r, site, out, start)
                if keep:
                    shutil.rmtree(previous, ignore_errors=True)
                    shutil.move(moments[1], previous)
            merged, state_out = root / f"aggregate-{r}", root / f"state-{r}"
            manifests = {s: self.manifests[s] for s in trained}
            if next(iter(run.sites.values())).train.adapter:
                merge_adapter_round(trained, merged, run.aggregate, manifests, start, state, state_out)
            else:
                merge_round(trained, merged, run.aggregate, manifests, start, state, state_out)
            if exchange is not None:  # the aggregate back, compressed: every site continues from it
                sent = exchange.send(r, "aggregate", merged, start)
                shutil.rmtree(merged)
                merged = sent
            if start != self.base:
                shutil.rmtree(start, ignore_errors=True)  # with an exchange, gone with its round
            if state is not None:
                shutil.rmtree(state)
            shutil.rmtree(root / f"round-{r}")
            start, state = merged, state_out
        result = self.perplexity(start)
        if exchange is not None:
            print(f"  exchange {run.exchange.dtype}: {exchange.sent_fraction():.4f} of the models' bytes "
                  "crossed, both ways", flush=True)  # fmt: skip
        shutil.rmtree(root)
        return result


def model_name(strategy: str, exchange, run=None) -> str:
    """A strategy's name in the CSV: with a compressed exchange (its RunConfig's, as --exchange set it),
    followed by +<dtype>[+ef]; with issue 51's settings (`run`'s), +rw<k> (train.round_warmup_steps)
    and +tok (federation.site_steps tokens)."""
    name = strategy
    if exchange.compressed:
        name = f"{strategy}+{exchange.dtype}" + ("+ef" if exchange.keeps_residual else "")
    if run is not None:
        warmup = next(iter(run.sites.values())).train.round_warmup_steps
        name += f"+rw{warmup}" if warmup else ""
        name += "+tok" if run.site_steps == "tokens" else ""
    return name


def manifest_tokens(manifest: Path) -> int:
    """A site's training tokens, as its manifest counts them (what aggregate.weights tokens reads)."""
    return int(json.loads(manifest.read_text())["splits"]["train"]["tokens_kept"])


def cell_runs(sites: list[str], data: Path, args, seed: int) -> dict:
    """Each strategy's RunConfig for the cell, built by the product from the regime's config."""
    cut = (args.rounds, args.steps, seed)
    exchange = getattr(args, "exchange", None)
    recipe = {
        "round_warmup_steps": getattr(args, "round_warmup_steps", 0),
        "site_steps": getattr(args, "site_steps", "equal"),
        "pooled_sync": "sync" in getattr(args, "pooled_modes", ["serial"]),
    }
    return {
        name: fconfig.build_run_config(
            cell_config(sites, data, *cut, name, args.participation, args.regime, exchange, recipe),
            base_dir=ROOT,
        )
        for name in args.strategies
    }


def fine_tuning_sites(half: str, set_name: str, text_dir: Path) -> list:
    """The sites of one fine-tuning set (federation_sets.FINETUNE), with 40 test documents each (37 for
    the English Debian Reference), each cut to its first TEST_CHARS characters."""
    if set_name not in fine_sets.FINETUNE[half]:
        raise SystemExit(f"error: --sets: {set_name!r} is not a fine-tuning set of the {half} half "
                         f"({', '.join(fine_sets.FINETUNE[half])})")  # fmt: skip
    result = []
    for spec in fine_sets.HALVES[half][set_name]:
        train, test = fine_sets.site_documents(text_dir, spec, half, TEST_DOCS)
        # Test documents cut as the scratch regime cuts them: 40 of them at the CPU's 500 tokens/s.
        test = [text[: corpora.TEST_CHARS] for text in test]
        result.append(corpora.SiteData(spec.key, spec.name, train, test))
    return result


def pooled_options(run, lr_factor: float, embedding_factor: float, mode: str = "serial"):
    """The pooled model's TrainOptions at one grid point: the product's pooled baseline (its token count
    included; `mode` sync: its synchronous data-parallel model, federation.pooled_sync's pooled-sync-lr1x)
    with the lr and the embedding/head lr factor set as federation.pooled_lr_factors and
    pooled_embedding_lr_factors set them."""
    pooled = run.pooled
    if mode == "sync":
        pooled = next(p.options for p in run.pooled_points if p.label == f"{POOLED_MODELS['sync']}-lr1x")
    return dataclasses.replace(pooled, lr=pooled.lr * lr_factor, embedding_lr_factor=float(embedding_factor))


def merge_round(models: dict, out: Path, options, manifests: dict, start: Path, state_in, state_out) -> dict:
    """One round's merge: the aggregate stage's own function (what `python -m fedtune.aggregate` runs),
    with the round's site models, their manifests (token weights), the start model and the server
    state; tests/test_fedbench.py holds its output byte-identical to the CLI's."""
    from fedtune.aggregate.merge import AggregateJob, aggregate

    return aggregate(
        AggregateJob(
            models,
            out,
            manifests=manifests,
            start=start,
            server_state_in=state_in,
            server_state_out=state_out,
        ),
        options,
    )


def merge_adapter_round(
    adapters: dict, out: Path, options, manifests: dict, start: Path, state_in, state_out
) -> dict:
    """One round's merge with adapters (train.adapter), as the workflow makes it: the aggregate stage's
    adapter aggregate (aggregate_adapters: the sites' exact merged update, the server step and its
    state), then the merge of that adapter into the round's start (merge_adapter, what every cluster
    runs), the next round's start model."""
    from fedtune.aggregate.adapters import AdapterAggregateJob, aggregate_adapters, merge_adapter

    adapter = out.with_name(out.name + "-adapter")
    job = AdapterAggregateJob(adapters, adapter, manifests=manifests, start=start,
                              server_state_in=state_in, server_state_out=state_out)  # fmt: skip
    record = aggregate_adapters(job, options)
    merge_adapter(adapter, start, out, max_shard_size=options.max_shard_size)
    shutil.rmtree(adapter)
    return record


def run_cell(args, seed: int) -> list[dict]:
    where = f"{args.regime}-{args.set or TOPICS}-{args.half}-{args.sites}"
    work = args.work / f"{where}{'-iid' if args.iid else ''}-p{args.participation:g}-s{seed}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.time()
    cell = Cell(args, seed, work)
    rows = []
    label = dict(
        regime=args.regime, set=args.set or "", half=args.half, split="iid" if args.iid else "topic",
        sites=len(cell.sites), participation=args.participation, rounds=args.rounds, steps=args.steps,
        device=cell.device, seed=seed,
    )  # fmt: skip
    chosen = _chosen(args)
    pooled = [(POOLED_MODELS[mode], None) for mode in args.pooled_modes]
    models = pooled + [(model_name(s, cell.run[s].exchange, cell.run[s]), s) for s in args.strategies]
    for model, strategy in models:
        if chosen:
            points = [chosen[model] if model in chosen else chosen[strategy or model]]
        elif strategy is None:
            points = [(f, e) for f in args.pooled_lr_factors for e in args.pooled_embedding_factors]
        else:
            points = [(f, e) for f in args.lr_factors for e in args.embedding_factors]
        for factor, embedding in points:
            t0 = time.time()
            if strategy is None:
                ppl = cell.pooled(factor, embedding, "sync" if model == POOLED_MODELS["sync"] else "serial")
            else:
                ppl = cell.federate(strategy, factor, embedding)
            base_lr = next(iter(cell.run.values())).pooled.lr
            for site, value in ppl.items():
                rows.append({**label, "model": model, "lr_factor": factor, "embedding_factor": embedding,
                             "lr": base_lr * factor, "site": site, "topic": cell.data[site].topic,
                             "perplexity": value})  # fmt: skip
            print(f"  seed {seed} {model} x{factor:g} emb x{embedding:g}: geo {_geo(ppl.values()):.2f} "
                  f"({time.time() - t0:.0f} s)", flush=True)  # fmt: skip
            _append(args.out_csv, rows[-len(ppl) :])
    shutil.rmtree(work)
    print(f"cell seed {seed}: {time.time() - started:.0f} s", flush=True)
    return rows


def _geo(values) -> float:
    values = list(values)
    return float(np.exp(np.mean(np.log(values))))


POINT = ["lr_factor", "embedding_factor"]


def read_results(paths) -> pd.DataFrame:
    """The benchmark's CSVs as one frame; rows written before the embedding factor existed read as 1.
    A grid point measured in two CSVs (the same cell, seed, model, point and site: the runs are
    deterministic) counts once, the first CSV's."""
    frames = []
    for path in paths:
        frame = pd.read_csv(path)
        if "embedding_factor" not in frame:
            frame["embedding_factor"] = 1.0
        if "regime" not in frame:  # written before the fine-tuning regimes
            frame["regime"], frame["set"] = "scratch", ""
        if "device" not in frame:  # written before a run on a GPU: every earlier one ran on CPUs
            frame["device"] = "cpu"
        # The scratch regime's empty set name reads back as NaN.
        frame["set"] = frame["set"].astype(object).where(frame["set"].notna(), "")
        frames.append(frame)
    frame = pd.concat(frames, ignore_index=True)
    return frame.drop_duplicates([*CELL, "seed", "model", *POINT, "site"], ignore_index=True)


def chosen_points(frame: pd.DataFrame, regime: str = "scratch") -> dict[str, tuple[float, float]]:
    """Each model's best (lr factor, embedding factor) on the regime's tuning half: the lowest geometric
    mean over its sites, averaged over the cells and seeds."""
    frame = frame[(frame.half == "tuning") & (frame.regime == regime)]
    frame = frame.assign(log=lambda f: np.log(f.perplexity))
    means = frame.groupby(["model", *POINT, "set", "sites", "split", "participation", "seed"])["log"].mean()
    best = means.groupby(["model", *POINT]).mean().reset_index()
    winners = best.loc[best.groupby("model")["log"].idxmin()]
    return {row.model: (float(row.lr_factor), float(row.embedding_factor)) for row in winners.itertuples()}


def _chosen(args) -> dict[str, tuple[float, float]] | None:
    """--chosen: each model's best grid point on the tuning half, from the tuning CSVs."""
    return chosen_points(read_results(args.chosen), args.regime) if args.chosen else None


def _append(path: Path, rows: list[dict]) -> None:
    frame = pd.DataFrame(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(path, mode="a", header=not path.is_file(), index=False)


CELL = ["regime", "set", "half", "split", "sites", "participation", "rounds", "steps", "device"]


def best_factors(frame: pd.DataFrame) -> pd.DataFrame:
    """Each model's best grid point (lr factor, embedding factor) in each cell: the lowest mean log
    perplexity over sites and seeds."""
    frame = frame.assign(log=np.log(frame.perplexity))
    means = frame.groupby([*CELL, "model", *POINT], as_index=False)["log"].mean()
    return means.loc[means.groupby([*CELL, "model"])["log"].idxmin(), [*CELL, "model", *POINT]]


def gaps(frame: pd.DataFrame) -> pd.DataFrame:
    """Per cell, strategy, seed and site: the gap to the best pooled model of the grid (each model at
    its own best point), the gap to the pooled model at the sites' settings (lr x1, embedding x1), and
    the ratio to FedAvg."""
    best = best_factors(frame)
    at_best = frame.merge(best, on=[*CELL, "model", *POINT])
    keys = [*CELL, "seed", "site"]
    pooled = at_best[at_best.model == "pooled"][[*keys, "perplexity", *POINT]]
    pooled = pooled.rename(
        columns={"perplexity": "pooled_best", "lr_factor": "pooled_factor", "embedding_factor": "pooled_emb"}
    )
    x1 = (frame.model == "pooled") & (frame.lr_factor == 1) & (frame.embedding_factor == 1)
    pooled_x1 = frame[x1][[*keys, "perplexity"]]
    fedavg = at_best[at_best.model == "fedavg"][[*keys, "perplexity"]].rename(
        columns={"perplexity": "fedavg"}
    )
    rows = at_best[at_best.model != "pooled"].merge(pooled, on=keys)
    rows = rows.merge(pooled_x1.rename(columns={"perplexity": "pooled_x1"}), on=keys, how="left")
    rows = rows.merge(fedavg, on=keys, how="left")
    # The synchronous data-parallel pooled model (--pooled-modes sync) at its best point, where measured.
    sync = at_best[at_best.model == POOLED_MODELS["sync"]][[*keys, "perplexity"]]
    if len(sync):
        rows = rows.merge(sync.rename(columns={"perplexity": "pooled_sync_best"}), on=keys, how="left")
        rows = rows.assign(gap_sync=rows.perplexity / rows.pooled_sync_best)
    return rows.assign(
        gap=rows.perplexity / rows.pooled_best,
        gap_x1=rows.perplexity / rows.pooled_x1,
        vs_fedavg=rows.perplexity / rows.fedavg,
    )


def summarise(frame: pd.DataFrame) -> str:
    """The Markdown table of yardstick.md: per cell and strategy, over seeds, the geometric mean and the
    worst site's gap (mean over seeds, worst seed), against the best pooled model and the pooled model
    at x1, and the worst site's ratio to FedAvg; `lr` / `emb` the strategy's winning point, `pooled_lr` /
    `pooled_emb` the pooled model's; where the synchronous data-parallel pooled model was measured, its
    geometric mean gap (`geo_sync_*`) and worst site (`site_sync_worst`) too."""
    rows = gaps(frame)
    sync = {}
    if "gap_sync" in rows:
        sync = dict(
            geo_sync=("gap_sync", lambda g: float(np.exp(np.log(g).mean()))), worst_sync=("gap_sync", "max")
        )
    per_seed = rows.groupby([*CELL, "model", "seed"]).agg(
        **sync,
        factor=("lr_factor", "first"), emb=("embedding_factor", "first"),
        pooled_factor=("pooled_factor", "first"),
        pooled_emb=("pooled_emb", "first"),
        geo=("gap", lambda g: float(np.exp(np.log(g).mean()))), worst=("gap", "max"),
        geo_x1=("gap_x1", lambda g: float(np.exp(np.log(g).mean()))),
        vs_fedavg=("vs_fedavg", "max"),
        vs_fedavg_geo=("vs_fedavg", lambda g: float(np.exp(np.log(g).mean()))),
    )  # fmt: skip
    cells = per_seed.groupby([*CELL, "model"]).agg(
        seeds=("geo", "size"), lr=("factor", "first"), emb=("emb", "first"),
        pooled_lr=("pooled_factor", "first"),
        pooled_emb=("pooled_emb", "first"),
        geo_mean=("geo", "mean"), geo_worst=("geo", "max"), site_mean=("worst", "mean"),
        site_worst=("worst", "max"), geo_x1_mean=("geo_x1", "mean"),
        vs_fedavg_geo=("vs_fedavg_geo", "mean"), vs_fedavg_worst=("vs_fedavg", "max"),
        **({"geo_sync_mean": ("geo_sync", "mean"), "geo_sync_worst": ("geo_sync", "max"),
            "site_sync_worst": ("worst_sync", "max")} if sync else {}),
    )  # fmt: skip
    return cells.reset_index().round(3).to_markdown(index=False)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--regime", choices=list(REGIME_CONFIGS), default="scratch")
    parser.add_argument("--half", choices=sorted(corpora.FAMILIES), default="tuning")
    parser.add_argument(
        "--sets",
        nargs="+",
        help="finetune: the fine-tuning sets of the half (default: both), or `topics`: the half's corpus "
        "family split into --sites sites by topic, as the scratch regime splits it",
    )
    parser.add_argument(
        "--text", type=Path, default=ROOT / ".cache" / "fedbench" / "text",
        help="finetune: the sets' text (benchmarks/federation_sets.py prepare)",
    )  # fmt: skip
    parser.add_argument("--sites", type=int, default=2)
    parser.add_argument("--iid", action="store_true", help="the IID control: the same text dealt at random")
    parser.add_argument("--participation", type=float, default=1.0, help="fraction of sites each round")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--lr-factors",
        type=float,
        nargs="*",
        help="the strategies' lr grid (default: the regime's; given empty, the pooled model's grid only)",
    )
    parser.add_argument(
        "--embedding-factors", type=float, nargs="+", default=[1.0],
        help="the strategies' embedding/head lr factors (the sites' train.embedding_lr_factor), crossed with --lr-factors",
    )  # fmt: skip
    parser.add_argument(
        "--pooled-lr-factors", type=float, nargs="*",
        help="the pooled model's lr grid (times the config's lr; default: the regime's; given empty, no "
        "pooled model: its rows come from another CSV)",
    )  # fmt: skip
    parser.add_argument(
        "--pooled-embedding-factors", type=float, nargs="+",
        help="the pooled model's embedding/head lr factors (train.embedding_lr_factor), crossed with its lr "
        "grid (default: the regime's)",
    )  # fmt: skip
    parser.add_argument(
        "--strategies", nargs="+", default=["default", "fedavgm-vocab"], choices=list(STRATEGIES)
    )
    parser.add_argument(
        "--pooled-modes", nargs="+", choices=list(POOLED_MODELS), default=["serial"],
        help="the pooled models: serial (`pooled`, the product's pooled/model: M times a site's steps at "
        "its batch) and/or sync (`pooled-sync`, federation.pooled_sync: M times the batch, a site's steps)",
    )  # fmt: skip
    parser.add_argument(
        "--round-warmup-steps", type=int, default=0,
        help="train.round_warmup_steps for every strategy (rows named <strategy>+rw<k>; default 0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--site-steps", choices=["equal", "tokens"], default="equal",
        help="federation.site_steps for every strategy (tokens: rows named <strategy>+tok)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, help="default: the regime's (4)")
    parser.add_argument("--steps", type=int, help="steps a round (default: the regime's, 4 or 3)")
    parser.add_argument(
        "--chosen", type=Path, nargs="*", help="tuning CSVs: run each model at its best factor"
    )
    parser.add_argument("--work", type=Path, default=ROOT / ".cache" / "yardstick")
    parser.add_argument("--out-csv", type=Path)
    parser.add_argument(
        "--train-docs", type=int, default=TRAIN_DOCS,
        help=f"scratch and --sets topics: training documents per site (default {TRAIN_DOCS}; a corpus "
        "with too few for many sites takes fewer: confirmation.md)",
    )  # fmt: skip
    parser.add_argument(
        "--exchange", type=json.loads,
        help="federation.exchange (JSON) for every strategy, e.g. '{\"dtype\": \"int8\"}': each round's site "
        "updates and aggregate cross the product's codec as files (benchmarks/federation_exchange.py); the "
        "strategies' rows are named <strategy>+<dtype>[+ef]",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--summarise", type=Path, nargs="+", help="print yardstick.md's table of these CSVs")
    args = parser.parse_args(argv)
    if args.summarise:
        print(summarise(read_results(args.summarise)))
        return 0
    if args.out_csv is None:
        parser.error("--out-csv: needed to run cells")
    for option, value in REGIME_DEFAULTS[args.regime].items():
        if getattr(args, option) is None:
            setattr(args, option, value)
    if args.regime == "scratch":
        cells = [None]
    else:
        cells = args.sets or list(fine_sets.FINETUNE[args.half])
        if (args.iid or args.participation < 1) and cells != [TOPICS]:
            parser.error(
                "--iid and --participation: with --sets topics only (the fine-tuning sets are fixed)"
            )
    import torch

    torch.set_num_threads(args.threads)
    for set_name in cells:
        args.set = set_name
        for seed in args.seeds:
            run_cell(args, seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
