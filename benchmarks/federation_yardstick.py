"""The federation benchmark on the product's own code, against a tuned yardstick (issue 39).

    python benchmarks/federation_yardstick.py --half tuning --sites 4 --seeds 0 1 2
    python benchmarks/federation_yardstick.py --half tuning --sites 4 --iid --seeds 0 1 2
    python benchmarks/federation_yardstick.py --half tuning --sites 16 --participation 0.5 --seeds 0
    python benchmarks/federation_yardstick.py --half confirmation --sites 2 --chosen <tuning CSV>...

Each stage runs as the workflow runs it, in this process, through the function its CLI calls: the
base model from fedtune.download.fetch.download_model (source: init), the sites' shards from
fedtune.tokenize.shards (tokenize_shard, write_manifest), every site's round and the pooled model
from fedtune.train.loop.train (the train stage's step loop, backend, checkpoint and export, token
counts included), the merge from fedtune.aggregate.merge.aggregate (the streamed per-tensor merge,
vocab rows and server optimizer state) and the perplexity from fedtune.evaluate.scores (build_stream,
score). The settings come from config/config.yaml (the demo) through fedtune.core.config, with the
cell's sites, rounds, steps and strategy; nothing here trains or merges by itself.

The yardstick is tuned: the pooled model and every strategy run at the same grid of learning rates
(--lr-factors times the config's lr; the train section has no embedding/head multiplier to sweep), and
each is read at its own best (lowest geometric mean perplexity over the sites). The CSV holds every
grid point (`lr` column); benchmarks/results/federation/yardstick.md summarises. On the confirmation
half nothing is swept: each model runs once at the factor it won on the tuning half (--chosen).

Partial participation (--participation < 1) samples the round's sites with `sample_sites` below, a
stand-in until the product's federation.participation lands: then the aggregate's weights and token
counts take only the sampled sites, as aggregate() does with the folders it is given.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import federation_corpora as corpora  # noqa: E402

from fedtune.core import config as fconfig  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TRAIN_DOCS, TEST_DOCS = 60, 40
BATCH = 8  # blocks of 128 tokens a step (the demo's 16, halved for time)
STRATEGIES = {
    # plain FedAvg: the sites' weighted mean every round, every row with the sites' weights
    "fedavg": {"server_optimizer": {"name": "sgd", "lr": 1.0}, "vocab_rows": "weights"},
    "default": {},  # the schema's aggregate section as it stands
}


def sample_sites(sites: list[str], fraction: float, seed: int, round_: int) -> list[str]:
    """The sites that train in round `round_`: ceil(fraction x sites) of them, drawn without
    replacement, the same draw for the same seed and round (a stand-in for federation.participation)."""
    if fraction >= 1:
        return list(sites)
    k = max(1, math.ceil(fraction * len(sites)))
    return sorted(random.Random(f"{seed}-{round_}").sample(list(sites), k))


def cell_config(sites: list[str], data: Path, rounds: int, steps: int, seed: int, strategy: str) -> dict:
    """The demo's config with the cell's sites (their text in `data`), rounds, steps, seed and strategy."""
    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    template = next(iter(config["sites"].values()))
    config["sites"] = {}
    for site in sites:
        entry = copy.deepcopy(template)
        entry["dataset"]["data_files"] = {s: str(data / site / f"{s}.jsonl") for s in ("train", "test")}
        config["sites"][site] = entry
    config["model"]["seed"] = seed
    # Cut to what 2 cores shared by seven engineers allow (confirmation.md, "Amended"): batches of 8
    # blocks, no periodic checkpoint, disjoint evaluation windows.
    config["train"].update(
        max_steps=steps, seed=seed, remove_checkpoints=True, global_batch=BATCH, micro_batch=BATCH,
        checkpoint_every=0, warmup_steps=min(config["train"]["warmup_steps"], steps),
    )  # fmt: skip
    config["evaluate"]["stride"] = config["evaluate"]["max_length"]
    config["federation"]["rounds"] = rounds
    config["aggregate"] = copy.deepcopy(STRATEGIES[strategy])
    return config


class Cell:
    """One cell: a split of a half's corpus into sites, one seed; its base model, shards and test ids."""

    def __init__(self, args, seed: int, work: Path):
        self.args, self.seed, self.work = args, seed, work
        family_sites = corpora.split_sites(args.half, args.sites, TRAIN_DOCS, TEST_DOCS, args.iid)
        self.data = {s.name: s for s in family_sites}
        self.sites = list(self.data)
        self._write_text()
        self.run = {
            name: fconfig.build_run_config(
                cell_config(self.sites, work / "text", args.rounds, args.steps, seed, name), base_dir=ROOT
            )
            for name in args.strategies
        }
        self.base = work / "base"
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
        download_model(run.model, self.base, [{"path": str(self.work / "raw" / s)} for s in self.sites])

    def _tokenize(self) -> dict[str, Path]:
        from fedtune.tokenize.shards import tokenize_shard, write_manifest

        run, manifests = next(iter(self.run.values())), {}
        for site in self.sites:
            options = run.sites[site].tokenize
            shards = []
            for k in range(options.shards):
                out = self.work / "tokens" / site / f"train-{k}"
                tokenize_shard(self.work / "raw" / site, "train", k, self.base, out, options, site=site)
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
        if train(job, options, plan) != 0:
            raise SystemExit(f"error: training {site} stopped early")
        return out

    def perplexity(self, model_dir: Path) -> dict[str, float]:
        from fedtune.core.models import load_causal_lm
        from fedtune.evaluate.scores import score

        model = load_causal_lm(model_dir)
        model.eval()
        options = next(iter(self.run.values())).evaluate
        result = {}
        for site, ids in self.test_ids.items():
            nll, scored, _ = score(
                model, ids, options.max_length, options.stride, options.batch_size, desc=site
            )
            result[site] = math.exp(nll / scored)
        return result

    def pooled(self, factor: float) -> dict[str, float]:
        run = next(iter(self.run.values()))
        options = dataclasses.replace(run.pooled, lr=run.pooled.lr * factor)
        from fedtune.train.loop import RoundPlan

        out = self.work / f"pooled-x{factor:g}"
        self.train("pooled", self.base, [self.manifests[s] for s in self.sites], options, RoundPlan(), out)
        result = self.perplexity(out)
        shutil.rmtree(out)
        return result

    def federate(self, strategy: str, factor: float) -> dict[str, float]:
        from fedtune.train.loop import RoundPlan

        run = self.run[strategy]
        root = self.work / f"{strategy}-x{factor:g}"
        start, state = self.base, None
        keep = run.site_optimizer == "keep"
        for r in range(1, run.rounds + 1):
            plan = RoundPlan(r, run.rounds, run.lr_schedule)
            trained = {}
            for site in sample_sites(self.sites, self.args.participation, self.seed, r):
                options = run.sites[site].train
                options = dataclasses.replace(options, lr=options.lr * factor)
                moments = None
                if keep:
                    previous = root / "optimizer" / site
                    moments = (previous if previous.is_dir() else None, root / "optimizer-next" / site)
                out = root / f"round-{r}" / site
                trained[site] = self.train(site, start, [self.manifests[site]], options, plan, out, moments)
                if keep:
                    shutil.rmtree(previous, ignore_errors=True)
                    shutil.move(moments[1], previous)
            merged, state_out = root / f"aggregate-{r}", root / f"state-{r}"
            manifests = {s: self.manifests[s] for s in trained}
            merge_round(trained, merged, run.aggregate, manifests, start, state, state_out)
            if start != self.base:
                shutil.rmtree(start)
            if state is not None:
                shutil.rmtree(state)
            shutil.rmtree(root / f"round-{r}")
            start, state = merged, state_out
        result = self.perplexity(start)
        shutil.rmtree(root)
        return result


def merge_round(models: dict, out: Path, options, manifests: dict, start: Path, state_in, state_out) -> dict:
    """One round's merge: the aggregate stage's own function (what `python -m fedtune.aggregate` runs),
    with the round's site models, their manifests (token weights), the start model and the server
    state; tests/test_fedbench.py holds its output byte-identical to the CLI's."""
    from fedtune.aggregate.merge import aggregate

    return aggregate(
        models, out, options, manifests=manifests, start=start,
        server_state_in=state_in, server_state_out=state_out,
    )  # fmt: skip


def run_cell(args, seed: int) -> list[dict]:
    work = args.work / f"{args.half}-{args.sites}{'-iid' if args.iid else ''}-p{args.participation:g}-s{seed}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.time()
    cell = Cell(args, seed, work)
    rows = []
    label = dict(
        half=args.half, split="iid" if args.iid else "topic", sites=args.sites,
        participation=args.participation, rounds=args.rounds, steps=args.steps, seed=seed,
    )  # fmt: skip
    chosen = _chosen(args)
    models = [("pooled", None)] + [(s, s) for s in args.strategies]
    for model, strategy in models:
        factors = [chosen[model]] if chosen else args.lr_factors
        for factor in factors:
            t0 = time.time()
            ppl = cell.pooled(factor) if strategy is None else cell.federate(strategy, factor)
            base_lr = next(iter(cell.run.values())).pooled.lr
            for site, value in ppl.items():
                rows.append({**label, "model": model, "lr_factor": factor, "lr": base_lr * factor,
                             "site": site, "topic": cell.data[site].topic, "perplexity": value})  # fmt: skip
            print(f"  seed {seed} {model} x{factor:g}: geo {_geo(ppl.values()):.2f} ({time.time() - t0:.0f} s)",
                  flush=True)  # fmt: skip
            _append(args.out_csv, rows[-len(ppl) :])
    shutil.rmtree(work)
    print(f"cell seed {seed}: {time.time() - started:.0f} s", flush=True)
    return rows


def _geo(values) -> float:
    values = list(values)
    return float(np.exp(np.mean(np.log(values))))


def _chosen(args) -> dict[str, float] | None:
    """--chosen: each model's best factor on the tuning half (lowest geometric mean over its sites,
    averaged over the seeds), from the tuning CSVs."""
    if not args.chosen:
        return None
    frame = pd.concat([pd.read_csv(p) for p in args.chosen])
    frame = frame[frame.half == "tuning"]
    frame["log"] = np.log(frame.perplexity)
    means = frame.groupby(["model", "lr_factor", "sites", "split", "participation", "seed"])["log"].mean()
    best = means.groupby(["model", "lr_factor"]).mean().reset_index()
    return {m: float(g.sort_values("log").lr_factor.iloc[0]) for m, g in best.groupby("model")}


def _append(path: Path, rows: list[dict]) -> None:
    frame = pd.DataFrame(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(path, mode="a", header=not path.is_file(), index=False)


CELL = ["half", "split", "sites", "participation", "rounds", "steps"]


def best_factors(frame: pd.DataFrame) -> pd.DataFrame:
    """Each model's best lr factor in each cell: the lowest mean log perplexity over sites and seeds."""
    frame = frame.assign(log=np.log(frame.perplexity))
    means = frame.groupby([*CELL, "model", "lr_factor"], as_index=False)["log"].mean()
    return means.loc[means.groupby([*CELL, "model"])["log"].idxmin(), [*CELL, "model", "lr_factor"]]


def gaps(frame: pd.DataFrame) -> pd.DataFrame:
    """Per cell, strategy, seed and site: the gap to the best pooled model of the grid (each model at
    its own best factor), the gap to the pooled model at the sites' lr (x1), and the ratio to FedAvg."""
    best = best_factors(frame)
    at_best = frame.merge(best, on=[*CELL, "model", "lr_factor"])
    keys = [*CELL, "seed", "site"]
    pooled = at_best[at_best.model == "pooled"][[*keys, "perplexity", "lr_factor"]]
    pooled = pooled.rename(columns={"perplexity": "pooled_best", "lr_factor": "pooled_factor"})
    pooled_x1 = frame[(frame.model == "pooled") & (frame.lr_factor == 1)][[*keys, "perplexity"]]
    fedavg = at_best[at_best.model == "fedavg"][[*keys, "perplexity"]].rename(
        columns={"perplexity": "fedavg"}
    )
    rows = at_best[at_best.model != "pooled"].merge(pooled, on=keys)
    rows = rows.merge(pooled_x1.rename(columns={"perplexity": "pooled_x1"}), on=keys, how="left")
    rows = rows.merge(fedavg, on=keys, how="left")
    return rows.assign(
        gap=rows.perplexity / rows.pooled_best,
        gap_x1=rows.perplexity / rows.pooled_x1,
        vs_fedavg=rows.perplexity / rows.fedavg,
    )


def summarise(frame: pd.DataFrame) -> str:
    """The Markdown table of yardstick.md: per cell and strategy, over seeds, the geometric mean and the
    worst site's gap (mean over seeds, worst seed), against the best pooled model and the pooled model
    at x1, and the worst site's ratio to FedAvg."""
    rows = gaps(frame)
    per_seed = rows.groupby([*CELL, "model", "seed"]).agg(
        factor=("lr_factor", "first"), pooled_factor=("pooled_factor", "first"),
        geo=("gap", lambda g: float(np.exp(np.log(g).mean()))), worst=("gap", "max"),
        geo_x1=("gap_x1", lambda g: float(np.exp(np.log(g).mean()))),
        vs_fedavg=("vs_fedavg", "max"),
        vs_fedavg_geo=("vs_fedavg", lambda g: float(np.exp(np.log(g).mean()))),
    )  # fmt: skip
    cells = per_seed.groupby([*CELL, "model"]).agg(
        seeds=("geo", "size"), lr=("factor", "first"), pooled_lr=("pooled_factor", "first"),
        geo_mean=("geo", "mean"), geo_worst=("geo", "max"), site_mean=("worst", "mean"),
        site_worst=("worst", "max"), geo_x1_mean=("geo_x1", "mean"),
        vs_fedavg_geo=("vs_fedavg_geo", "mean"), vs_fedavg_worst=("vs_fedavg", "max"),
    )  # fmt: skip
    return cells.reset_index().round(3).to_markdown(index=False)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--half", choices=sorted(corpora.FAMILIES), default="tuning")
    parser.add_argument("--sites", type=int, default=2)
    parser.add_argument("--iid", action="store_true", help="the IID control: the same text dealt at random")
    parser.add_argument("--participation", type=float, default=1.0, help="fraction of sites each round")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lr-factors", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--chosen", type=Path, nargs="*", help="tuning CSVs: run each model at its best factor"
    )
    parser.add_argument("--work", type=Path, default=ROOT / ".cache" / "yardstick")
    parser.add_argument("--out-csv", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--summarise", type=Path, nargs="+", help="print yardstick.md's table of these CSVs")
    args = parser.parse_args(argv)
    if args.summarise:
        print(summarise(pd.concat([pd.read_csv(p) for p in args.summarise])))
        return 0
    if args.out_csv is None:
        parser.error("--out-csv: needed to run cells")
    import torch

    torch.set_num_threads(args.threads)
    for seed in args.seeds:
        run_cell(args, seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
