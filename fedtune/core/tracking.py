"""Experiment tracking: the numbers of the run folder's CSVs and JSONs, also sent to TensorBoard or
Weights & Biases, where users look at training curves.

One tracked run per (run, round, site) is named `<run>/round-<r>/<site>` (the merged model's site is
`aggregate`, the base model's round is 0). Each job that writes to it (train, each evaluate, aggregate)
opens it once: TensorBoard keeps one folder per name (`<dir>/tensorboard/<run>/round-<r>/<site>`, every
job's event file inside it), W&B one run per job, named so and grouped by the run (`job_type` says
which stage). Offline first: compute nodes have no internet, so W&B writes `<dir>/wandb/offline-run-*`
folders that `wandb sync` uploads from a login node.

The config's `tracking` section (fedtune/schemas/tracking.schema.yaml) picks the backend; the
libraries are the optional extra `[tracking]` and imported only when a backend needs them.

Where the stages call it (rank 0 only):
    train      tracker = start(tracking, TrackedRun(run, r, site), "train", options)
               per step: tracker.log(*loss_row_metrics(row)); at the end: tracker.log_summary(summary)
    evaluate   log_evaluation(tracking, result, run=..., run_dir=...)  (the result JSON it writes)
    aggregate  log_aggregate(tracking, record, TrackedRun(run, r, run_dir=...))  (aggregate.json)

After the fact (a finished stage, or a run trained before tracking was on), from the files themselves:
    python -m fedtune.core.tracking training --path round-1/alpha/model --round 1 --site alpha --run-name R --tracking JSON
    python -m fedtune.core.tracking aggregate --path round-1/aggregate/model/aggregate.json --round 1 ...
    python -m fedtune.core.tracking evaluation --path round-1/eval/alpha/beta.json ...
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fedtune.core import cli
from fedtune.core.options import UserError
from fedtune.core.tracking_options import TrackingOptions

DEFAULT_PROJECT = "fedtune"
LOSS_HEADER = "step,epoch,loss,lr,grad_norm,tokens_per_s,peak_mem_mb"


class TrackingError(UserError):
    """A tracking setting that cannot work: the message names the key or the missing package."""


def run_name(run: str, round: int, site: str) -> str:
    return f"{run}/round-{round}/{site}"


def flatten(values: Mapping, prefix: str = "") -> dict:
    """Nested dicts as one level of `a/b/c` keys (both libraries group by the slashes)."""
    flat = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}/"))
        else:
            flat[name] = value
    return flat


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


class Tracker:
    """The interface every backend has; this base class tracks nothing (backend none)."""

    log_every = 1

    def open(self, run_name: str, config: Mapping, dir: str | Path) -> Tracker:
        return self

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def log_summary(self, summary: Mapping) -> None:
        pass

    def close(self) -> None:
        pass

    def _due(self, step: int) -> bool:
        return step % self.log_every == 0

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TensorBoardTracker(Tracker):
    """Event files in `<dir>/<run name>`; numbers as scalars, the config and text values as text."""

    def __init__(self, log_every: int = 1):
        self.log_every = log_every
        self.writer = None

    def open(self, run_name: str, config: Mapping, dir: str | Path) -> Tracker:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise TrackingError(
                f"tracking.backend: tensorboard needs the tensorboard package (pip install -e '.[tracking]'): {e}"
            ) from None
        self.writer = SummaryWriter(log_dir=str(Path(dir) / run_name))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```")
        return self

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self._due(step):
            return
        for key, value in flatten(metrics).items():
            if (number := _number(value)) is not None:
                self.writer.add_scalar(key, number, global_step=step)

    def log_summary(self, summary: Mapping) -> None:
        for key, value in flatten(summary).items():
            number = _number(value)
            if number is not None:
                self.writer.add_scalar(f"summary/{key}", number, global_step=0)
            elif value is not None:
                self.writer.add_text(f"summary/{key}", str(value))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class WandbTracker(Tracker):
    """A W&B run per job, grouped by the fedtune run; offline unless the config says otherwise."""

    def __init__(
        self, project: str, entity: str | None, mode: str, group: str, job_type: str, log_every: int = 1
    ):
        self.project, self.entity, self.mode = project, entity, mode
        self.group, self.job_type, self.log_every = group, job_type, log_every
        self.run = None

    def open(self, run_name: str, config: Mapping, dir: str | Path) -> Tracker:
        try:
            import wandb
        except ImportError as e:
            raise TrackingError(
                f"tracking.backend: wandb needs the wandb package (pip install -e '.[tracking]'): {e}"
            ) from None
        Path(dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=self.project, entity=self.entity, name=run_name, group=self.group,
            job_type=self.job_type, config=dict(config), dir=str(dir), mode=self.mode,
            # A training job's own numbers only: no system sampling thread, no console copy, no git probe.
            settings=wandb.Settings(x_disable_stats=True, console="off", x_disable_meta=True, silent=True),
        )  # fmt: skip
        return self

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._due(step):
            self.run.log(flatten(metrics), step=step)

    def log_summary(self, summary: Mapping) -> None:
        self.run.summary.update({k: v for k, v in flatten(summary).items() if v is not None})

    def close(self) -> None:
        if self.run is not None:
            import wandb

            self.run.finish()
            self.run = None
            # finish() can return before the service has written the run's file; teardown waits for it.
            wandb.teardown()


Tracking = TrackingOptions | Mapping | None


def options_of(tracking: Tracking) -> TrackingOptions:
    """The typed section: as given, or from a mapping checked against tracking.schema.yaml (defaults
    filled in, a bad key or value named); None: tracking off."""
    if isinstance(tracking, TrackingOptions):
        return tracking
    return TrackingOptions.from_mapping(tracking or {})


def check_available(tracking: Tracking) -> TrackingOptions:
    """The typed section, once its backend's package is known to import: a stage calls this before its
    expensive part, so a missing extra fails the job at once, not after hours."""
    options = options_of(tracking)
    package = {"tensorboard": "tensorboard", "wandb": "wandb"}.get(options.backend)
    if package is not None:
        import importlib.util

        if importlib.util.find_spec(package) is None:
            raise TrackingError(
                f"tracking.backend: {options.backend} needs the {package} package: pip install -e '.[tracking]'"
            )
    return options


def tracking_dir(tracking: Tracking, run_dir: str | Path | None) -> Path:
    """Where the backend writes: tracking.dir, or <results>/<run>/tracking."""
    options = options_of(tracking)
    if not options.dir and run_dir is None:
        raise TrackingError("tracking.dir: not set, and no run folder to put it in")
    base = Path(options.dir) if options.dir else Path(run_dir) / "tracking"
    return base / options.backend if options.backend == "tensorboard" else base


def from_options(tracking: Tracking, *, group: str, job_type: str) -> Tracker:
    """An unopened tracker for the config's `tracking` section (None: track nothing)."""
    options = options_of(tracking)
    if options.backend == "tensorboard":
        return TensorBoardTracker(log_every=options.log_every)
    if options.backend == "wandb":
        return WandbTracker(
            project=options.project or DEFAULT_PROJECT, entity=options.entity, mode=options.wandb_mode,
            group=group, job_type=job_type, log_every=options.log_every,
        )  # fmt: skip
    return Tracker()


@dataclass(frozen=True)
class TrackedRun:
    """Which tracked run a job writes to: the run's name, the round and the site (`aggregate` for the
    merged model), and the run folder that a relative tracking dir is read against."""

    run: str
    round: int
    site: str = "aggregate"
    run_dir: str | Path | None = None


def start(tracking: Tracking, where: TrackedRun, job_type: str, config: Mapping) -> Tracker:
    """The opened tracker of (run, round, site) for one job."""
    tracker = from_options(tracking, group=where.run, job_type=job_type)
    return tracker.open(
        run_name(where.run, where.round, where.site), config, tracking_dir(tracking, where.run_dir)
    )


def loss_row_metrics(row: str, header: str = LOSS_HEADER) -> tuple[int, dict]:
    """A loss.csv row (as train writes it) as (step, {"train/loss": ..., ...})."""
    names = header.strip().split(",")
    values = row.strip().split(",")
    if len(values) != len(names):
        raise TrackingError(
            f"loss row {row.strip()!r}: {len(values)} values for the columns {header.strip()}"
        )
    record = dict(zip(names, values, strict=True))
    step = int(record.pop("step"))
    return step, {f"train/{k}": float(v) for k, v in record.items()}


def evaluation_metrics(result: Mapping) -> dict:
    """The numbers of an evaluate result, keyed by the test site they were measured on."""
    identity = {"model", "model_dir", "round", "site", "task", "data", "split", "template", "device"}
    return {
        f"eval/{result['site']}/{key}": number
        for key, value in result.items()
        if key not in identity and (number := _number(value)) is not None and not math.isnan(number)
    }


def log_evaluation(
    tracking: Tracking, result: Mapping, *, run: str, run_dir: str | Path | None = None
) -> None:
    """Send one evaluate result (the JSON evaluate writes) to the evaluated model's tracked run."""
    if not options_of(tracking).on:
        return
    config = {"site": result["site"], "model": result["model"], "split": result.get("split")}
    where = TrackedRun(run, result["round"], result["model"], run_dir)
    with start(tracking, where, "evaluate", config) as tracker:
        metrics = evaluation_metrics(result)
        tracker.log_every = 1  # log_every thins training steps, not the one point of a result
        tracker.log(result["round"], metrics)
        tracker.log_summary(metrics)


def aggregate_metrics(record: Mapping) -> dict:
    """What aggregate.json says in numbers: each site's normalised weight, inputs, time, warnings."""
    weights = record.get("weights", {}).get("normalised", {}) or {}
    metrics = {f"aggregate/weight/{site}": float(w) for site, w in weights.items()}
    metrics["aggregate/inputs"] = float(len(record.get("inputs", [])))
    metrics["aggregate/warnings"] = float(len(record.get("warnings", [])))
    if (wall := _number(record.get("wall_time_s"))) is not None:
        metrics["aggregate/wall_time_s"] = wall
    return metrics


def log_aggregate(tracking: Tracking, record: Mapping, where: TrackedRun) -> None:
    """Send one aggregate.json record to the tracked run `where` (run, round, aggregate)."""
    if not options_of(tracking).on:
        return
    config = {
        "method": record.get("method"),
        "dtype": record.get("dtype"),
        "weights": record.get("weights", {}).get("source"),
    }
    with start(tracking, where, "aggregate", config) as tracker:
        metrics = aggregate_metrics(record)
        tracker.log_every = 1
        tracker.log(where.round, metrics)
        tracker.log_summary({**metrics, "aggregate/method": record.get("method")})


def log_training_folder(tracking: Tracking, model_dir: str | Path, where: TrackedRun) -> int:
    """Send a finished site model's loss.csv and training.json (as train wrote them) to its tracked run
    `where`, after the fact: for runs trained before tracking was on. Returns the rows sent."""
    model_dir = Path(model_dir)
    lines = (model_dir / "loss.csv").read_text().splitlines()
    summary = json.loads((model_dir / "training.json").read_text())
    if not lines or lines[0].strip() != LOSS_HEADER:
        raise TrackingError(f"{model_dir / 'loss.csv'}: expected the header {LOSS_HEADER}")
    with start(tracking, where, "train", summary.get("options", {})) as tracker:
        for line in lines[1:]:
            tracker.log(*loss_row_metrics(line, lines[0]))
        tracker.log_summary({k: v for k, v in summary.items() if k != "options"})
    return len(lines) - 1


@cli.entry("fedtune.core.tracking")
def main(argv=None) -> int:

    parser = cli.parser(
        "fedtune.core.tracking",
        "Send a stage's results, as written in the run folder, to the configured tracker.",
    )
    parser.add_argument("what", choices=["training", "aggregate", "evaluation"])
    cli.add_tracking(parser, required=True)
    parser.add_argument(
        "--path", required=True, help="model folder (training), aggregate.json or an evaluate JSON"
    )
    parser.add_argument("--round", type=int, help="training, aggregate: the round")
    parser.add_argument("--site", help="training: the site")
    args = parser.parse_args(argv)
    options = check_available(TrackingOptions.from_json(args.tracking, source="--tracking"))
    if args.what == "evaluation":
        log_evaluation(options, cli.json_file(args.path, "--path"), run=args.run_name)
    elif args.round is None or (args.what == "training" and args.site is None):
        raise TrackingError(
            f"{args.what}: needs --round" + (" and --site" if args.what == "training" else "")
        )
    elif args.what == "aggregate":
        log_aggregate(options, cli.json_file(args.path, "--path"), TrackedRun(args.run_name, args.round))
    else:
        log_training_folder(options, args.path, TrackedRun(args.run_name, args.round, args.site))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
