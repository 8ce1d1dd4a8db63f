"""Benchmark: training tokens/s of fedtune's trainer beside the Hugging Face Trainer (DDP), on CPU.

    .venv/bin/python benchmarks/training.py [--steps 16] [--measure-after 4] [--runs all]

One tiny Llama (built from config with a byte-level BPE trained on the demo text: no download), one set
of tokenized shards (the tokenize stage's own `tokenize_shard` + `write_manifest` on recipe/bulletin
text, packed blocks of 256 tokens) and the same batch (micro 8 per rank, global 32: 2 ranks x 8 x 2
accumulation), fp32, AdamW (betas 0.9/0.95, eps 1e-8, no weight decay), clip 1.0, fedtune's learning rate
schedule (linear warm-up, cosine to 0.1 x lr; the Trainer gets it as a LambdaLR of fedtune.train.schedule), and
the same number of steps for every run, 2 processes on CPU/gloo with
OMP_NUM_THREADS=1 each:

- fedtune: `scripts/launch --procs-per-node 2 -- python -m fedtune.train ...`, exactly as the train
  rule calls it (options JSON checked against fedtune/schemas/train.schema.yaml), for backend fsdp with
  sharding full and none, and deepspeed with zero_stage 2 and 3; checkpoint_every 0 (fedtune still
  writes one checkpoint after the last step, and exports the model);
- hf_trainer: `torchrun --nproc-per-node 2` of this file's worker mode, `Trainer` with
  `TrainingArguments(use_cpu=True, ddp_backend="gloo", save_strategy="no", ...)`: plain DDP (the
  Trainer's `fsdp=` does not shard on CPU); `trainer.save_model()` at the end, as fedtune exports.

Steady-state tokens/s is measured over the steps after the first `--measure-after` (start-up, first
allocations, DeepSpeed's first step excluded): for fedtune from the per-step `tokens_per_s` column of
loss.csv (each step's duration is tokens_per_step / tokens_per_s), for the Trainer from the times of
`on_step_end` of a callback on rank 0. Wall time is the whole launch, imports and export included.
Prints one JSON object: per run tokens/s, wall time, final loss, and ratios to the Trainer (target of
issue 7: fsdp with sharding none at least equal to the Trainer).

`--checkpoint-blocking [--checkpoint-every 2]` instead runs fsdp full twice, with a synchronous save
(benchmarks/old_paths) and with the default asynchronous save, and reports the seconds the ranks stood still per checkpoint
(fedtune.train.checkpoint logs them; target of issue 15: asynchronous at most 25% of synchronous)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "scripts" / "launch"
SITE = "bench"

RUNS = {
    "hf_trainer": None,
    "fsdp_full": {"backend": "fsdp", "sharding": "full"},
    "fsdp_none": {"backend": "fsdp", "sharding": "none"},
    "deepspeed_zero2": {"backend": "deepspeed", "zero_stage": 2},
    "deepspeed_zero3": {"backend": "deepspeed", "zero_stage": 3},
}


# -- shared settings -------------------------------------------------------------------------------


def train_options(args, extra: dict) -> dict:
    """The train section fedtune gets; the Trainer's arguments are derived from the same values."""
    return {
        **extra,
        "precision": "fp32",
        "device": "cpu",
        "micro_batch": args.micro_batch,
        "global_batch": args.global_batch,
        "max_steps": args.steps,
        "lr": args.lr,
        "warmup_steps": args.warmup_steps,
        "schedule": "cosine",
        "min_lr_ratio": 0.1,
        "weight_decay": 0.0,
        "betas": [0.9, 0.95],
        "grad_clip": 1.0,
        "seed": 1234,
        "checkpoint_every": 0,
        "log_every": 10,
        "processes_per_node": args.procs,
        "cpus_per_process": 1,
    }


def child_env(tmp: Path) -> dict:
    venv_bin = str(Path(sys.executable).parent)
    scratch = tmp / "tmp"
    scratch.mkdir(exist_ok=True)
    return {
        **os.environ,
        "PATH": os.pathsep.join([venv_bin, os.environ.get("PATH", "")]),
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # torchrun's /tmp/torchelastic_* folders and the launcher's marker land here, removed with tmp.
        "TMPDIR": str(scratch),
        "TORCH_EXTENSIONS_DIR": os.environ.get(
            "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "fedtune-torch-extensions")
        ),
    }


# -- data and model --------------------------------------------------------------------------------


def prepare(args, tmp: Path) -> tuple[Path, Path, dict]:
    import random

    from datasets import Dataset, DatasetDict

    from fedtune.core.models import build_model, save_model, train_tokenizer
    from fedtune.download.demo_data import bulletin, recipe
    from fedtune.tokenize.options import TokenizeOptions
    from fedtune.tokenize.shards import ShardJob, tokenize_shard, write_manifest

    rng = random.Random(0)
    texts = [(recipe if i % 2 else bulletin)(rng) for i in range(args.documents)]
    tokenizer = train_tokenizer(texts[:2000], vocab_size=args.vocab)
    architecture = {
        "model_type": "llama",
        "hidden_size": args.hidden,
        "intermediate_size": args.hidden * 8 // 3 // 16 * 16 + 16,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 32,
        "max_position_embeddings": max(1024, args.block_size),
    }
    model = build_model(architecture, tokenizer, seed=0)
    params = sum(p.numel() for p in model.parameters())
    model_dir = tmp / "model" / "base"
    save_model(model, tokenizer, model_dir)
    raw = tmp / "data" / SITE / "raw"
    DatasetDict({"train": Dataset.from_dict({"text": texts})}).save_to_disk(str(raw))
    shards = []
    for k in range(2):
        shard = tmp / "data" / SITE / "train" / f"shard-{k}"
        options = TokenizeOptions.from_mapping({"shards": 2, "block_size": args.block_size})
        tokenize_shard(ShardJob(raw, "train", k, model_dir, shard, site=SITE), options)
        shards.append(shard)
    manifest_path = tmp / "data" / SITE / "manifest.json"
    manifest = write_manifest(shards, manifest_path)
    info = {
        "architecture": architecture,
        "parameters": params,
        "vocab_size": len(tokenizer),
        "documents": args.documents,
        "train_blocks": manifest["splits"]["train"]["blocks"],
        "train_tokens_kept": manifest["splits"]["train"]["tokens_kept"],
    }
    return model_dir, manifest_path, info


# -- fedtune ---------------------------------------------------------------------------------------


def train_command(args, options: dict, model_dir: Path, manifest: Path, run_dir: Path) -> list[str]:
    """scripts/launch running the train CLI on the benchmark's site, into run_dir."""
    return [
        str(LAUNCH), "--procs-per-node", str(args.procs), "--",
        "python", "-m", "fedtune.train", "--site", SITE, "--init", str(model_dir),
        "--manifest", str(manifest), "--options", json.dumps({**options, "dtype": "float32"}),
        "--checkpoints", str(run_dir / "checkpoints"), "--out", str(run_dir / "model"),
    ]  # fmt: skip


def run_fedtune(args, name: str, extra: dict, model_dir: Path, manifest: Path, tmp: Path) -> dict:
    from fedtune.train.options import TrainOptions

    # The train section as the train CLI reads it (checked, defaults filled), as a plain dict here.
    options = TrainOptions.from_mapping(train_options(args, extra)).to_dict()
    run_dir = tmp / "runs" / name
    command = train_command(args, options, model_dir, manifest, run_dir)
    wall = launch(command, tmp, run_dir / "train.log")
    tokens_per_step = args.global_batch * args.block_size
    rows = (run_dir / "model" / "loss.csv").read_text().splitlines()[1:]
    per_step = [float(row.split(",")[4]) for row in rows]
    durations = [tokens_per_step / tps for tps in per_step]
    summary = json.loads((run_dir / "model" / "training.json").read_text())
    return result(args, durations, wall, summary["final_loss"], [float(r.split(",")[1]) for r in rows])


LAST_CPU_S = [0.0]


def cpu_seconds() -> float:
    """User + system CPU time of the finished children (torchrun and its workers)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def old_paths(names: str) -> dict:
    """The environment that brings back replaced code paths (benchmarks/old_paths/sitecustomize.py)."""
    if not names:
        return {}
    return {
        "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks" / "old_paths"), str(ROOT)]),
        "FEDTUNE_OLD_PATHS": names,
    }


def launch(command: list[str], tmp: Path, log: Path, env: dict | None = None) -> float:
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    cpu_before = cpu_seconds()
    with open(log, "w") as out:
        code = subprocess.run(
            command, cwd=ROOT, env={**child_env(tmp), **(env or {})}, stdout=out, stderr=subprocess.STDOUT
        ).returncode
    wall = time.perf_counter() - start
    LAST_CPU_S[0] = cpu_seconds() - cpu_before
    if code != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{' '.join(command[:8])} ... exited {code}; log {log}:\n{tail}")
    return wall


def result(args, durations: list[float], wall: float, final_loss: float, losses: list[float]) -> dict:
    tokens_per_step = args.global_batch * args.block_size
    measured = durations[args.measure_after :]
    return {
        "tokens_per_s": round(len(measured) * tokens_per_step / sum(measured), 1),
        "median_step_tokens_per_s": round(tokens_per_step / statistics.median(measured), 1),
        "measured_steps": len(measured),
        "measured_s": round(sum(measured), 2),
        "first_steps_s": [round(d, 2) for d in durations[: args.measure_after]],
        "wall_s": round(wall, 1),
        "cpu_s": round(LAST_CPU_S[0], 1),
        "final_loss": round(final_loss, 4),
        "loss_at": {str(s): round(losses[s - 1], 4) for s in (1, len(losses) // 2, len(losses))},
    }


# -- the Hugging Face Trainer ----------------------------------------------------------------------


def run_trainer(args, model_dir: Path, manifest: Path, tmp: Path) -> dict:
    run_dir = tmp / "runs" / "hf_trainer"
    worker = {
        "model": str(model_dir),
        "manifest": str(manifest),
        "out": str(run_dir / "model"),
        "timings": str(run_dir / "timings.json"),
        "options": train_options(args, {}),
    }
    command = [
        "torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", str(args.procs),
        str(Path(__file__).resolve()), "--hf-worker", json.dumps(worker),
    ]  # fmt: skip
    wall = launch(command, tmp, run_dir / "train.log")
    timings = json.loads(Path(worker["timings"]).read_text())
    ends = timings["step_end"]
    durations = [b - a for a, b in zip([timings["train_begin"], *ends[:-1]], ends, strict=True)]
    losses = timings["losses"]
    out = result(args, durations, wall, losses[-1], losses)
    # The rates the Trainer used, checked against fedtune's schedule (same options, same function).
    from fedtune.train.schedule import learning_rate

    options = worker["options"]
    expected = [
        learning_rate(s, lr=options["lr"], total_steps=options["max_steps"], warmup_steps=options["warmup_steps"],
                      schedule=options["schedule"], min_lr_ratio=options["min_lr_ratio"])
        for s in range(len(timings["lrs"]))
    ]  # fmt: skip
    out["lr_matches_fedtune"] = all(
        abs(a - b) <= 1e-9 * b for a, b in zip(timings["lrs"], expected, strict=True)
    )
    return out


def hf_worker(spec: dict) -> None:
    """One rank of the Trainer run (started by torchrun)."""
    import torch
    from datasets import concatenate_datasets, load_from_disk
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from fedtune.tokenize.blocks import manifest_shards
    from fedtune.train.schedule import learning_rate

    options = spec["options"]
    world = int(os.environ["WORLD_SIZE"])
    accumulation = options["global_batch"] // (options["micro_batch"] * world)
    data = concatenate_datasets([load_from_disk(str(s)) for s in manifest_shards(spec["manifest"])])
    data = data.with_format("torch")
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    model.config.use_cache = False

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.begin, self.ends = None, []

        def on_train_begin(self, args, state, control, **kwargs):
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

    times = StepTimes()
    training_args = TrainingArguments(
        output_dir=str(Path(spec["out"]).parent / "trainer"),
        use_cpu=True,
        ddp_backend="gloo",
        # The Trainer's default for a PreTrainedModel is True, which walks the graph every step;
        # False is the faster, correct setting here (every parameter gets a gradient).
        ddp_find_unused_parameters=False,
        per_device_train_batch_size=options["micro_batch"],
        gradient_accumulation_steps=accumulation,
        max_steps=options["max_steps"],
        learning_rate=options["lr"],
        adam_beta1=options["betas"][0],
        adam_beta2=options["betas"][1],
        adam_epsilon=1e-8,
        weight_decay=options["weight_decay"],
        max_grad_norm=options["grad_clip"],
        optim="adamw_torch",
        seed=options["seed"],
        save_strategy="no",
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )

    class SameScheduleTrainer(Trainer):
        """fedtune's schedule (warm-up from lr / (warmup + 1), not from 0) as a LambdaLR: same rates."""

        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                    optimizer or self.optimizer, lambda step: rate(step) / options["lr"]
                )
            return self.lr_scheduler

    def rate(step: int) -> float:
        return learning_rate(
            step,
            lr=options["lr"],
            total_steps=options["max_steps"],
            warmup_steps=options["warmup_steps"],
            schedule=options["schedule"],
            min_lr_ratio=options["min_lr_ratio"],
        )

    trainer = SameScheduleTrainer(model=model, args=training_args, train_dataset=data, callbacks=[times])
    trainer.train()
    trainer.save_model(spec["out"])
    if trainer.is_world_process_zero():
        logged = [entry for entry in trainer.state.log_history if "loss" in entry]
        timings = {
            "train_begin": times.begin,
            "step_end": times.ends,
            "losses": [entry["loss"] for entry in logged],
            "lrs": [entry["learning_rate"] for entry in logged],
        }
        Path(spec["timings"]).write_text(json.dumps(timings))


# -- main ------------------------------------------------------------------------------------------


# -- checkpoint blocking time (issue 15: async save) ------------------------------------------------

STAGED = re.compile(r"^checkpoint step (\d+): blocked ([\d.]+) s, writing on")
COMPLETE = re.compile(
    r"^checkpoint step-(\d+): complete \((synchronous|waited for the writer), blocked ([\d.]+) s\)"
)


def blocking_per_checkpoint(log_text: str) -> dict[int, float]:
    """Seconds the ranks stood still for each checkpoint, from rank 0's log lines (fedtune.train.checkpoint):
    synchronous, the whole save; asynchronous, the staging plus any wait for its writer at the next
    save."""
    blocked: dict[int, float] = {}
    for line in log_text.splitlines():
        if m := STAGED.match(line):
            blocked[int(m.group(1))] = blocked.get(int(m.group(1)), 0.0) + float(m.group(2))
        elif m := COMPLETE.match(line):
            blocked[int(m.group(1))] = blocked.get(int(m.group(1)), 0.0) + float(m.group(3))
    return blocked


def run_checkpoint_blocking(args, model_dir: Path, manifest: Path, tmp: Path) -> dict:
    """fsdp full with a checkpoint every --checkpoint-every steps, written synchronously and then
    asynchronously. The run's last checkpoint is waited for in both (nothing may be in flight at the
    end), so the comparison is over the others."""
    from fedtune.train.options import TrainOptions

    out = {}
    for mode in ("sync", "async"):
        extra = {"backend": "fsdp", "sharding": "full"}
        options = TrainOptions.from_mapping(
            train_options(args, extra) | {"checkpoint_every": args.checkpoint_every}
        ).to_dict()
        run_dir = tmp / "runs" / f"checkpoint-{mode}"
        command = train_command(args, options, model_dir, manifest, run_dir)
        wall = launch(
            command, tmp, run_dir / "train.log", env=old_paths("sync-checkpoint" if mode == "sync" else "")
        )
        blocked = blocking_per_checkpoint((run_dir / "train.log").read_text())
        last = max(blocked)
        others = [blocked[s] for s in sorted(blocked) if s != last]
        out[mode] = {
            "blocked_s_per_checkpoint": {str(s): round(v, 3) for s, v in sorted(blocked.items())},
            "mean_blocked_s": round(statistics.mean(others), 3) if others else None,
            "last_checkpoint_s": round(blocked[last], 3),
            "wall_s": round(wall, 1),
            "final_loss": json.loads((run_dir / "model" / "training.json").read_text())["final_loss"],
        }
    sync, asynchronous = out["sync"]["mean_blocked_s"], out["async"]["mean_blocked_s"]
    out["async_over_sync"] = round(asynchronous / sync, 3) if sync and asynchronous is not None else None
    out["target_at_most_0_25"] = out["async_over_sync"] is not None and out["async_over_sync"] <= 0.25
    return out


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps per run")
    parser.add_argument("--measure-after", type=int, default=4, help="steps left out of tokens/s")
    parser.add_argument("--runs", default="all", help=f"comma-separated subset of {','.join(RUNS)}")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--documents", type=int, default=6000, help="demo documents to tokenize")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="repeat every run, order rotated; medians")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (logs, models)")
    parser.add_argument(
        "--checkpoint-blocking",
        action="store_true",
        help="instead of the runs: fsdp full with checkpoints written synchronously, then asynchronously",
    )
    parser.add_argument("--checkpoint-every", type=int, default=2, help="with --checkpoint-blocking")
    parser.add_argument("--hf-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.hf_worker:
        hf_worker(json.loads(args.hf_worker))
        return
    names = list(RUNS) if args.runs == "all" else args.runs.split(",")
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        parser.error(f"--runs: unknown {unknown}; choose from {list(RUNS)}")
    if args.steps <= args.measure_after:
        parser.error("--steps must exceed --measure-after")

    tmp = Path(tempfile.mkdtemp(prefix="fedtune-bench-training-"))
    os.environ.update({k: v for k, v in child_env(tmp).items() if k in ("TMPDIR", "TOKENIZERS_PARALLELISM")})
    started = time.perf_counter()
    load_before = load_average()
    rounds: list[dict[str, dict]] = []
    try:
        # tokenize_shard prints its counts, and DeepSpeed's import a warning, to stdout: keep it for the JSON.
        with contextlib.redirect_stdout(sys.stderr):
            model_dir, manifest, data_info = prepare(args, tmp)
        if args.checkpoint_blocking:
            result = {
                "settings": {"processes": args.procs, "steps": args.steps, **data_info},
                "load_average": {"before": load_before},
                "checkpoint_blocking": run_checkpoint_blocking(args, model_dir, manifest, tmp),
            }
            result["load_average"]["after"] = load_average()
            print(json.dumps(result, indent=2))
            return
        for r in range(args.rounds):
            # Rotated each round, so that no configuration always runs first or last while the load drifts.
            order = names[r % len(names) :] + names[: r % len(names)]
            rounds.append({})
            for name in order:
                print(f"[training benchmark] round {r + 1}: {name} ...", file=sys.stderr, flush=True)
                if name == "hf_trainer":
                    run = run_trainer(args, model_dir, manifest, tmp)
                else:
                    run = run_fedtune(args, name, RUNS[name], model_dir, manifest, tmp)
                run["load_average_after"] = load_average()
                rounds[-1][name] = run
                print(f"[training benchmark] {name}: {json.dumps(run)}", file=sys.stderr, flush=True)
    finally:
        if args.keep:
            print(f"[training benchmark] kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    keys = ("tokens_per_s", "median_step_tokens_per_s", "wall_s", "cpu_s")
    runs = {}
    for name in names:
        per_round = [one[name] for one in rounds]
        runs[name] = {k: statistics.median(run[k] for run in per_round) for k in keys}
        runs[name]["final_loss"] = per_round[0]["final_loss"]
        runs[name]["rounds"] = per_round
    ratios = {}
    if "hf_trainer" in names:
        # Each run against the Trainer of its own round, then the median over rounds.
        ratios = {
            name: {
                k: round(statistics.median(one[name][k] / one["hf_trainer"][k] for one in rounds), 3)
                for k in keys
            }
            for name in names
            if name != "hf_trainer"
        }
    report = {
        "settings": {
            "processes": args.procs,
            "threads_per_process": 1,
            "micro_batch": args.micro_batch,
            "global_batch": args.global_batch,
            "accumulation": args.global_batch // (args.micro_batch * args.procs),
            "block_size": args.block_size,
            "tokens_per_step": args.global_batch * args.block_size,
            "steps": args.steps,
            "measured_after_step": args.measure_after,
            "rounds": args.rounds,
            "precision": "fp32",
            **data_info,
        },
        "load_average": {"before": load_before, "after": load_average()},
        "total_s": round(time.perf_counter() - started, 1),
        "runs": runs,
        "ratio_to_hf_trainer": ratios,
    }
    if "fsdp_none" in ratios:
        report["target_fsdp_none_at_least_trainer"] = ratios["fsdp_none"]["tokens_per_s"] >= 1.0
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
