"""Fine-tune a model on one site's tokenized shards, with FSDP2 or DeepSpeed, resumably. The shards say the
task: token blocks train a causal LM, labelled rows (task sequence-classification) a classifier.

    scripts/launch --procs-per-node 2 -- python -m fedtune.train --site alpha \\
        --init results/demo/model/base --manifest results/demo/data/alpha/manifest.json \\
        --options '{"backend": "fsdp", "max_steps": 60}' --dtype float32 \\
        --checkpoints results/demo/round-1/alpha/checkpoints --out results/demo/round-1/alpha/model

Every process runs this file; scripts/launch (or torchrun, or srun) starts one per device and sets
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. `--options` is the train
section of the config (workflow/schemas/train.schema.yaml), merged with the site's overrides.

Exit codes:
    0   trained and exported to --out
    2   a user error (options, data, launch variables); the message on stderr names what to fix
    75  stopped by SIGUSR1 or SIGTERM after writing a checkpoint (EX_TEMPFAIL): run the same command
        again and it resumes from that checkpoint. The train rule retries on it.

The loop (`train` below) reads top to bottom: data, model, resume, then for each optimizer step the
micro batches with gradient accumulation, the step, the log line and the periodic checkpoint."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from fedtune import offline

EXIT_USER_ERROR = 2
EXIT_RETRY = 75  # sysexits.h EX_TEMPFAIL: "temporary failure, the user is invited to retry"
RETRY_MARKER_ENV = "FEDTUNE_RETRY_MARKER"
TRAINING_SUMMARY = "training.json"


def say(line: str) -> None:
    """A progress line on stdout, written in one piece: the ranks share the job's log."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class StopRequest:
    """Remembers SIGUSR1 / SIGTERM (Slurm's warning before the time limit) until the end of the
    current step, where all ranks agree to checkpoint and exit."""

    def __init__(self):
        self.signal: int | None = None
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.signal is None:
            say(f"received {signal.Signals(signum).name}: checkpoint after this step, then exit")
        self.signal = signum


def check_options(options: dict, source: str = "--options") -> dict:
    """Schema validation (defaults filled in) plus what a schema cannot say; ConfigError on a mistake."""
    from fedtune.config import ConfigError, validate_section

    validate_section(options, "train.schema.yaml", source=source)
    if options["offload_params"] and not (options["backend"] == "deepspeed" and options["zero_stage"] == 3):
        raise ConfigError(f"{source}: offload_params: needs backend deepspeed with zero_stage 3")
    if options["offload_optimizer"] and not (
        options["backend"] == "deepspeed" and options["zero_stage"] >= 1
    ):
        raise ConfigError(f"{source}: offload_optimizer: needs backend deepspeed with zero_stage 1, 2 or 3")
    if options["sharding"] in ("hybrid", "hybrid_zero2") and options["backend"] != "fsdp":
        raise ConfigError(
            f"{source}: sharding: {options['sharding']} is an fsdp mode; deepspeed uses zero_stage"
        )
    if options["deepspeed_extra"] and options["backend"] != "deepspeed":
        raise ConfigError(f"{source}: deepspeed_extra: given, but backend is {options['backend']}")
    # Set by scripts/clusters/iris.sh: V100s have no bf16, and emulating it would be slow and silent.
    if options["precision"] == "bf16" and os.environ.get("FEDTUNE_NO_BF16") == "1":
        raise ConfigError(f"{source}: precision: bf16, but this cluster's GPUs have none; use fp16 or fp32")
    return options


def run_identity(options: dict, init: Path, blocks, world_size: int) -> dict:
    """What a checkpoint must share with this run to be resumed by it."""
    return {
        "backend": options["backend"],
        "seed": options["seed"],
        "global_batch": options["global_batch"],
        "init": str(init.resolve()),
        "num_blocks": len(blocks),
        "block_size": blocks.block_size,
        # DeepSpeed's checkpoints are per rank; FSDP's (torch.distributed.checkpoint) reshard on load.
        "world_size": world_size if options["backend"] == "deepspeed" else None,
    }


def peak_memory_mb(device) -> float:
    import resource

    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train(args, options: dict) -> int:
    import warnings

    # DeepSpeed calls these deprecated collectives on every step; one warning per call would bury the log.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )
    from fedtune.blocks import BlockOrder, Blocks, manifest_shards, trained_tokens
    from fedtune.config import ConfigError
    from fedtune.schedule import learning_rate
    from fedtune.tokenize import verify_shard

    stop = StopRequest()
    started = time.time()

    # -- data: cheap to open (memory-mapped), so batch-size mistakes surface before the model loads
    blocks = Blocks(manifest_shards(args.manifest))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    order = BlockOrder(
        len(blocks), options["global_batch"], options["micro_batch"], world_size, options["seed"]
    )
    max_steps = options["max_steps"]
    total_steps = (
        max_steps if max_steps is not None else max(1, int(options["epochs"] * order.steps_per_epoch))
    )
    tokens_per_step = options["global_batch"] * blocks.block_size

    # -- processes, device, model
    import torch

    from fedtune import checkpoint, distributed, loading
    from fedtune.models import CAUSAL_LM, CLASSIFICATION

    task = CLASSIFICATION if blocks.classification else CAUSAL_LM
    job = distributed.start(options["device"])
    if options["precision"] == "bf16" and job.device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"--options: precision: bf16, but {torch.cuda.get_device_name(job.device)} has none; use fp16 or fp32"
        )
    if job.local_rank == 0:
        # Sizes and checksums recorded by tokenize: a corrupted shard is named, not trained on.
        for shard in manifest_shards(args.manifest):
            verify_shard(shard)
    started_by = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "direct start"
    say(f"rank {job.rank}/{job.world_size} on host {job.hostname} ({job.device}, {started_by})")
    torch.manual_seed(options["seed"])
    # Weights read once (fedtune.loading; per rank where a mode replicates them), then sharded.
    backend = loading.load_backend(
        args.init, options, job, order.accumulation, task=task, allow_pickle=args.allow_pickle
    )
    if job.is_main:
        say(
            f"training {args.site}: {len(blocks)} blocks of {blocks.block_size} tokens, "
            f"{total_steps} steps of {options['global_batch']} blocks ({tokens_per_step} tokens) = "
            f"{options['micro_batch']} micro x {job.world_size} ranks x {order.accumulation} accumulation; "
            f"backend {options['backend']}, precision {options['precision']}",
        )

    # -- resume from the newest complete checkpoint, if any
    ckpt_root = Path(args.checkpoints)
    identity = run_identity(options, Path(args.init), blocks, job.world_size)
    step, tokens_trained, wall_before = 0, 0, 0.0
    # One row per step; a list, since a string grown by += is copied whole on every step.
    loss_rows = ["step,epoch,loss,lr,grad_norm,tokens_per_s,peak_mem_mb\n"]
    last = checkpoint.newest(ckpt_root)
    if last is not None:
        saved = checkpoint.read_trainer_state(last)["identity"]
        if saved != identity:
            changed = sorted(k for k in identity if saved.get(k) != identity[k])
            raise checkpoint.CheckpointError(
                f"{last}: written by a different run ({', '.join(changed)} changed); "
                f"delete {ckpt_root} to start over, or restore the settings"
            )
        trainer, loss_log = checkpoint.load(last, backend, job)
        loss_rows = loss_log.splitlines(keepends=True)
        step, tokens_trained, wall_before = trainer["step"], trainer["tokens_trained"], trainer["wall_time_s"]
        if job.is_main:
            say(f"resumed from {last} at step {step} ({trainer['position']})")

    def save_checkpoint():
        trainer = {
            "step": step,
            "position": order.position(step),
            "tokens_trained": tokens_trained,
            "wall_time_s": wall_before + time.time() - started,
            "total_steps": total_steps,
            "world_size": job.world_size,
            "identity": identity,
        }
        loss_log = "".join(loss_rows)
        path = checkpoint.save(ckpt_root, step, backend, trainer, loss_log, job, options["keep_checkpoints"])
        if job.is_main:
            say(f"checkpoint {path}")

    # -- the loop: one iteration is one optimizer step over `global_batch` blocks
    while step < total_steps:
        t0 = time.perf_counter()
        lr = learning_rate(
            step,
            lr=options["lr"],
            total_steps=total_steps,
            warmup_steps=options["warmup_steps"],
            schedule=options["schedule"],
            min_lr_ratio=options["min_lr_ratio"],
        )
        # Each micro batch's loss counts by its share of the step's target tokens, so the step
        # minimises the mean over all tokens of the global batch even when padding varies.
        step_tokens = max(1, trained_tokens(blocks.get(order.global_indices(step))[1]))
        micro_batches = order.micro_batches(step, job.rank)
        loss_sum = torch.zeros((), dtype=torch.float64, device=job.device)
        for m, indices in enumerate(micro_batches):
            input_ids, labels = blocks.get(indices)
            n = trained_tokens(labels)
            weight = n * order.accumulation * job.world_size / step_tokens
            micro_loss = backend.forward_backward(
                input_ids, labels, weight, last=m == len(micro_batches) - 1,
                attention_mask=blocks.attention_mask(indices),
            )  # fmt: skip
            loss_sum += micro_loss.double() * n
        grad_norm = backend.step(lr)
        # One small all-reduce per step: the global loss, and whether any rank was told to stop.
        totals = torch.stack([loss_sum, torch.tensor(float(stop.signal is not None), device=job.device)])
        torch.distributed.all_reduce(totals)
        loss, stop_now = totals[0].item() / step_tokens, totals[1].item() > 0
        step += 1
        tokens_trained += step_tokens
        dt = time.perf_counter() - t0
        peak = peak_memory_mb(job.device)
        # The epoch (1-based) this step's blocks come from, for loss-per-epoch tables.
        epoch = order.position(step - 1)["epoch"] + 1
        loss_rows.append(
            f"{step},{epoch},{loss:.6f},{lr:.6e},{grad_norm:.6f},{tokens_per_step / dt:.1f},{peak:.1f}\n"
        )
        if job.is_main and (step % options["log_every"] == 0 or step == total_steps or step == 1):
            say(
                f"step {step}/{total_steps} | loss {loss:.4f} | lr {lr:.2e} | grad_norm {grad_norm:.3f} | "
                f"{tokens_per_step / dt:,.0f} tok/s | peak {peak:,.0f} MB | "
                f"epoch {step / order.steps_per_epoch:.2f}"
            )
        every = options["checkpoint_every"]
        # The last step is saved too: an export that fails can be redone without training again.
        if stop_now or (every and step % every == 0) or step == total_steps:
            save_checkpoint()
        if stop_now:
            checkpoint.wait()  # the signal's checkpoint is written in the background: finish it
            distributed.stop()
            return EXIT_RETRY

    # -- a probe for tests: logits of the in-memory (sharded) model on the first blocks
    if args.probe_logits:
        probe_rows = order.global_indices(0)[:2]
        probe_ids, _ = blocks.get(probe_rows)
        logits = backend.forward(probe_ids, blocks.attention_mask(probe_rows))
        if job.is_main:
            torch.save({"input_ids": probe_ids, "logits": logits}, args.probe_logits)

    # -- export: a Hugging Face model folder in the configured dtype, plus the run's summary and log
    # Collective: every rank takes part, or (a sweep's summary-only run) none.
    state = None if args.summary_only else backend.full_state_dict()
    sharding = options["sharding"] if options["backend"] == "fsdp" else f"zero{options['zero_stage']}"
    if job.is_main:
        final_loss = float(loss_rows[-1].split(",")[2]) if step else float("nan")
        summary = {
            "site": args.site,
            "task": task,
            "steps": step,
            "epochs": step / order.steps_per_epoch,
            "steps_per_epoch": order.steps_per_epoch,
            "tokens_seen": step * tokens_per_step,
            "tokens_trained": tokens_trained,
            "final_loss": final_loss,
            "wall_time_s": round(wall_before + time.time() - started, 3),
            "world_size": job.world_size,
            "nodes": job.nodes,
            "processes_per_node": job.local_world_size,
            "device": job.device.type,
            "backend": options["backend"],
            "sharding": sharding,
            "precision": options["precision"],
            "dtype": args.dtype,
            "global_batch": options["global_batch"],
            "micro_batch": options["micro_batch"],
            "gradient_accumulation": order.accumulation,
            "block_size": blocks.block_size,
            "blocks": len(blocks),
            "init": str(args.init),
            "options": options,
        }
        export(args, state, summary, "".join(loss_rows), weights=not args.summary_only, task=task)
        say(f"exported {args.out}: {json.dumps({k: summary[k] for k in ('steps', 'final_loss')})}")
    distributed.barrier()
    if options["remove_checkpoints"] and job.is_main:
        checkpoint.remove_all(ckpt_root)
    distributed.stop()
    return 0


def export(args, state: dict, summary: dict, loss_log: str, *, weights: bool = True, task: str) -> None:
    from fedtune.atomic import atomic_dir, write_json, write_text
    from fedtune.models import load_model, load_tokenizer, save_model

    with atomic_dir(args.out) as tmp:
        tmp.chmod(0o755)
        if weights:
            # Rank 0 verified these weights when training started.
            model = load_model(
                args.init, task=task, dtype=args.dtype, allow_pickle=args.allow_pickle, verify=False
            )
            model.load_state_dict(state)
            tokenizer = load_tokenizer(args.init)
            save_model(model, tokenizer, tmp, max_shard_size=summary["options"]["max_shard_size"])
        write_json(tmp / TRAINING_SUMMARY, summary)
        write_text(tmp / "loss.csv", loss_log)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m fedtune.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", required=True, help="site name, recorded in training.json")
    parser.add_argument("--init", required=True, type=Path, help="model folder to start from (HF format)")
    parser.add_argument("--manifest", required=True, type=Path, help="the site's tokenize manifest.json")
    parser.add_argument("--options", required=True, help="train options as JSON (train.schema.yaml)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--checkpoints", required=True, type=Path, help="folder of resumable checkpoints")
    parser.add_argument("--out", required=True, type=Path, help="exported model folder")
    parser.add_argument("--allow-pickle", action="store_true", help="accept .bin weights in --init")
    parser.add_argument(
        "--summary-only",
        action="store_true",
        help="write training.json and loss.csv to --out but no weights (scaling sweeps)",
    )
    parser.add_argument("--probe-logits", type=Path, help=argparse.SUPPRESS)  # for tests
    return parser.parse_args(argv)


# Mistakes a user can fix: reported in one line, exit 2. Looked up among the modules already imported
# (an exception can only come from one that is), so the option checks run without importing torch.
USER_ERRORS = {
    "fedtune.config": "ConfigError",
    "fedtune.blocks": "DataError",
    "fedtune.distributed": "LaunchError",
    "fedtune.models": "ModelError",
    "fedtune.checkpoint": "CheckpointError",
    "fedtune.tokenize": "TokenizeError",
}


def user_errors() -> tuple[type[Exception], ...]:
    loaded = [
        getattr(sys.modules[module], name) for module, name in USER_ERRORS.items() if module in sys.modules
    ]
    return (*loaded, json.JSONDecodeError)


def main(argv=None) -> int:
    offline.enforce()
    args = parse_args(argv)
    try:
        options = check_options(json.loads(args.options))
        code = train(args, options)
    except user_errors() as error:
        where = "--options: not valid JSON: " if isinstance(error, json.JSONDecodeError) else ""
        print(f"error: {where}{error}", file=sys.stderr)
        return EXIT_USER_ERROR
    if code == EXIT_RETRY:
        marker = os.environ.get(RETRY_MARKER_ENV)
        if marker:
            # torchrun reports any failed worker as exit 1; the launcher reads this file to restore 75.
            Path(marker).touch()
    return code


if __name__ == "__main__":
    sys.exit(main())
