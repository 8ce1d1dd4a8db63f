"""How far federation gets from the pooled model on the demo, per strategy, in one sitting.

    python benchmarks/federation.py [--out benchmarks/results/federation] [--rounds 4] [--steps 15]

Each variant is the demo config (config/config.yaml) with the same total training tokens per site
(rounds x steps = the demo's 60 steps of 16 blocks; the last variant, the demo's FedAdam in 6 rounds,
splits the same steps six ways), run through the real workflow with the local
profile; the pooled model (every site's data at once, the same total tokens) is trained once, in the
first variant, and every variant's final aggregate is compared with it. Prints a Markdown table: the
final aggregate's perplexity on each site, the gap (aggregate / pooled) per site, whether the aggregate
beats each site model on the other site, and the wall time of the variant's run.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fedtune.report.build import markdown  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def variants(rounds: int, steps: int) -> dict[str, dict]:
    """name -> (federation, aggregate, train overrides) of each strategy."""
    many = {"rounds": rounds}
    chosen = {
        "fedavg-1-round": {"federation": {"rounds": 1}, "train": {"max_steps": rounds * steps}},
        f"fedavg-{rounds}-rounds": {"federation": many},
        "fedavgm": {
            "federation": many,
            "aggregate": {"server_optimizer": {"name": "fedavgm", "momentum": 0.8}},
        },
        "fedadam": {"federation": many, "aggregate": {"server_optimizer": {"name": "fedadam", "lr": 0.1}}},
        "fedprox": {"federation": many, "train": {"fedprox_mu": 0.1}},
        "ties": {"federation": many, "aggregate": {"method": "ties", "density": 0.5}},
    }
    if rounds * steps % 6 == 0:
        # The demo's own setting (config/config.yaml): the same steps per site in 6 shorter rounds.
        chosen[f"fedadam-6x{rounds * steps // 6}"] = {
            "federation": {"rounds": 6},
            "train": {"max_steps": rounds * steps // 6},
            "aggregate": {"server_optimizer": {"name": "fedadam", "lr": 0.1, "betas": [0.95, 0.99]}},
        }
    return chosen


def config_for(name: str, variant: dict, out: Path, steps: int, pooled: bool) -> dict:
    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    for site in config["sites"].values():
        files = site["dataset"]["data_files"]
        site["dataset"]["data_files"] = {split: str(ROOT / path) for split, path in files.items()}
    config["run"] = name
    config["results"] = str(out / "results")
    config["train"]["max_steps"] = steps
    # Per site, not in the train section: the pooled model trains with the plain train section (a
    # variant's FedProx term would otherwise pull the pooled model towards the base model too).
    for site in config["sites"].values():
        site["train"] = dict(variant.get("train", {}))
    config["federation"] = {**variant["federation"], "pooled_baseline": pooled}
    config["aggregate"] = copy.deepcopy(variant.get("aggregate", {}))
    config["train"]["processes_per_node"] = 1
    config["evaluate"]["intermediate"] = "none"
    return config


def share_data(first: Path, run_dir: Path) -> None:
    """The first variant's data and base model, copied with their times: the next runs skip download
    and tokenize, which every variant would do alike."""
    for part in ("data", "model"):
        shutil.copytree(first / part, run_dir / part, copy_function=shutil.copy2)


def run_variant(config: dict, out: Path) -> float:
    workdir = out / config["run"]
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    started = time.perf_counter()
    subprocess.run(
        [Path(sys.executable).parent / "snakemake", "--snakefile", ROOT / "Snakefile", "--directory", workdir,
         "--configfile", workdir / "config.yaml", "--profile", ROOT / "profiles" / "local"],
        check=True, env=env, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return time.perf_counter() - started


def final_row(run_dir: Path, model: str) -> pd.Series:
    table = pd.read_csv(run_dir / "report" / "perplexity.csv")
    rows = table[table["model"] == model]
    return rows.iloc[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "federation")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=15, help="steps per round")
    parser.add_argument("--only", nargs="*", help="variants to run (default: all)")
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    chosen = variants(args.rounds, args.steps)
    if args.only:
        chosen = {name: chosen[name] for name in args.only}
    rows, pooled, first = [], None, None
    for name, variant in chosen.items():
        config = config_for(name, variant, args.out, args.steps, pooled=pooled is None)
        run_dir = Path(config["results"]) / name
        if first is not None:
            share_data(first, run_dir)
        seconds = run_variant(config, args.out)
        if pooled is None:
            pooled, first = final_row(run_dir, "pooled"), run_dir
        merged, sites = final_row(run_dir, "aggregate"), ["alpha", "beta"]
        table = pd.read_csv(run_dir / "report" / "perplexity.csv")
        last = table[table["round"] == table["round"].max()].set_index("model")
        row = {"variant": name, "wall_s": round(seconds)}
        for site in sites:
            row[f"{site} ppl"] = round(float(merged[site]), 3)
            row[f"{site} gap"] = round(float(merged[site] / pooled[site]), 2)
        # Does the aggregate beat each site model on the other site's test text?
        beats = all(
            last.loc["aggregate", s] < last.loc[o, s] for s, o in [("alpha", "beta"), ("beta", "alpha")]
        )
        row["beats sites elsewhere"] = "yes" if beats else "no"
        rows.append(row)
        print(markdown(pd.DataFrame(rows)), flush=True)
    print(f"\npooled model: alpha {pooled['alpha']:.3f}, beta {pooled['beta']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
