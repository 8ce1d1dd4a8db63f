"""Benchmark: how long Snakemake takes to plan a large run (dry run), where users feel it most.

    python benchmarks/workflow.py [--sites 4] [--shards 64] [--rounds 3] [--repeat 3]

Writes a config with that many sites, shards per split and federation rounds (sites reuse the demo
data), runs `snakemake -n` on the default target `--repeat` times and prints JSON with the job count
and the wall times. Target: under 5 s for 4 sites x 64 shards x 3 rounds."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sites", type=int, default=4)
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    template = config["sites"]["alpha"]
    for path_key in ("train", "test"):
        template["dataset"]["data_files"][path_key] = str(ROOT / template["dataset"]["data_files"][path_key])
    config["sites"] = {f"site{i}": template for i in range(args.sites)}
    config["tokenize"]["shards"] = args.shards
    config["federation"]["rounds"] = args.rounds
    work = Path(tempfile.mkdtemp(prefix="fedtune-bench-workflow-"))
    (work / "config.yaml").write_text(yaml.safe_dump(config))

    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    command = [str(bin_dir / "snakemake"), "-n", "--snakefile", str(ROOT / "Snakefile"), "--directory", str(work),
               "--configfile", str(work / "config.yaml"), "--profile", str(ROOT / "profiles" / "local"), "--quiet", "rules"]  # fmt: skip
    times, output = [], ""
    for _ in range(args.repeat):
        start = time.perf_counter()
        result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=work)
        times.append(time.perf_counter() - start)
        if result.returncode != 0:
            sys.exit(result.stderr[-3000:])
        output = result.stdout
    jobs = 0
    for line in output.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "total" and parts[1].isdigit():
            jobs = int(parts[1])
    print(json.dumps({"sites": args.sites, "shards": args.shards, "rounds": args.rounds, "jobs": jobs,
                      "seconds": [round(t, 2) for t in times], "median_s": round(statistics.median(times), 2)}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
