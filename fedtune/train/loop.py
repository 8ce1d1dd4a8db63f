"""Fine-tune a model on one site's tokenized shards, with FSDP2 or DeepSpeed, resumably. The shards say the
task: token blocks train a causal LM, labelled rows (task sequence-classification) a classifier.

    scripts/launch --procs-per-node 2 -- python -m fedtune.train --site alpha \\
        --init results/demo/model/base --manifest results/demo/data/alpha/manifest.json \\
        --options '{"backend": "fsdp", "max_steps": 60, "dtype": "float32"}' \\
        --checkpoints results/demo/round-1/alpha/checkpoints --out results/demo/round-1/alpha/model

Every process runs this file; scripts/launch (or torchrun, or srun) starts one per device and sets
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. `--options` is the train
section of the config (fedtune/schemas/train.schema.yaml), merged with the site's overrides, with what
the job reads of the run beside it (the exported dtype, allow_pickle, the federation's rounds and
lr_schedule, token_counts): the JSON form of fedtune.train.options.TrainOptions. With its `adapter` set,
a LoRA adapter (peft) trains on the frozen model and --out is a PEFT adapter folder
(fedtune.core.adapters).

Exit codes:
    0   trained and exported to --out, or restored it from this job's export record (the same job run
        again after its export: fedtune.train.export_record)
    2   a user error (options, data, launch variables), a NaN or infinite loss or gradient norm (not
        stepped on), or another live job training into --checkpoints (fedtune.train.job_lock); the
        message on stderr names what to fix
    75  stopped by SIGUSR1, SIGTERM or SIGINT after writing a checkpoint (EX_TEMPFAIL): run the same command
        again and it resumes from that checkpoint. scripts/launch requeues the Slurm job on it (or,
        where Slurm refuses the requeue, the rule retries).

`train` below reads top to bottom: set up (data, processes, model, backend), resume, then for each
optimizer step the micro batches with gradient accumulation, the step, the log line and the periodic
checkpoint; last the export."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from fedtune.core import adapters, cli, token_counts, tracking
from fedtune.core.atomic import atomic_dir, write_json, write_text
from fedtune.core.checksums import SOURCE_RECORD
from fedtune.core.models import load_model, load_tokenizer, save_model
from fedtune.core.options import CAUSAL_LM, CLASSIFICATION, ConfigError, UserError
from fedtune.core.tracking_options import TrackingOptions
from fedtune.tokenize.blocks import BlockOrder, Blocks, manifest_shards, manifest_tokens, trained_tokens
from fedtune.tokenize.shards import verify_shard
from fedtune.train import checkpoint, distributed, export_record, job_lock, loading
from fedtune.train.options import TrainOptions
from fedtune.train.schedule import learning_rate

if TYPE_CHECKING:
    from fedtune.train.backends import Backend

EXIT_RETRY = 75  # sysexits.h EX_TEMPFAIL: "temporary failure, the user is invited to retry"
RETRY_MARKER_ENV = "FEDTUNE_RETRY_MARKER"
TRAINING_SUMMARY = "training.json"
LOSS_HEADER = tracking.LOSS_HEADER + "\n"


def say(line: str) -> None:
    """A progress line on stdout, written in one piece: the ranks share the job's log."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class StopRequest:
    """Remembers SIGUSR1 / SIGTERM (Slurm's warning before the time limit) and SIGINT (Ctrl-C in the
    terminal of a local run, which reaches every process of its group) until the end of the current
    step, where all ranks agree to checkpoint and exit 75: an interrupted run resumes where it stopped."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal: int | None = None
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.signal is None:
            say(f"received {signal.Signals(signum).name}: checkpoint after this step, then exit")
        self.signal = signum


@dataclass
class TrainingProgress:
    """What a resumed run needs beyond the model and optimizer: saved in every checkpoint."""

    step: int = 0
    tokens_trained: int = 0
    wall_time_s: float = 0.0
    # One row per step; a list, since a string grown by += is copied whole on every step.
    loss_rows: list[str] = field(default_factory=lambda: [LOSS_HEADER])

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_trained": self.tokens_trained, "wall_time_s": self.wall_time_s}

    def load_state_dict(self, state: dict, loss_log: str) -> None:
        self.step, self.tokens_trained = state["step"], state["tokens_trained"]
        self.wall_time_s = state["wall_time_s"]
        self.loss_rows = loss_log.splitlines(keepends=True)

    @property
    def loss_log(self) -> str:
        return "".join(self.loss_rows)

    @property
    def last_loss(self) -> float:
        return float(self.loss_rows[-1].split(",")[2]) if self.step else float("nan")

    def step_time_s(self, tokens_per_step: int) -> float:
        """Seconds spent in training steps (resumed ones included): each loss row's tokens/s is the step's
        tokens over that step's seconds. The job's wall time adds start-up, loading and export."""
        column = LOSS_HEADER.strip().split(",").index("tokens_per_s")
        return sum(tokens_per_step / float(row.split(",")[column]) for row in self.loss_rows[1:])


@dataclass(frozen=True)
class RoundPlan:
    """Where this job sits in the federation. Round r trains steps (r-1)S ... rS-1 of the site's data
    order (S steps a round), so R rounds see the blocks one run of RS steps sees. The learning rate
    follows one schedule over all R rounds (continue) or starts over each round (restart)."""

    round: int = 1
    rounds: int = 1
    lr_schedule: str = "continue"

    def first_step(self, steps: int) -> int:
        return (self.round - 1) * steps

    def learning_rate(self, step: int, steps: int, options: TrainOptions) -> float:
        """The rate of this round's step `step` (0-based) of `steps`, with the round's ramp
        (train.round_warmup_steps) over its first steps."""
        round_step = step
        if self.lr_schedule == "continue":
            step, steps = self.first_step(steps) + step, self.rounds * steps
        return learning_rate(
            step, lr=options.lr, total_steps=steps, warmup_steps=options.warmup_steps,
            schedule=options.schedule, min_lr_ratio=options.min_lr_ratio,
            round_step=round_step, round_warmup_steps=options.round_warmup_steps,
        )  # fmt: skip


@dataclass(frozen=True)
class TrainJob:
    """The files of one train job (the CLI's paths and per-job facts, apart from the options and the round)."""

    site: str
    init: Path
    manifest: tuple[Path, ...]
    checkpoints: Path
    out: Path
    summary_only: bool = False
    optimizer_in: Path | None = None
    optimizer_out: Path | None = None
    tracking: dict | None = None  # the config's tracking section, checked (None: not tracked)
    run: str | None = None
    # federation.site_steps tokens: every site's training tokens and steps a round (token_steps).
    site_steps: dict | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainJob:
        return cls(
            site=args.site, init=args.init, manifest=tuple(args.manifest), checkpoints=args.checkpoints,
            out=args.out, summary_only=args.summary_only,
            optimizer_in=args.optimizer_in, optimizer_out=args.optimizer_out,
            tracking=(
                tracking.check_available(TrackingOptions.from_json(args.tracking, source="--tracking"))
                if args.tracking
                else None
            ),
            run=args.run_name,
        )  # fmt: skip


@dataclass
class Setup:
    """Everything the loop reads and nothing it changes."""

    args: TrainJob
    options: TrainOptions
    plan: RoundPlan
    blocks: Blocks
    order: BlockOrder
    total_steps: int  # this round's
    task: str
    job: object  # fedtune.train.distributed.Job
    backend: Backend
    identity: dict

    @property
    def tokens_per_step(self) -> int:
        return self.options.global_batch * self.blocks.block_size

    @property
    def first_step(self) -> int:
        """This round's first step in the site's data order."""
        return self.plan.first_step(self.total_steps)


def run_identity(options: TrainOptions, plan: RoundPlan, init: Path, blocks: Blocks, world_size: int) -> dict:
    """What a checkpoint must share with this run to be resumed by it."""
    return {
        "round": plan.round,
        "rounds": plan.rounds,
        "lr_schedule": plan.lr_schedule,
        "backend": options.backend,
        "seed": options.seed,
        "global_batch": options.global_batch,
        "init": str(init.resolve()),
        "num_blocks": len(blocks),
        "block_size": blocks.block_size,
        # DeepSpeed's checkpoints are per rank; FSDP's (torch.distributed.checkpoint) reshard on load.
        "world_size": world_size if options.backend == "deepspeed" else None,
        "adapter": options.to_dict()["adapter"],
    }


def peak_memory_mb(device) -> float:
    import resource

    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def setup(args: TrainJob, options: TrainOptions, plan: RoundPlan) -> Setup:
    import torch

    # Data first: cheap to open (memory-mapped), so batch-size mistakes surface before the model loads.
    shards = [shard for manifest in args.manifest for shard in manifest_shards(manifest)]
    blocks = Blocks(shards)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    order = BlockOrder(len(blocks), options.global_batch, options.micro_batch, world_size, options.seed)
    task = CLASSIFICATION if blocks.classification else CAUSAL_LM

    job = distributed.start(options.device)
    if options.adapter:
        adapters.check_quantize(options.adapter, job.device)
    if options.precision == "bf16" and job.device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"--options: precision: bf16, but {torch.cuda.get_device_name(job.device)} has none; use fp16 or fp32"
        )
    if job.local_rank == 0:
        # Sizes and checksums recorded by tokenize: a corrupted shard is named, not trained on.
        for shard in shards:
            verify_shard(shard)
    started_by = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "direct start"
    say(f"rank {job.rank}/{job.world_size} on host {job.hostname} ({job.device}, {started_by})")
    torch.manual_seed(options.seed)
    # Weights read once (fedtune.train.loading; per rank where a mode replicates them), then sharded.
    backend = loading.load_backend(
        args.init, options, job, order.accumulation, task=task, allow_pickle=options.allow_pickle
    )
    if args.optimizer_in:
        backend.load_optimizer(args.optimizer_in)
    return Setup(
        args=args,
        options=options,
        plan=plan,
        blocks=blocks,
        order=order,
        total_steps=options.total_steps(order.steps_per_epoch),
        task=task,
        job=job,
        backend=backend,
        identity=run_identity(options, plan, args.init, blocks, job.world_size),
    )


def resume(run: Setup, progress: TrainingProgress) -> None:
    """Continue from the newest complete checkpoint, if there is one of this run."""

    root = run.args.checkpoints
    last = checkpoint.newest(root)
    if last is None:
        return
    saved = checkpoint.read_trainer_state(last)["identity"]
    if saved != run.identity:
        changed = sorted(k for k in run.identity if saved.get(k) != run.identity[k])
        raise checkpoint.CheckpointError(
            f"{last}: written by a different run ({', '.join(changed)} changed); "
            f"delete {root} to start over, or restore the settings"
        )
    trainer, loss_log = checkpoint.load(last, run.backend, run.job)
    progress.load_state_dict(trainer, loss_log)
    if run.job.is_main:
        say(f"resumed from {last} at step {progress.step} ({trainer['position']})")


def save_checkpoint(run: Setup, progress: TrainingProgress, started: float) -> None:

    trainer = {
        **progress.state_dict(),
        "wall_time_s": progress.wall_time_s + time.time() - started,
        "position": run.order.position(run.first_step + progress.step),
        "total_steps": run.total_steps,
        "world_size": run.job.world_size,
        "identity": run.identity,
    }
    path = checkpoint.save(
        run.args.checkpoints, progress.step, run.backend, trainer, progress.loss_log, run.job,
        run.options.keep_checkpoints,
    )  # fmt: skip
    if run.job.is_main:
        say(f"checkpoint {path}")


class NonFiniteError(UserError, ArithmeticError):
    """A step's loss or gradient norm was NaN or infinite (bf16, fp32): the optimizer did not step on it."""


def check_finite(step: int, lr: float, loss: float, grad_norm: float | None = None) -> None:
    """Stop on a non-finite loss (before the optimizer step) or gradient norm (whose step the backend
    skipped: fedtune.train.backends; fp16's loss scaler skips such steps and goes on instead)."""
    what = "loss" if not math.isfinite(loss) else "gradient norm" if grad_norm is not None else None
    if what is None or (what == "gradient norm" and math.isfinite(grad_norm)):
        return
    raise NonFiniteError(
        f"step {step}: the {what} is {loss if what == 'loss' else grad_norm} (lr {lr:.3e}); the optimizer "
        f"did not step on it, and the training stops: the weights and checkpoints are those of the steps "
        f"before. A diverging run: lower train.lr (or raise warmup_steps, set grad_clip), or check the "
        f"site's data; the run resumes from its newest checkpoint"
    )


def train_step(run: Setup, step: int, lr: float, stop: StopRequest) -> tuple[float, float, int, bool]:
    """One optimizer step over the `global_batch` blocks at position `step` of the data order:
    (loss, grad norm, target tokens, stop now). A NaN or infinite loss or gradient norm raises
    NonFiniteError without stepping the optimizer (bf16 and fp32; fp16's loss scaler skips the step)."""
    import torch

    blocks, order, job, backend = run.blocks, run.order, run.job, run.backend
    # Each micro batch's loss counts by its share of the step's target tokens, so the step minimises
    # the mean over all tokens of the global batch even when padding varies.
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
    # One small all-reduce per step, before the optimizer step: the global loss, which must be finite
    # to step on, and whether any rank was told to stop.
    stopping = torch.tensor(float(stop.signal is not None), device=job.device)
    totals = torch.stack([loss_sum, stopping])
    torch.distributed.all_reduce(totals)
    loss, stopped = totals.tolist()
    loss /= step_tokens
    if not math.isfinite(loss):
        check_finite(step - run.first_step + 1, lr, loss)
    # Every rank holds the same norm (FSDP's full tensor, DDP's and DeepSpeed ZeRO-0's replicas, DeepSpeed's
    # global norm); a non-finite one was not stepped on (the backend, or DeepSpeed's optimizer, skips it).
    reported = backend.step(lr)
    norm = math.nan if reported is None else float(reported)
    if reported is not None and run.options.precision != "fp16":
        check_finite(step - run.first_step + 1, lr, loss, norm)
    return loss, norm, step_tokens, stopped > 0


def train(
    args: TrainJob, options: TrainOptions, plan: RoundPlan = RoundPlan(), identity: dict | None = None
) -> int:
    """Train and export (0), or stop after a signal's checkpoint (75). With `identity` (the job's,
    fedtune.train.export_record), rank 0 records the export for a rerun of the same job to restore."""
    import warnings

    # DeepSpeed calls these deprecated collectives on every step; one warning per call would bury the log.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )
    stop = StopRequest()
    started = time.time()
    run = setup(args, options, plan)
    job, order, total, first = run.job, run.order, run.total_steps, run.first_step
    if job.is_main:
        say(
            f"training {args.site}, round {plan.round} of {plan.rounds} from step {first} of its data: "
            f"{len(run.blocks)} blocks of {run.blocks.block_size} tokens, "
            f"{total} steps of {options.global_batch} blocks ({run.tokens_per_step} tokens) = "
            f"{options.micro_batch} micro x {job.world_size} ranks x {order.accumulation} accumulation; "
            f"backend {options.backend}, precision {options.precision}",
        )
    progress = TrainingProgress()
    resume(run, progress)
    tracker = tracking.Tracker()
    if job.is_main and args.tracking:
        where = tracking.TrackedRun(args.run or "fedtune", plan.round, args.site)
        tracker = tracking.start(args.tracking, where, "train", options.to_dict())

    while progress.step < total:
        t0 = time.perf_counter()
        lr = plan.learning_rate(progress.step, total, options)
        try:
            loss, grad_norm, step_tokens, stop_now = train_step(run, first + progress.step, lr, stop)
        except NonFiniteError:
            checkpoint.wait()  # a periodic checkpoint still being written: finish it
            raise
        progress.step += 1
        progress.tokens_trained += step_tokens
        step, dt, peak = progress.step, time.perf_counter() - t0, peak_memory_mb(job.device)
        tokens_per_s = run.tokens_per_step / dt
        # The epoch (1-based) this step's blocks come from, for loss-per-epoch tables.
        epoch = order.position(first + step - 1)["epoch"] + 1
        progress.loss_rows.append(
            f"{step},{epoch},{loss:.6f},{lr:.6e},{grad_norm:.6f},{tokens_per_s:.1f},{peak:.1f}\n"
        )
        if job.is_main:
            # The federation's step, so that the rounds' curves continue one another.
            tracker.log(first + step, tracking.loss_row_metrics(progress.loss_rows[-1], LOSS_HEADER)[1])
        if job.is_main and (step % options.log_every == 0 or step == total or step == 1):
            say(
                f"step {step}/{total} | loss {loss:.4f} | lr {lr:.2e} | grad_norm {grad_norm:.3f} | "
                f"{tokens_per_s:,.0f} tok/s | peak {peak:,.0f} MB | epoch {(first + step) / order.steps_per_epoch:.2f}"
            )
        every = options.checkpoint_every
        # The last step is saved too: an export that fails can be redone without training again.
        if stop_now or (every and step % every == 0) or step == total:
            save_checkpoint(run, progress, started)
        if stop_now:
            # The launcher repeats SIGUSR1 until the processes exit; Python's shutdown puts back the
            # default action (death by SIGUSR1, not exit 75) for signals it handled, so a repeat in that
            # window would lose the time-limit stop: the stop is decided, ignore any further warning.
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
            checkpoint.wait()  # the signal's checkpoint is written in the background: finish it
            tracker.close()
            distributed.stop()
            return EXIT_RETRY

    record = export(run, progress, started)
    if record is not None:
        tracker.log_summary(record)
    tracker.close()
    if args.optimizer_out:
        # Collective: the site's optimizer state for its next round (federation.site_optimizer keep).
        run.backend.save_optimizer(args.optimizer_out)
    distributed.barrier()
    if identity is not None and job.is_main:
        # After every output is complete: a job killed before this line resumes at its last step and
        # exports again.
        kept = export_record.write(args, identity, record)
        if kept is not None:
            say(f"export recorded in {kept}: a rerun of this job restores it instead of training")
    if options.remove_checkpoints and job.is_main:
        checkpoint.remove_all(args.checkpoints)
    distributed.stop()
    return 0


def base_identity(init: Path) -> dict | None:
    """The identity of a downloaded base model (its fedtune-source.json: one hash of its files, and the hub
    commit); None for a start model that no download wrote (a previous round's aggregate)."""
    try:
        record = json.loads((Path(init) / SOURCE_RECORD).read_text())
    except (OSError, ValueError):
        return None
    if "identity" not in record:
        return None
    return {"identity": record["identity"], "commit": record.get("commit")}


def summary(run: Setup, progress: TrainingProgress, started: float) -> dict:
    args, options, job, order = run.args, run.options, run.job, run.order
    step_time = progress.step_time_s(run.tokens_per_step)
    return {
        "site": args.site,
        "task": run.task,
        "round": run.plan.round,
        "rounds": run.plan.rounds,
        "lr_schedule": run.plan.lr_schedule,
        "first_step": run.first_step,
        "steps": progress.step,
        "epochs": progress.step / order.steps_per_epoch,
        "steps_per_epoch": order.steps_per_epoch,
        "tokens_seen": progress.step * run.tokens_per_step,
        "tokens_trained": progress.tokens_trained,
        "final_loss": progress.last_loss,
        "wall_time_s": round(progress.wall_time_s + time.time() - started, 3),
        # Training speed: tokens per second of the steps alone (what the log lines and status show per
        # step), not of the wall time, which for a short job is mostly start-up.
        "step_time_s": round(step_time, 3),
        "tokens_per_s": round(progress.step * run.tokens_per_step / step_time, 1) if step_time else None,
        "world_size": job.world_size,
        "nodes": job.nodes,
        "processes_per_node": job.local_world_size,
        "device": job.device.type,
        "backend": options.backend,
        "sharding": options.sharding_label,
        "precision": options.precision,
        "dtype": options.dtype,
        "global_batch": options.global_batch,
        "micro_batch": options.micro_batch,
        "gradient_accumulation": order.accumulation,
        "block_size": run.blocks.block_size,
        "blocks": len(run.blocks),
        "init": str(args.init),
        # The downloaded base this model descends from (round 1), for the aggregation to compare.
        "base": base_identity(args.init),
        "manifests": [str(m) for m in args.manifest],
        "optimizer_state": "kept" if args.optimizer_in else "new",
        # federation.site_steps tokens: how this job's steps were shared out (absent: the options' own).
        **({"site_steps": args.site_steps} if args.site_steps else {}),
        "options": options.to_dict(),
    }


def export(run: Setup, progress: TrainingProgress, started: float) -> dict | None:
    """A Hugging Face model folder in --dtype, plus training.json and loss.csv (a sweep's summary-only
    run: no weights). Collective: every rank gathers the weights, rank 0 writes."""

    args = run.args
    state = None if args.summary_only else run.backend.full_state_dict()
    if not run.job.is_main:
        return None
    record = summary(run, progress, started)
    # The start model it trained from and this attempt, which cross with the model: the merge refuses a
    # site model of another start than its round's (fedtune.aggregate.merge.check_same_start).
    from fedtune.core.exchange import origin

    record.update(origin(args.init))
    with atomic_dir(args.out) as tmp:
        tmp.chmod(0o755)
        if run.options.adapter and not args.summary_only:
            # The PEFT folder: the trainable tensors only; the base is the round's start model.
            adapters.write_adapter(run.backend.module, state, tmp, run.options.dtype)
        elif not args.summary_only:
            # Rank 0 verified these weights when training started.
            model = load_model(
                args.init,
                task=run.task,
                dtype=run.options.dtype,
                allow_pickle=run.options.allow_pickle,
                verify=False,
            )
            model.load_state_dict(state)
            save_model(model, load_tokenizer(args.init), tmp, max_shard_size=run.options.max_shard_size)
            if run.task == CAUSAL_LM and run.options.token_counts:
                write_token_counts(run, progress, model, tmp)
        write_json(tmp / TRAINING_SUMMARY, record)
        write_text(tmp / "loss.csv", progress.loss_log)
    say(f"exported {args.out}: {json.dumps({k: record[k] for k in ('steps', 'final_loss')})}")
    return record


def write_token_counts(run: Setup, progress: TrainingProgress, model, folder: Path) -> None:
    """token_counts.json: how often the round trained on each token id (every rank's blocks), for
    the aggregate's vocab rows (fedtune.core.token_counts)."""
    steps = range(run.first_step, run.first_step + progress.step)
    batches = (run.blocks.get(run.order.global_indices(step))[0] for step in steps)
    counts = token_counts.count(batches, model.get_input_embeddings().num_embeddings)
    tensors = token_counts.vocab_tensors(model)
    token_counts.write(folder, counts, tensors, first_step=run.first_step, steps=progress.step)


def parse_args(argv=None):
    parser = cli.parser("fedtune.train.loop", __doc__.split("\n\n")[0])
    parser.add_argument("--site", required=True, help="site name, recorded in training.json")
    parser.add_argument("--init", required=True, type=Path, help="model folder to start from (HF format)")
    parser.add_argument(
        "--manifest", required=True, type=Path, nargs="+",
        help="the site's tokenize manifest.json (several: their blocks train as one data set, the pooled baseline)",
    )  # fmt: skip
    parser.add_argument("--options", required=True, help="train options as JSON (train.schema.yaml)")
    parser.add_argument("--checkpoints", required=True, type=Path, help="folder of resumable checkpoints")
    cli.add_out(parser, "exported model folder", type=Path)
    # A flag, not an option: which round this job is, a fact of the invocation (the rule's wildcard), so
    # that every round's job of a site reads the same --options.
    parser.add_argument("--round", type=int, default=1, help="federation round of this job (1-based)")
    parser.add_argument("--optimizer-in", type=Path, help="optimizer state of the site's previous round")
    parser.add_argument("--optimizer-out", type=Path, help="where to save the optimizer state at the end")
    parser.add_argument(
        "--token-steps", nargs="+", metavar="SITE=MANIFEST", default=[],
        help="federation.site_steps tokens: every site's manifest; this site trains its share of the "
        "options' max_steps x sites by the sites' training tokens (splits.train.tokens_kept)",
    )  # fmt: skip
    cli.add_tracking(parser)
    # What this job is for, not how it trains: the sweep's jobs record training.json and no weights.
    parser.add_argument(
        "--summary-only",
        action="store_true",
        help="write training.json and loss.csv to --out but no weights (scaling sweeps)",
    )
    return parser.parse_args(argv)


def is_rank0() -> bool:
    """Rank 0 of the job, before the process group exists (from the launcher's RANK)."""
    return os.environ.get("RANK", "0") == "0"


def token_steps(site: str, manifests: list[str], options: TrainOptions) -> tuple[TrainOptions, dict | None]:
    """federation.site_steps tokens (--token-steps SITE=MANIFEST ...): this site's options with its
    steps a round, its share of max_steps x sites by the sites' training tokens (the same shares as
    fedtune.run.config.RunConfig.token_steps), and the shares for training.json. Every site's job reads
    the same manifests, so the shares add up to the round's steps of equal steps."""
    if not manifests:
        return options, None
    from fedtune.core.participation import site_step_counts

    tokens = {}
    for pair in manifests:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--token-steps: {pair!r} is not SITE=MANIFEST")
        tokens[name] = manifest_tokens(name, Path(path), error=ConfigError)
    if site not in tokens:
        raise ConfigError(f"--token-steps: no manifest of site {site} among {', '.join(tokens)}")
    if options.max_steps is None:
        raise ConfigError("--token-steps needs the options' max_steps (the steps a round of equal steps)")
    steps = site_step_counts(options.max_steps, tokens)
    return replace(options, max_steps=steps[site]), {"by": "tokens", "tokens": tokens, "steps": steps}


def train_or_restore(job: TrainJob, options: TrainOptions, plan: RoundPlan) -> int:
    """Restore this job's recorded export when one of the same identity is there (no process group,
    no model loaded: every rank reads the same record and decides alike; rank 0 links the files back),
    else train (fedtune.train.export_record)."""
    is_main = is_rank0()
    identity = export_record.job_identity(job, options, plan, int(os.environ.get("WORLD_SIZE", "1")))
    record = export_record.matches(job.checkpoints, identity)
    if record is not None:
        if is_main:
            export_record.restore(job, record)
            by = f"Slurm job {record['slurm_job_id']}" if record.get("slurm_job_id") else record.get("host")
            say(
                f"restored {job.out} from {export_record.folder(job.checkpoints)}: exported "
                f"{record['exported_at']} by {by} after {record['steps']} steps, with this job's inputs, "
                "options and start; no step trained"
            )
        return 0
    saved = export_record.read(job.checkpoints)
    if saved is not None and is_main:
        changed = export_record.differences(saved.get("identity", {}), identity)
        say(
            f"export record {export_record.folder(job.checkpoints)} is of another job ({', '.join(changed)} "
            "differ): removed, training"
        )
        export_record.remove(job.checkpoints)
    return train(job, options, plan, identity=identity)


@cli.entry("fedtune.train.loop", offline=True)
def main(argv=None) -> int:
    args = parse_args(argv)
    options = TrainOptions.from_json(args.options, source="--options")
    if not 1 <= args.round <= options.rounds:
        raise ConfigError(f"--round: {args.round} is not in 1..{options.rounds} (the options' rounds)")
    plan = RoundPlan(args.round, options.rounds, options.lr_schedule)
    options, shares = token_steps(args.site, args.token_steps, options)
    job = replace(TrainJob.from_args(args), site_steps=shares)
    # Rank 0 holds the folder while this job trains or restores (fedtune.train.job_lock): a second job
    # of the same training (a restarted controller's, while the first still runs) stops here, naming it.
    lock = job_lock.JobLock(job.checkpoints, what=str(job.out)) if is_rank0() else None
    if lock:
        lock.acquire()
    try:
        code = train_or_restore(job, options, plan)
    finally:
        if lock:
            lock.release()
    if code == EXIT_RETRY:
        marker = os.environ.get(RETRY_MARKER_ENV)
        if marker:
            # torchrun reports any failed worker as exit 1; the launcher reads this file to restore 75.
            Path(marker).touch()
    return code


if __name__ == "__main__":
    distributed.leave(main())
