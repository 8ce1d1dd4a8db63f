"""SmolLM2-135M on real text through the whole workflow: config/examples/smollm2-it-cs.yaml (or its LoRA
twin, --lora), optionally cut down, run with profiles/local in a scratch folder. Prints JSON: perplexity of
every model on every site (base, site models, aggregate and pooled of the last round), the gap to the
pooled model, the wall time of each job kind (from the jobs' own records), the bytes a site sends per
round, and the whole run's wall time.

    .venv/bin/python benchmarks/smollm2.py --workdir /tmp/smollm2-full              # the example as it is
    .venv/bin/python benchmarks/smollm2.py --workdir /tmp/smollm2-lora --lora
    .venv/bin/python benchmarks/smollm2.py --workdir /tmp/s --rounds 2 --steps 2 --micro-batch 2 \\
        --documents 20 --eval-documents 1                                            # the test's cut

Needs the model: scripts/setup-env --smollm2 (or scripts/fetch-smollm2).

On a GPU machine (issue 41; benchmarks/gpu-checks/workflow.sh), with the settings a user would choose there
(bf16 mixed precision, one GPU per train job, evaluation in bf16 at a larger batch), and the GGUF file
wherever it lies:

    python benchmarks/smollm2.py --workdir /tmp/g --gpu --gguf /path/SmolLM2-135M-Instruct.Q4_1.gguf \
        --snakemake-args="--scheduler greedy"

The JSON then also gives each stage's wall time (from Snakemake's log), train tokens/s (from each train
job's training.json) and evaluate tokens/s (scored tokens over each evaluation's wall time, model load
included)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parent.parent
GGUF = ROOT / ".cache" / "models" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def config_for(args) -> dict:
    name = "smollm2-it-cs-lora" if args.lora else "smollm2-it-cs"
    config = yaml.safe_load((ROOT / "config" / "examples" / f"{name}.yaml").read_text())
    config["model"]["path"] = str(args.gguf)
    for site in config["sites"].values():
        files = site["dataset"]["data_files"]
        for split, path in files.items():
            files[split] = str(ROOT / path)
        if args.documents:
            site["dataset"]["max_documents"] = args.documents
    train = config["train"]
    if args.rounds:
        config["federation"]["rounds"] = args.rounds
    if args.steps:
        train.update(
            max_steps=args.steps, checkpoint_every=args.steps, warmup_steps=min(2, args.steps - 1) or 1
        )
    if args.micro_batch:
        train.update(micro_batch=args.micro_batch, global_batch=args.micro_batch)
    if args.eval_documents:
        config["evaluate"]["max_documents"] = args.eval_documents
    if args.gpu:
        train.update(precision="bf16", gpus_per_node=1, device="cuda")
        config["evaluate"].update(dtype="bfloat16", batch_size=16)
    return config


STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
STARTED = re.compile(r"^(?:local)?rule (\w+):$")
JOBID = re.compile(r"^\s+jobid: (\d+)$")
FINISHED = re.compile(r"^Finished jobid: (\d+) \(Rule: (\w+)\)$")


def stage_times(workdir: Path) -> dict:
    """Each rule's jobs, summed job time and span (first start to last end), from Snakemake's newest log:
    a time stamp line, then `rule NAME:` ... `jobid: N` at a start, `Finished jobid: N (Rule: NAME)` at an
    end."""
    logs = sorted((workdir / ".snakemake" / "log").glob("*.snakemake.log"))
    if not logs:
        return {}
    starts, rules, spans = {}, {}, {}
    stamp = rule = None
    for line in logs[-1].read_text().splitlines():
        if m := STAMP.match(line):
            stamp, rule = time.mktime(time.strptime(m[1], "%a %b %d %H:%M:%S %Y")), None
        elif (m := STARTED.match(line)) and stamp is not None:
            rule = m[1]
        elif (m := JOBID.match(line)) and rule is not None:
            starts[m[1]], rules[m[1]] = stamp, rule
            rule = None
        elif (m := FINISHED.match(line)) and m[1] in starts:
            name, begin = m[2], starts[m[1]]
            jobs, total, first, last = spans.get(name, (0, 0.0, begin, stamp))
            spans[name] = (jobs + 1, total + stamp - begin, min(first, begin), max(last, stamp))
    return {name: {"jobs": jobs, "job_s": round(total), "span_s": round(last - first)}
            for name, (jobs, total, first, last) in spans.items()}  # fmt: skip


def evaluation_files(run: Path) -> list[Path]:
    """Every evaluation's result: the base model's, each round's models' and the pooled model's."""
    return [
        *run.glob("eval/base/*.json"),
        *run.glob("round-*/eval/*/*.json"),
        *run.glob("pooled/eval/*.json"),
    ]


def speeds(run: Path) -> dict:
    """Train tokens/s of each training (its training.json) and evaluate tokens/s of each evaluation."""
    train = [json.loads(p.read_text()).get("tokens_per_s") for p in run.glob("**/model/training.json")]
    evals = [json.loads(p.read_text()) for p in evaluation_files(run)]
    evals = [e for e in evals if e.get("tokens") and e.get("wall_time_s")]
    return {
        "train_tokens_per_s": sorted(round(t) for t in train if t),
        "evaluate_tokens_per_s": sorted(round(e["tokens"] / e["wall_time_s"]) for e in evals),
        "evaluate_device": sorted({e.get("device", "?") for e in evals}),
    }  # fmt: skip


def job_times(run: Path) -> dict:
    times: dict[str, list[float]] = {}
    for path in run.glob("round-*/*/model/training.json"):
        times.setdefault("train (site, round)", []).append(json.loads(path.read_text())["wall_time_s"])
    pooled = run / "pooled" / "model" / "training.json"
    if pooled.is_file():
        times["train (pooled)"] = [json.loads(pooled.read_text())["wall_time_s"]]
    for path in evaluation_files(run):
        times.setdefault("evaluate (model, site)", []).append(json.loads(path.read_text())["wall_time_s"])
    return {kind: {"jobs": len(values), "mean_s": round(sum(values) / len(values), 1), "sum_s": round(sum(values), 1)}
            for kind, values in sorted(times.items())}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--lora", action="store_true", help="config/examples/smollm2-it-cs-lora.yaml")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--micro-batch", type=int, help="blocks per step (micro batch = global batch)")
    parser.add_argument("--documents", type=int, help="documents per site and split (dataset.max_documents)")
    parser.add_argument("--eval-documents", type=int, help="evaluate.max_documents")
    parser.add_argument("--gguf", type=Path, default=GGUF, help="the model's GGUF file")
    parser.add_argument("--gpu", action="store_true", help="bf16, one GPU per train job, bf16 evaluation")
    parser.add_argument("--snakemake-args", default="", help="more arguments for snakemake (one string)")
    args = parser.parse_args(argv)
    if not args.gguf.is_file():
        sys.exit(f"{args.gguf}: missing; run scripts/fetch-smollm2")
    args.workdir.mkdir(parents=True, exist_ok=True)
    config = config_for(args)
    (args.workdir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    bin_dir = Path(sys.executable).parent
    started = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory", str(args.workdir),
         "--configfile", str(args.workdir / "config.yaml"), "--profile", str(ROOT / "profiles" / "local"),
         *shlex.split(args.snakemake_args)],
        check=True, env=dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}"),
    )  # fmt: skip
    wall = time.monotonic() - started
    run = args.workdir / "results" / config["run"]
    table = pd.read_csv(run / "report" / "perplexity.csv")
    rounds = config["federation"]["rounds"]
    last = table[(table["round"] == rounds) | table["model"].isin(["base", "pooled"])]
    sites = list(config["sites"])
    perplexity = {row["model"]: {site: round(row[site], 2) for site in sites} for _, row in last.iterrows()}
    gap = {site: round(perplexity["aggregate"][site] / perplexity["pooled"][site], 3) for site in sites}
    site_model = run / f"round-{rounds}" / sites[0] / "model"
    sent = sum(p.stat().st_size for p in site_model.glob("*.safetensors"))
    base = sum(p.stat().st_size for p in (run / "model" / "base").glob("*.safetensors"))
    print(json.dumps({
        "config": {"lora": args.lora, "rounds": rounds, "train": {k: config["train"][k] for k in
                   ("max_steps", "micro_batch", "global_batch", "lr")}, "documents": args.documents,
                   "eval_documents": config["evaluate"]["max_documents"]},
        "gpu": args.gpu, "perplexity": perplexity, "gap_to_pooled": gap, "jobs": job_times(run),
        "stages": stage_times(args.workdir), **speeds(run),
        "site_sends_bytes": sent, "base_model_bytes": base, "wall_s": round(wall, 1),
    }, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
