"""LoRA adapters on the demo: exact aggregation against factor averaging, in one sitting.

    python benchmarks/adapters.py [--out benchmarks/results/adapters]

Runs config/examples/demo-lora.yaml twice through the real workflow with the local profile, once with
aggregate.adapter_merge exact and once with average_factors (everything else equal, the pooled baseline
trained in the first run only), and prints a Markdown table per site: the base model, each site's adapter
on its own site, the final aggregate of each mode, the pooled model, and the bytes a site sent per round.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "config" / "examples" / "demo-lora.yaml"
MODES = ("exact", "average_factors")


def config_for(mode: str, out: Path) -> dict:
    config = yaml.safe_load(EXAMPLE.read_text())
    for site in config["sites"].values():
        files = site["dataset"]["data_files"]
        site["dataset"]["data_files"] = {split: str(ROOT / path) for split, path in files.items()}
    config["run"] = f"demo-lora-{mode}"
    config["results"] = str(out / "results")
    config["aggregate"]["adapter_merge"] = mode
    # The two ways of combining adapters, under plain FedAvg (average_factors takes no server optimizer).
    config["aggregate"]["server_optimizer"] = {"name": "sgd", "lr": 1.0}
    config["federation"]["pooled_baseline"] = mode == MODES[0]
    return config


def perplexity(path: Path) -> float:
    return json.loads(path.read_text())["perplexity"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "adapters")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs, walls = {}, {}
    for mode in MODES:
        config = config_for(mode, out)
        path = out / f"{mode}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"), "--profile",
             str(ROOT / "profiles" / "local"), "--configfile", str(path), "--directory", str(out)],
            check=True, cwd=out,
        )  # fmt: skip
        walls[mode] = time.perf_counter() - started
        runs[mode] = Path(config["results"]) / config["run"]
    rounds = config["federation"]["rounds"]
    exact_run = runs[MODES[0]]
    print(
        f"\n| site | base | own adapter (round {rounds}) | exact | average_factors | pooled | sent per round |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for site in config["sites"]:
        folder = exact_run / f"round-{rounds}" / site / "model"
        sent = sum(p.stat().st_size for p in folder.iterdir())
        cells = [
            perplexity(exact_run / "eval" / "base" / f"{site}.json"),
            perplexity(exact_run / f"round-{rounds}" / "eval" / site / f"{site}.json"),
            *(perplexity(runs[m] / f"round-{rounds}" / "eval" / "aggregate" / f"{site}.json") for m in MODES),
            perplexity(exact_run / "pooled" / "eval" / f"{site}.json"),
        ]
        print(f"| {site} | " + " | ".join(f"{c:.3f}" for c in cells) + f" | {sent / 1e3:,.1f} kB |")
    print("\nwall time: " + ", ".join(f"{m} {walls[m]:.0f} s" for m in MODES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
