"""Scaling sweeps: the table and plot that compare the runs of one site's training, once per value of
an axis (config `sweep`, fedtune/schemas/sweep.schema.yaml; fedtune.run.sweep expands it into points).

    python -m fedtune.report.sweep report --out results/<run>/report --axis devices \\
        --run results/<run>/sweep/yelp/devices-1 results/<run>/sweep/yelp/devices-2 ...

Each --run folder is a sweep job's output (`python -m fedtune.train --summary-only`): training.json and
loss.csv. The value of each run is read back from training.json (its world size for the devices axis,
else its options), so a table row can never be paired with the wrong folder. Outputs, in --out:

    sweep.csv / sweep.md   one row per value: world size, nodes, wall time, step time, time per epoch,
                           tokens/s, speedup and efficiency against the smallest value (the first given
                           when the values are not numbers), mean loss per epoch
    sweep.png              time per epoch and loss per epoch against the value

Step times come from loss.csv (global_batch x block_size / tokens_per_s of each step), without the first
step when there are others: it carries one-off costs (process group, kernels, allocator) that an epoch
of a long run does not. Wall time (training.json) is everything, start-up and checkpoints included.

Exit codes: 0 done; 2 bad input (the message names the file).
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from fedtune.core import cli
from fedtune.core.atomic import write_bytes, write_text
from fedtune.core.options import UserError
from fedtune.report.build import markdown
from fedtune.run.sweep import DEVICES_AXIS

DEVICES = DEVICES_AXIS
LOSS_COLUMNS = ("epoch", "loss", "tokens_per_s")
SUMMARY_KEYS = (
    "world_size",
    "nodes",
    "steps",
    "steps_per_epoch",
    "wall_time_s",
    "global_batch",
    "block_size",
)


# ---------------------------------------------------------------------------------------------------
# Report: one row per run


class SweepError(UserError):
    """A sweep run folder that cannot be read: the message names the file."""


def _read_summary(folder: Path) -> dict:
    path = folder / "training.json"
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SweepError(f"{path}: not found (is {folder} a sweep job's output?)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SweepError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(summary, dict):
        raise SweepError(f"{path}: not a training summary (a JSON object)")
    missing = [key for key in SUMMARY_KEYS if not isinstance(summary.get(key), int | float)]
    if missing:
        raise SweepError(f"{path}: no numeric {', '.join(missing)}")
    return summary


def _read_losses(folder: Path):
    import pandas as pd

    path = folder / "loss.csv"
    try:
        frame = pd.read_csv(path)
    except FileNotFoundError:
        raise SweepError(f"{path}: not found") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise SweepError(f"{path}: not a loss table: {e}") from None
    missing = [c for c in LOSS_COLUMNS if c not in frame.columns]
    if missing:
        raise SweepError(f"{path}: no column {', '.join(missing)} (has {', '.join(map(str, frame.columns))})")
    if frame.empty:
        raise SweepError(f"{path}: no steps")
    for column in LOSS_COLUMNS:
        values = pd.to_numeric(frame[column], errors="coerce")
        # Epochs count from 1 and a step takes time; a loss may be anything but missing.
        bad = values.isna() if column == "loss" else values.isna() | (values <= 0)
        if bad.any():
            first = int(bad.to_numpy().argmax())
            raise SweepError(f"{path}: line {first + 2}: {column} is {frame[column].iloc[first]!r}")
        frame[column] = values
    return frame


def _run_value(summary: dict, axis: str, folder: Path):
    if axis == DEVICES:
        return summary["world_size"]
    options = summary.get("options")
    if not isinstance(options, dict) or axis not in options:
        raise SweepError(
            f"{folder / 'training.json'}: options hold no {axis!r}: not a run of this sweep axis"
        )
    return options[axis]


def run_row(folder: str | Path, axis: str) -> dict:
    """One table row from a sweep job's training.json and loss.csv."""
    folder = Path(folder)
    summary = _read_summary(folder)
    losses = _read_losses(folder)
    step_times = summary["global_batch"] * summary["block_size"] / losses["tokens_per_s"]
    timed = step_times.iloc[1:] if len(step_times) > 1 else step_times
    step_time = float(timed.mean())
    row = {
        axis: _run_value(summary, axis, folder),
        "world_size": int(summary["world_size"]),
        "nodes": int(summary["nodes"]),
        "steps": int(summary["steps"]),
        "wall_time_s": float(summary["wall_time_s"]),
        "step_time_s": step_time,
        "time_per_epoch_s": step_time * summary["steps_per_epoch"],
        "tokens_per_s": summary["global_batch"] * summary["block_size"] / step_time,
    }
    for epoch, loss in losses.groupby("epoch")["loss"].mean().items():
        row[f"loss_epoch_{int(epoch)}"] = float(loss)
    return row


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def sweep_table(folders: Sequence[str | Path], axis: str):
    """The runs' rows, by value (ascending when all are numbers, else as given), with speedup and
    efficiency against the first row: speedup = its time per epoch / this one's; efficiency = speedup x
    its world size / this one's (1.0 = perfect scaling with the devices)."""
    import pandas as pd

    if not folders:
        raise SweepError("no sweep runs given (--run)")
    rows, seen = [], {}
    for folder in folders:
        row = run_row(folder, axis)
        key = json.dumps(row[axis])
        if key in seen:
            raise SweepError(f"{folder}: {axis} {row[axis]!r} again (also {seen[key]})")
        seen[key] = folder
        rows.append(row)
    if all(_is_number(row[axis]) for row in rows):
        rows.sort(key=lambda row: row[axis])
    base = rows[0]
    for row in rows:
        row["speedup"] = base["time_per_epoch_s"] / row["time_per_epoch_s"]
        row["efficiency"] = row["speedup"] * base["world_size"] / row["world_size"]
    epochs = sorted({int(k.rsplit("_", 1)[1]) for row in rows for k in row if k.startswith("loss_epoch_")})
    columns = [
        axis,
        "world_size",
        "nodes",
        "steps",
        "wall_time_s",
        "step_time_s",
        "time_per_epoch_s",
        "tokens_per_s",
        "speedup",
        "efficiency",
        *(f"loss_epoch_{e}" for e in epochs),
    ]
    table = pd.DataFrame(rows, columns=columns)
    # Nullable integers: the Markdown writer reads rows, where plain int64 would turn into floats.
    for column in table.columns:
        if pd.api.types.is_integer_dtype(table[column]) and not pd.api.types.is_bool_dtype(table[column]):
            table[column] = table[column].astype("Int64")
    return table


# ---------------------------------------------------------------------------------------------------
# Figure


def sweep_figure(table, axis: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = list(table[axis])
    numeric = all(_is_number(v) for v in values)
    xs = values if numeric else list(range(len(values)))
    fig, (time_ax, loss_ax) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    time_ax.plot(xs, table["time_per_epoch_s"], marker="o", label="measured")
    if axis == DEVICES:
        base = table.iloc[0]
        ideal = [base["time_per_epoch_s"] * base["world_size"] / w for w in table["world_size"]]
        time_ax.plot(xs, ideal, ls="--", color="grey", label="perfect scaling")
        time_ax.legend()
    time_ax.set_ylabel("time per epoch (s)")
    for column in [c for c in table.columns if c.startswith("loss_epoch_")]:
        loss_ax.plot(xs, table[column], marker="o", label=f"epoch {column.rsplit('_', 1)[1]}")
    loss_ax.set_ylabel("mean training loss")
    loss_ax.legend()
    for ax in (time_ax, loss_ax):
        if numeric and axis == DEVICES and min(values) > 0:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(v) for v in values])
        ax.minorticks_off()
        ax.set_xlabel(axis)
        ax.grid(alpha=0.3)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    plt.close(fig)
    write_bytes(path, buffer.getvalue())


# ---------------------------------------------------------------------------------------------------


DIGITS = {
    "wall_time_s": 1,
    "step_time_s": 3,
    "time_per_epoch_s": 2,
    "tokens_per_s": 0,
    "speedup": 2,
    "efficiency": 2,
}


def write_report(out_dir: str | Path, folders: Sequence[str | Path], axis: str) -> dict[str, Path]:

    table = sweep_table(folders, axis)
    out_dir = Path(out_dir)
    paths = {"csv": out_dir / "sweep.csv", "md": out_dir / "sweep.md", "png": out_dir / "sweep.png"}
    write_text(paths["csv"], table.to_csv(index=False))
    digits = {**DIGITS, **{c: 4 for c in table.columns if c.startswith("loss_epoch_")}}
    intro = (
        f"Scaling sweep over {axis}: one training run per row. Time per epoch is the mean step time (the "
        f"first step left out) x steps per epoch; speedup and efficiency are against {axis} "
        f"{table[axis].iloc[0]}; loss_epoch_k is the mean training loss of epoch k.\n\n"
    )
    write_text(paths["md"], intro + markdown(table, digits=digits))
    sweep_figure(table, axis, paths["png"])
    return paths


@cli.entry("fedtune.report.sweep", offline=True)
def main(argv: Sequence[str] | None = None) -> int:
    parser, commands = cli.subcommands("fedtune.report.sweep", __doc__.split("\n\n")[0])
    report = commands.add_parser("report", help="sweep.csv, sweep.md and sweep.png from the sweep's runs")
    cli.add_out(report, "report folder", type=Path)
    report.add_argument("--axis", required=True, help="the sweep axis: devices or a train key")
    cli.add_list(report, "--run", "FOLDER", "sweep job outputs", required=True)
    args = parser.parse_args(argv)
    paths = write_report(args.out, args.run, args.axis)
    print(paths["md"].read_text(encoding="utf-8"), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
