"""The run's report: every model on every site's test text, and how each site's training went.

Inputs are the evaluate stage's JSON files (each names its model, round and site) and the train stage's
training.json and loss.csv per (round, site). Outputs, in --out:

    perplexity.csv / .md     one row per model (round, model), one column per site's test split
    bits_per_byte.csv        the same for bits per byte, which compares models across tokenizers
    perplexity.png           heatmap of the perplexity table
    rounds.png               perplexity of each round's aggregate (and the base model) per site
    training.csv / .md       per (round, site): steps, tokens, wall time, tokens/s, final loss
    loss.png                 loss curves of every site, rounds one after the other
    perplexity.html          the perplexity and bits-per-byte tables as a web page (snakemake --report)
    training.html            the training table as a web page
    settings.csv / .html     the run's settings, one row per config key (with --settings); the page
                             first says where each site's text was read ("site cs: data read only on
                             karolina")
    tasks/<task>.csv / .md / .html   with --tasks: one table per downstream task (evaluate.tasks), one row
                             per model, one column per metric (fedtune.evaluate.downstream's CSVs)

For classifiers (task sequence-classification) accuracy takes the place of perplexity (accuracy.csv /
.md / .png, the .md with macro-F1 below it) and macro_f1.csv that of bits per byte; higher is better.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from fedtune.core import cli
from fedtune.core.atomic import write_text
from fedtune.core.metrics import LOWER_IS_BETTER, TASK_METRICS, Metrics
from fedtune.core.options import CAUSAL_LM, UserError
from fedtune.core.residency import data_lines

BASE = "base"
AGGREGATE = "aggregate"
POOLED = "pooled"


TRAINING_COLUMNS = [
    "round",
    "site",
    "steps",
    "tokens",
    "wall_time_s",
    "tokens_per_s",
    "job_tokens_per_s",
    "final_loss",
    "world_size",
    "backend",
    "sharding",
    "sent_mb",
]


TRAINING_CAPTION = (
    "Training of each site per round. tokens_per_s: tokens per second of training steps (training.json, "
    "the mean of loss.csv's steps; what `python -m fedtune.report.status` shows); job_tokens_per_s: per "
    "second of the whole job, wall_time_s, whose start-up, loading and export a short job is mostly made of."
)
# federation.site_steps tokens (training.json's site_steps): why the sites' steps differ.
TOKEN_STEPS_CAPTION = (
    "steps: each site's share of the round's steps (max_steps x sites) by its training tokens "
    "(federation.site_steps tokens; its manifest's tokens_kept), not the same max_steps at every site."
)


class ReportError(UserError):
    """Inputs that do not fit together: the message names the file."""


def _read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ReportError(f"{path}: not found") from None
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: not valid JSON: {e}") from None


def _warn(message: str) -> None:
    print(f"report: warning: {message}", file=sys.stderr)


def parse_labelled(item: str, option: str) -> tuple[int, str, Path]:
    """ROUND:SITE=PATH -> (round, site, path)."""
    key, sep, path = item.partition("=")
    round_text, colon, site = key.partition(":")
    if not (sep and colon and path and site and round_text.isdigit()):
        raise ReportError(f"{option}: {item!r} is not ROUND:SITE=PATH (for example 1:alpha=results/...)")
    return int(round_text), site, Path(path)


def parse_pooled_point(item: str) -> tuple[str, tuple[float, float]]:
    """MODEL=LR,FACTOR (--pooled-point) -> (model, (lr, embedding/head lr factor))."""
    model, sep, values = item.partition("=")
    try:
        lr, factor = (float(v) for v in values.split(","))
    except ValueError:
        lr = factor = None
    if not (sep and is_pooled(model) and lr is not None):
        raise ReportError(
            f"--pooled-point: {item!r} is not MODEL=LR,FACTOR (for example pooled-lr2x=0.002,1)"
        )
    return model, (lr, factor)


# ---------------------------------------------------------------------------------------------------
# Tables


def model_order(model: str, sites: Sequence[str]) -> tuple[int, int, str]:
    if model == BASE:
        return (0, 0, model)
    if model in sites:
        return (1, sites.index(model), model)
    if model == AGGREGATE:
        return (2, 0, model)
    if model == POOLED:
        return (4, 0, model)
    if is_pooled(model):
        return (5, 0, model)
    return (3, 0, model)


def is_pooled(model: str) -> bool:
    """The pooled model at the run's settings (`pooled`) or one of its lr sweep (`pooled-lr2x`, ...)."""
    return model == POOLED or model.startswith(f"{POOLED}-")


# The yardsticks of the gap table: the pooled model at the run's settings, and the best of its lr sweep;
# with federation.pooled_sync, the same two of the synchronous data-parallel pooled models
# (pooled-sync-lr<f>x: M times the batch for a site's number of steps).
YOUR_SETTINGS = "pooled at your settings"
BEST_OF_SWEEP = "best pooled of the lr sweep"
SYNC = f"{POOLED}-sync-"
SYNC_YOUR_SETTINGS = "synchronous pooled at your settings"
SYNC_BEST_OF_SWEEP = "best synchronous pooled of the lr sweep"
GAP_KEYS = ["round", "model", "yardstick", "pooled_model", "pooled_lr", "pooled_embedding_lr_factor"]


def is_sync(model: str) -> bool:
    """A synchronous data-parallel pooled model (federation.pooled_sync: pooled-sync-lr1x, ...)."""
    return model.startswith(SYNC)


def best_pooled(table: pd.DataFrame, metrics: Metrics, *, sync: bool = False) -> str | None:
    """The serial (`sync`: the synchronous data-parallel) pooled model that does best over all sites:
    the lowest geometric mean perplexity (the highest mean accuracy). None without such a model."""
    sites = list(table.columns[2:])
    pooled = table[table["model"].map(lambda m: is_pooled(m) and is_sync(m) == sync)].dropna(subset=sites)
    if pooled.empty:
        return None
    values = pooled[sites].astype(float)
    if metrics.lower_is_better:
        score = values.apply(lambda row: math.exp(sum(map(math.log, row)) / len(row)), axis=1)
        return str(pooled.loc[score.idxmin(), "model"])
    return str(pooled.loc[values.mean(axis=1).idxmax(), "model"])


def gap_table(
    table: pd.DataFrame, metrics: Metrics, pooled_points: Mapping[str, tuple[float, float]] | None = None
) -> pd.DataFrame:
    """The federation gap per round, merged model, yardstick and site: how many times worse than a pooled
    model (trained on every site's data at once) the merged model is: perplexity / pooled perplexity, or
    for classifiers pooled accuracy / accuracy. 1 is as good as pooling the data. Merged models are the
    aggregate and any compared merge method (every model that is neither base, pooled nor a site).

    Two yardsticks where the run has the pooled lr sweep (federation.pooled_lr_factors): the pooled model
    at the run's settings, and the sweep's best (`best_pooled`, the same model for every row), each with
    its lr and embedding/head factor from `pooled_points` (label -> (lr, factor)) where given."""
    sites = list(table.columns[2:])
    points = dict(pooled_points or {})
    pooled = table[table["model"] == POOLED]
    if pooled.empty:
        return pd.DataFrame(columns=[*GAP_KEYS, *sites])
    yardsticks = [(YOUR_SETTINGS, POOLED)]
    serial = table["model"].map(lambda m: is_pooled(m) and not is_sync(m))
    if (serial & (table["model"] != POOLED)).any():
        yardsticks.append((BEST_OF_SWEEP, best_pooled(table, metrics) or POOLED))
    synchronous = [m for m in table["model"] if is_sync(m)]
    if synchronous:
        # At your settings: the one with the pooled model's lr and factor (pooled-sync-lr1x unless told).
        yours = next((m for m in synchronous if POOLED in points and points.get(m) == points[POOLED]), None)
        yours = yours or next((m for m in synchronous if m == f"{SYNC}lr1x"), None)
        if yours:
            yardsticks.append((SYNC_YOUR_SETTINGS, yours))
        best = best_pooled(table, metrics, sync=True)
        if best and (len(synchronous) > 1 or not yours):
            yardsticks.append((SYNC_BEST_OF_SWEEP, best))
    merged = table[~table["model"].map(is_pooled) & ~table["model"].isin([BASE, *sites])]
    rows = []
    for _, row in merged.iterrows():
        for yardstick, name in yardsticks:
            reference = table[table["model"] == name].iloc[0]
            lr, factor = points.get(name, (None, None))
            ratios = {}
            for site in sites:
                value, best = row[site], reference[site]
                if pd.isna(value) or pd.isna(best) or math.isinf(best):
                    ratios[site] = None  # not evaluated, or a diverged yardstick: no gap to state
                elif math.isinf(value):
                    ratios[site] = math.inf if metrics.lower_is_better else None  # diverged
                else:
                    ratios[site] = value / best if metrics.lower_is_better else best / value
            keys = [row["round"], row["model"], yardstick, name, lr, factor]
            rows.append({**dict(zip(GAP_KEYS, keys, strict=True)), **ratios})
    return pd.DataFrame(rows, columns=[*GAP_KEYS, *sites])


# gap.md's two yardsticks when the run trains both pooled models (federation.pooled_sync): what each
# means to a user choosing between federating and pooling the data.
SYNC_CAPTION = (
    " Two pooled models, each with the federation's tokens. The serial one (pooled, pooled-lr<f>x) "
    "trains at a site's batch, M times a site's sequential steps: what pooling the data on one site's "
    "GPUs for M times the federation's wall time would give; a gap to it is the price of federating and "
    "of training in parallel. The synchronous data-parallel one (pooled-sync-lr<f>x) trains M times a "
    "site's batch for a site's number of steps: what pooling the data and training over every site's "
    "GPUs at once, in the federation's wall time, would give; a gap to it is the price of federating "
    "alone, the figure to weigh if the data could be pooled."
)


def gap_figure(gap: pd.DataFrame, path: Path) -> None:
    """The gap of each merged model over the rounds, one line per (model, site), log scale."""
    plt = _pyplot()
    sites = list(gap.columns[len(GAP_KEYS) :])
    fig, ax = plt.subplots(figsize=(6, 4), layout="constrained")
    for m, ((model, yardstick), rows) in enumerate(gap.groupby(["model", "yardstick"], sort=False)):
        rows = rows.sort_values("round")
        # Solid: the aggregate against the pooled model at your settings; the best of the sweep dotted.
        marker = "o" if yardstick == YOUR_SETTINGS else "s"
        style = ("-" if yardstick == YOUR_SETTINGS else ":") if model == AGGREGATE else ["--", "-."][m % 2]
        for k, site in enumerate(sites):
            label = f"{model} vs {rows['pooled_model'].iloc[0]}, {site} test"
            ax.plot(rows["round"], rows[site], style, marker=marker, color=f"C{k}", label=label)
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.set_xlabel("round")
    ax.set_ylabel("gap to the pooled model (1 = as good)")
    ax.set_yscale("log")
    plain_log_ticks(ax.yaxis)
    if len(gap):
        ax.set_xticks(sorted(set(gap["round"])))
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def eval_table(results: Sequence[dict], metric: str) -> pd.DataFrame:
    """Rows (round, model), columns the sites in order of first appearance; base is round 0. A diverged
    model's perplexity (NaN or infinite) is infinity, which the tables print as "diverged"; a missing
    result is NaN ("–")."""
    sites: list[str] = []
    rows: dict[tuple[int, str], dict[str, float]] = {}
    for r in results:
        if r["site"] not in sites:
            sites.append(r["site"])
        key = (r["round"], r["model"])
        cell = rows.setdefault(key, {})
        if r["site"] in cell:
            raise ReportError(f"two results for model {r['model']} (round {r['round']}) on site {r['site']}")
        value = r[metric]
        if metric in LOWER_IS_BETTER and isinstance(value, int | float) and not math.isfinite(value):
            value = math.inf  # diverged (NaN or infinite loss): shown as such, worse than any number
        cell[r["site"]] = value
    keys = sorted(rows, key=lambda k: (k[0], *model_order(k[1], sites)))
    table = pd.DataFrame(
        [
            {"round": rnd, "model": model, **{s: rows[(rnd, model)].get(s) for s in sites}}
            for rnd, model in keys
        ],
        columns=["round", "model", *sites],
    )
    return table


def load_evals(paths: Sequence[str | Path]) -> list[dict]:
    """The evaluation results, all of one task (results without a task are language-model ones)."""
    results, task = [], None
    for path in paths:
        r = _read_json(Path(path))
        r.setdefault("task", CAUSAL_LM)
        if r["task"] not in TASK_METRICS:
            raise ReportError(f"{path}: unknown task {r['task']!r}")
        if task is not None and r["task"] != task:
            raise ReportError(f"{path}: a {r['task']} result among {task} results")
        task = r["task"]
        missing = [k for k in ("model", "site", TASK_METRICS[task].main) if r.get(k) is None]
        if missing:
            raise ReportError(f"{path}: evaluation result without {missing}")
        r["round"] = int(r.get("round") or 0)
        results.append(r)
    return results


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def sent_folder(model_dir: Path) -> Path:
    """The folder a site sends each round: its compressed update (federation.exchange) where there is
    one beside its model, else the model folder."""
    update = model_dir.parent / "update"
    return update if update.is_dir() else model_dir


def task_tables(
    paths: Sequence[str | Path], names: Sequence[str], sites: Sequence[str]
) -> dict[str, pd.DataFrame]:
    """One table per downstream task (fedtune.evaluate.downstream's CSVs): rows (round, model) in the main table's
    order, columns the task's metrics; a group's columns are `<member task> <metric>`."""
    frames = []
    for path in paths:
        try:
            frame = pd.read_csv(path, keep_default_na=False, dtype={"value": float})
        except (OSError, ValueError) as e:
            raise ReportError(f"{path}: not a task score CSV: {e}") from None
        missing = {"model", "round", "entry", "task", "metric", "value"} - set(frame.columns)
        if missing:
            raise ReportError(f"{path}: task score CSV without columns {sorted(missing)}")
        frames.append(frame)
    scores = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    tables = {}
    for name in names:
        part = scores[scores["entry"] == name] if len(scores) else scores
        if part.empty:
            raise ReportError(f"--tasks: no scores of task {name} in {', '.join(map(str, paths))}")
        part = part.assign(
            round=pd.to_numeric(part["round"]).astype(int),
            column=[
                m if t == name else f"{t} {m}" for t, m in zip(part["task"], part["metric"], strict=True)
            ],
        )
        if part.duplicated(["round", "model", "column"]).any():
            raise ReportError(f"--tasks: two scores of one model for task {name}")
        table = part.pivot(index=["round", "model"], columns="column", values="value")
        keys = sorted(table.index, key=lambda k: (k[0], *model_order(k[1], list(sites))))
        columns = list(dict.fromkeys(part["column"]))
        tables[name] = table.loc[keys, columns].reset_index().rename_axis(columns=None)
    return tables


def training_table(entries: Sequence[tuple[int, str, Path]]) -> pd.DataFrame:
    """One row per (round, site) from training.json; attrs["site_steps"]: the steps were shared by
    tokens (federation.site_steps tokens)."""
    rows, shared = [], False
    for rnd, site, path in entries:
        if not Path(path).is_file():
            _warn(f"{path}: training summary not found; site {site} round {rnd} left out")
            continue
        t = _read_json(path)
        if t.get("site_steps"):
            shared = True
        tokens = t.get("tokens_seen", t.get("tokens"))
        wall = t.get("wall_time_s")
        rows.append(
            {
                "round": rnd,
                "site": t.get("site", site),
                "steps": t.get("steps"),
                "tokens": tokens,
                "wall_time_s": wall,
                # Per second of training steps (as status shows it), and of the whole job (start-up,
                # loading and export included: for a short job mostly start-up).
                "tokens_per_s": t.get("tokens_per_s"),
                "job_tokens_per_s": tokens / wall if tokens is not None and wall else None,
                "final_loss": t.get("final_loss"),
                "world_size": t.get("world_size"),
                "backend": t.get("backend"),
                "sharding": t.get("sharding"),
                # What the site's folder moves to the aggregating cluster each round: a whole model, or
                # with train.adapter only the adapter (fetch_site_model copies the folder as it is), or
                # with federation.exchange compressed its update folder beside it.
                "sent_mb": None if site == "pooled" else folder_bytes(sent_folder(Path(path).parent)) / 1e6,
            }
        )
    table = pd.DataFrame(rows, columns=TRAINING_COLUMNS)
    for column in ("round", "steps", "tokens", "world_size"):
        table[column] = pd.to_numeric(table[column]).astype("Int64")
    table = table.sort_values(["round"], kind="stable").reset_index(drop=True)
    table.attrs["site_steps"] = shared
    return table


# A result that was computed and is not finite: a perplexity of NaN or infinity (eval_table stores both as
# infinity), a gap to it. Distinct from "–": not evaluated, or nothing to say.
DIVERGED = "diverged"


MARKS = f" {DIVERGED}: a perplexity that is NaN or infinite (the model diverged); –: not evaluated."


def _cell(value, digits: int) -> str:
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float) and math.isinf(value):
        return DIVERGED
    if isinstance(value, float):
        if value and abs(value) < 0.5 * 10**-digits:
            # Too small for `digits` decimals (a learning rate of 1e-4 would be "0.000"): significant digits.
            return f"{value:.{max(digits, 2)}g}"
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def markdown(
    table: pd.DataFrame,
    digits: int | dict[str, int] = 3,
    bold_min: Sequence[str] = (),
    bold_max: Sequence[str] = (),
) -> str:
    """A GitHub Markdown table; `digits` per column or for all; the lowest value of each `bold_min`
    column and the highest of each `bold_max` column in bold."""
    header = "| " + " | ".join(str(c) for c in table.columns) + " |"
    align = (
        "|"
        + "|".join("---:" if pd.api.types.is_numeric_dtype(table[c]) else "---" for c in table.columns)
        + "|"
    )
    best = {c: table[c].min() for c in bold_min if table[c].notna().any()}
    best.update({c: table[c].max() for c in bold_max if table[c].notna().any()})
    lines = [header, align]
    for _, row in table.iterrows():
        cells = []
        for c in table.columns:
            value = row[c]
            value = value.item() if hasattr(value, "item") else value
            text = _cell(value, digits.get(c, 3) if isinstance(digits, dict) else digits)
            if c in best and value == best[c]:
                text = f"**{text}**"
            cells.append(text)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


HTML_STYLE = (
    "body{font-family:system-ui,sans-serif;margin:1em;color:#111}"
    "table{border-collapse:collapse;margin:0.5em 0 1.5em}"
    "th,td{border:1px solid #bbb;padding:0.25em 0.6em}td.n{text-align:right}"
    "th{background:#e8edf3}td.best{font-weight:bold;background:#e6f4ea}"
)


def html_page(title: str, sections: Sequence[tuple[str, pd.DataFrame, dict]]) -> str:
    """A self-contained web page of tables, for the Snakemake report (which shows HTML, not CSV):
    each section is (heading, table, options for markdown-like formatting: digits, bold_min, bold_max)."""
    from html import escape

    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{escape(title)}</title>"]
    parts.append(f"<style>{HTML_STYLE}</style></head><body><h2>{escape(title)}</h2>")
    for heading, table, options in sections:
        digits = options.get("digits", 3)
        best = {c: table[c].min() for c in options.get("bold_min", ()) if table[c].notna().any()}
        best.update({c: table[c].max() for c in options.get("bold_max", ()) if table[c].notna().any()})
        if heading:
            parts.append(f"<p>{'<br>'.join(escape(line) for line in heading.splitlines())}</p>")
        parts.append("<table><thead><tr>")
        parts += [f"<th>{escape(str(c))}</th>" for c in table.columns]
        parts.append("</tr></thead><tbody>")
        for _, row in table.iterrows():
            parts.append("<tr>")
            for c in table.columns:
                value = row[c]
                value = value.item() if hasattr(value, "item") else value
                text = _cell(value, digits.get(c, 3) if isinstance(digits, dict) else digits)
                classes = ["n"] if pd.api.types.is_numeric_dtype(table[c]) else []
                if c in best and value == best[c]:
                    classes.append("best")
                cls = f" class='{' '.join(classes)}'" if classes else ""
                parts.append(f"<td{cls}>{escape(text)}</td>")
            parts.append("</tr>")
        parts.append("</tbody></table>")
    parts.append("</body></html>\n")
    return "".join(parts)


def _row_labels(table: pd.DataFrame) -> list[str]:
    return [
        model if rnd == 0 else f"round {rnd} · {model}"
        for rnd, model in zip(table["round"], table["model"], strict=True)
    ]


# ---------------------------------------------------------------------------------------------------
# Figures


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plain_log_ticks(axis) -> None:
    """Tick labels of a log axis as plain numbers (1, 1.5, 2, 3, 5, 10), never matplotlib's "3x10^0" of an
    axis that spans less than a decade, nor "10^0": each decade labelled, and within an axis of at most
    1.5 decades the 2, 3 and 5 of each decade too (and 1.5 within one decade; every tick where it spans
    less than half a decade)."""
    import math

    from matplotlib.ticker import FuncFormatter, LogLocator

    def plain(value, _position=None) -> str:
        return f"{value:.3g}" if value > 0 else ""

    def minor(value, _position=None) -> str:
        low, high = sorted(axis.get_view_interval())
        if value <= 0 or low <= 0:
            return ""
        decades = math.log10(high / low)
        mantissa = round(value / 10 ** math.floor(math.log10(value) + 1e-9), 6)
        labelled = (1.5, 2, 3, 5) if decades <= 1 else (2, 3, 5) if decades <= 1.5 else ()
        if decades < 0.5 or mantissa in labelled:
            return plain(value)
        return ""

    axis.set_major_locator(LogLocator(base=10))
    axis.set_major_formatter(FuncFormatter(plain))
    axis.set_minor_locator(LogLocator(base=10, subs=(1.5, *range(2, 10))))
    axis.set_minor_formatter(FuncFormatter(minor))


def heatmap(table: pd.DataFrame, path: Path, title: str, metrics: Metrics = TASK_METRICS[CAUSAL_LM]) -> None:
    import numpy as np

    plt = _pyplot()
    sites = list(table.columns[2:])
    values = table[sites].to_numpy(dtype=float)
    labels = _row_labels(table)
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(sites), 1.2 + 0.45 * len(labels)), layout="constrained")
    # Colour by log perplexity: one model can be 100x worse on a foreign site, which would flatten
    # every other difference on a linear scale. Accuracy lives in [0, 1]: linear.
    log = metrics.lower_is_better
    scale = np.log(values) if log else values
    shown = np.ma.masked_invalid(scale)
    image = ax.imshow(shown, cmap="viridis_r" if log else "viridis", aspect="auto")
    finite = scale[np.isfinite(scale)]
    middle = (finite.min() + finite.max()) / 2 if finite.size else 0.0
    for i in range(values.shape[0]):
        for j in range(values.shape[1]):
            if np.isfinite(values[i, j]):
                dark = shown[i, j] > middle if log else shown[i, j] < middle
                ax.text(
                    j, i, f"{values[i, j]:.2f}", ha="center", va="center", color="white" if dark else "black"
                )
            elif np.isinf(values[i, j]):
                ax.text(j, i, DIVERGED, ha="center", va="center", color="black")
    ax.set_xticks(range(len(sites)), [f"{s} test" for s in sites])
    ax.set_yticks(range(len(labels)), labels)
    ax.set_title(title)
    fig.colorbar(
        image,
        ax=ax,
        label=f"log {metrics.main} (lower is better)" if log else f"{metrics.main} (higher is better)",
    )
    fig.savefig(path, dpi=120)
    plt.close(fig)


def rounds_figure(
    table: pd.DataFrame, path: Path, metrics: Metrics = TASK_METRICS[CAUSAL_LM]
) -> dict[str, dict[str, object]]:
    """Each site's metric of the aggregate per round, from the base model on, and the pooled model's as a
    dashed line in the site's colour where the run has the pooled baseline. Returns what it drew:
    {"aggregate": {site: [(round, value), ...]}, "pooled": {site: value}}."""
    plt = _pyplot()
    sites = list(table.columns[2:])
    fig, ax = plt.subplots(figsize=(6, 4), layout="constrained")
    base = table[table["model"] == BASE]
    merged = table[table["model"] == AGGREGATE].sort_values("round")
    pooled = table[table["model"] == POOLED]
    drawn: dict[str, dict[str, object]] = {"aggregate": {}, "pooled": {}}
    for k, site in enumerate(sites):
        color = f"C{k}"
        points = [(0, base[site].iloc[0])] if len(base) and _finite(base[site].iloc[0]) else []
        # A diverged round (infinite) is left out: the tables say "diverged".
        points += [(r, v) for r, v in zip(merged["round"], merged[site], strict=True) if _finite(v)]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", color=color, label=f"{site} test")
            drawn["aggregate"][site] = points
        if len(pooled) and _finite(pooled[site].iloc[0]):
            value = float(pooled[site].iloc[0])
            ax.axhline(value, color=color, ls="--", lw=1, label=f"{site} test: pooled model")
            drawn["pooled"][site] = value
    ax.set_xticks(sorted({0, *merged["round"]}))
    ax.set_xlabel("round (0 = base model)")
    ax.set_ylabel(f"{metrics.main} of the aggregate")
    if metrics.lower_is_better:
        ax.set_yscale("log")
        plain_log_ticks(ax.yaxis)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return drawn


def _finite(value) -> bool:
    return pd.notna(value) and math.isfinite(float(value))


# Under the loss figure when a later round starts at full rate: why its first steps may spike.
UNWARMED_ROUNDS_NOTE = (
    "Rounds after the first start at the rate the schedule has reached (federation.lr_schedule continue), "
    "without warmup, on a fresh site optimizer unless federation.site_optimizer is keep: AdamW's first "
    "update moves every weight by about that rate, so a round's first steps may spike the loss. "
    "lr_schedule restart warms up each round."
)


def unwarmed_rounds(curves: dict[str, list[tuple[int, pd.DataFrame]]]) -> list[int]:
    """The rounds whose first step's rate is at least half the previous round's last (no warmup of
    their own), from the loss files' lr column."""
    rounds = set()
    for runs in curves.values():
        ordered = sorted(runs, key=lambda x: x[0])
        for (_, before), (rnd, frame) in itertools.pairwise(ordered):
            if (
                "lr" in frame
                and "lr" in before
                and len(frame)
                and len(before)
                and frame["lr"].iloc[0] >= 0.5 * before["lr"].iloc[-1]
            ):
                rounds.add(rnd)
    return sorted(rounds)


def loss_figure(entries: Sequence[tuple[int, str, Path]], path: Path) -> str | None:
    """Every site's loss on one axis; round r continues after round r-1's last step. Returns the note
    printed under it (UNWARMED_ROUNDS_NOTE where a later round starts without warmup), or None."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    curves: dict[str, list[tuple[int, pd.DataFrame]]] = {}
    for rnd, site, csv in entries:
        if not Path(csv).is_file():
            _warn(f"{csv}: loss file not found; site {site} round {rnd} left out")
            continue
        frame = pd.read_csv(csv)
        if not {"step", "loss"} <= set(frame.columns):
            raise ReportError(f"{csv}: needs the columns step and loss; has {list(frame.columns)}")
        curves.setdefault(site, []).append((rnd, frame))
    boundaries: set[int] = set()
    for k, (site, runs) in enumerate(curves.items()):
        offset = 0
        for n, (_, frame) in enumerate(sorted(runs, key=lambda x: x[0])):
            ax.plot(
                frame["step"] + offset, frame["loss"], color=f"C{k}", label=site if n == 0 else None, lw=1.2
            )
            offset += int(frame["step"].max()) if len(frame) else 0
            boundaries.add(offset)
    if len({rnd for rnd, _, _ in entries}) > 1:
        for n, x in enumerate(sorted(boundaries)[:-1]):
            ax.axvline(x, color="grey", ls=":", lw=0.8, label="a round starts" if n == 0 else None)
    note = UNWARMED_ROUNDS_NOTE if unwarmed_rounds(curves) else None
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, wrap=True, va="bottom")
        fig.get_layout_engine().set(rect=(0, 0.12, 1, 0.88))
    ax.set_xlabel("optimizer step (rounds one after the other)")
    # Steps are whole numbers: no tick at step 2.5 of a short run.
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    if curves:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no loss curves", ha="center", va="center", transform=ax.transAxes)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return note


# ---------------------------------------------------------------------------------------------------


def settings_table(settings: dict) -> pd.DataFrame:
    """A nested config as one row per leaf key (`sites.alpha.train.backend`); lists stay JSON."""
    rows = []

    def walk(value, key):
        if isinstance(value, dict) and value:
            for name, inner in value.items():
                walk(inner, f"{key}.{name}" if key else str(name))
        else:
            rows.append((key, value if isinstance(value, str) else json.dumps(value)))

    walk(settings, "")
    return pd.DataFrame(rows, columns=["setting", "value"])


@dataclass(frozen=True)
class ReportJob:
    """What one report reads and where it goes (the CLI's arguments): the report folder, the evaluation
    results, each site model's training.json and loss.csv as (round, site, path), the run's settings
    (its config with defaults), the downstream task scores with the tasks to tabulate, and each pooled
    model's (lr, embedding/head lr factor)."""

    out_dir: str | Path
    evals: Sequence[str | Path]
    training: Sequence[tuple[int, str, Path]] = ()
    losses: Sequence[tuple[int, str, Path]] = ()
    settings: dict | None = None
    tasks: Sequence[str | Path] = ()
    task_names: Sequence[str] = ()
    pooled_points: Mapping[str, tuple[float, float]] | None = None


def report(job: ReportJob) -> dict[str, Path]:
    """The report's tables, figures and pages in `job.out_dir`; returns their paths by key."""
    evals, training, losses, settings = job.evals, job.training, job.losses, job.settings
    tasks, task_names, pooled_points = job.tasks, job.task_names, job.pooled_points
    out_dir = Path(job.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = load_evals(evals)
    if not results:
        raise ReportError("no evaluation results (--eval)")
    metrics = TASK_METRICS[results[0]["task"]]
    main = eval_table(results, metrics.main)
    second = eval_table([r for r in results if r.get(metrics.second) is not None], metrics.second)
    sites = list(main.columns[2:])
    train = training_table(training)

    paths = {
        f"{metrics.main}_csv": out_dir / f"{metrics.main}.csv",
        f"{metrics.main}_md": out_dir / f"{metrics.main}.md",
        f"{metrics.second}_csv": out_dir / f"{metrics.second}.csv",
        f"{metrics.main}_png": out_dir / f"{metrics.main}.png",
        "rounds_png": out_dir / "rounds.png",
        "training_csv": out_dir / "training.csv",
        "training_md": out_dir / "training.md",
        "loss_png": out_dir / "loss.png",
    }
    write_text(paths[f"{metrics.main}_csv"], main.to_csv(index=False))
    write_text(paths[f"{metrics.second}_csv"], second.to_csv(index=False))
    best = "lowest" if metrics.lower_is_better else "highest"
    bold = {"bold_min" if metrics.lower_is_better else "bold_max": sites}
    text = (
        f"{metrics.title} of each model (rows) on each site's test split (columns); the {best} per column "
        f"in bold. Round 0 is the base model.{MARKS if metrics.lower_is_better else ''}\n\n"
        + markdown(main, **bold)
    )
    if not metrics.lower_is_better:
        text += "\nMacro-F1 (the mean of the per-class F1 scores):\n\n" + markdown(second, **bold)
    write_text(paths[f"{metrics.main}_md"], text)
    second_title = (
        "Macro-F1 (the mean of the per-class F1 scores)"
        if not metrics.lower_is_better
        else ("Bits per byte (independent of the tokenizer)")
    )
    paths[f"{metrics.main}_html"] = out_dir / f"{metrics.main}.html"
    write_text(
        paths[f"{metrics.main}_html"],
        html_page(
            f"{metrics.title} of each model on each site's test split",
            [
                (
                    f"{metrics.title}: the {best} per column in bold. Round 0 is the base model."
                    + (MARKS if metrics.lower_is_better else ""),
                    main,
                    bold,
                ),
                (f"{second_title}:", second, bold),
            ],
        ),
    )
    training_digits = {
        "wall_time_s": 1,
        "tokens_per_s": 0,
        "job_tokens_per_s": 0,
        "final_loss": 4,
        "sent_mb": 3,
    }
    write_text(paths["training_csv"], train.to_csv(index=False))
    caption = TRAINING_CAPTION + (f" {TOKEN_STEPS_CAPTION}" if train.attrs.get("site_steps") else "")
    write_text(paths["training_md"], f"{caption}\n\n" + markdown(train, digits=training_digits))
    paths["training_html"] = out_dir / "training.html"
    write_text(
        paths["training_html"],
        html_page("Training of each site", [(caption, train, {"digits": training_digits})]),
    )
    gap = gap_table(main, metrics, pooled_points)
    if len(gap):
        paths.update(
            gap_csv=out_dir / "gap.csv",
            gap_md=out_dir / "gap.md",
            gap_html=out_dir / "gap.html",
            gap_png=out_dir / "gap.png",
        )
        write_text(paths["gap_csv"], gap.to_csv(index=False))
        gap_digits = {"digits": {site: 2 for site in sites}}
        write_text(
            paths["gap_html"], html_page("Federation gap to the pooled model", [("", gap, gap_digits)])
        )
        write_text(
            paths["gap_md"],
            f"Federation gap: {metrics.main} of each merged model relative to the pooled model (trained on "
            "every site's data at once with the same tokens); 1 is as good as pooling the data. "
            f"Yardsticks: {YOUR_SETTINGS} (the train section's lr), and where the run sweeps the pooled "
            f"model's lr (federation.pooled_lr_factors) also the {BEST_OF_SWEEP} (the lowest geometric "
            "mean over the sites; pooled_lr is its lr): a pooled model at the sites' lr takes many more "
            "sequential steps than a site and may be under-trained there, so a gap below 1 against it "
            "alone is no sign that federation beats pooling."
            + (SYNC_CAPTION if gap["pooled_model"].map(is_sync).any() else "")
            + "\n\n"
            + markdown(gap, digits={site: 2 for site in sites}),
        )
        gap_figure(gap, paths["gap_png"])
    heatmap(main, paths[f"{metrics.main}_png"], f"{metrics.title} on each site's test split", metrics)
    rounds_figure(main, paths["rounds_png"], metrics)
    loss_figure(losses, paths["loss_png"])
    for name, table in task_tables(tasks, task_names, sites).items():
        paths.update(
            {f"task_{name}_{ext}": out_dir / "tasks" / f"{name}.{ext}" for ext in ("csv", "md", "html")}
        )
        digits = {column: 4 for column in table.columns[2:]}
        heading = (
            f"Task {name} (lm-evaluation-harness): each model's scores. Round 0 is the base model; "
            "perplexities and bits per byte are better lower, accuracies higher."
        )
        write_text(paths[f"task_{name}_csv"], table.to_csv(index=False))
        write_text(paths[f"task_{name}_md"], f"{heading}\n\n" + markdown(table, digits=digits))
        write_text(
            paths[f"task_{name}_html"], html_page(f"Task {name}", [(heading, table, {"digits": digits})])
        )
    if settings is not None:
        table = settings_table(settings)
        paths["settings_csv"] = out_dir / "settings.csv"
        paths["settings_html"] = out_dir / "settings.html"
        write_text(paths["settings_csv"], table.to_csv(index=False))
        heading = "\n".join(data_read(settings))
        write_text(paths["settings_html"], html_page("Settings of the run", [(heading, table, {})]))
    return paths


def data_read(settings: dict) -> list[str]:
    """Where each site's text was read, one line a site ("site cs: data read only on karolina"), from the
    run's settings.json (the validated config; dataset.shareable). Nothing for settings of no run."""
    if "sites" not in settings:
        return []
    return ["Where each site's text was read (sites.<site>.dataset.shareable):", *data_lines(settings)]


def _settings(path: str | None) -> dict | None:
    if path is None:
        return None
    try:
        settings = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ReportError(f"--settings: {path}: not a readable JSON file: {e}") from None
    if not isinstance(settings, dict):
        raise ReportError(f"--settings: {path}: must hold a JSON object (the run's config)")
    return settings


@cli.entry("fedtune.report.build", offline=True)
def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.parser("fedtune.report.build", __doc__.split("\n\n")[0])
    cli.add_out(parser, "report folder")
    cli.add_list(parser, "--eval", "JSON", "evaluate results", required=True)
    cli.add_list(parser, "--training", "ROUND:SITE=JSON", "training.json of each site model")
    cli.add_list(parser, "--loss", "ROUND:SITE=CSV", "loss.csv of each site model")
    parser.add_argument("--settings", metavar="JSON", help="a JSON file of the run's config (with defaults)")
    cli.add_list(parser, "--tasks", "CSV", "downstream task scores")
    cli.add_list(parser, "--task-names", "TASK", "one table per task")
    cli.add_list(
        parser, "--pooled-point", "MODEL=LR,FACTOR", "each pooled model's lr and embedding/head lr factor"
    )
    args = parser.parse_args(argv)
    pooled_points = dict(parse_pooled_point(item) for item in args.pooled_point)
    training = [parse_labelled(item, "--training") for item in args.training]
    losses = [parse_labelled(item, "--loss") for item in args.loss]
    settings = _settings(args.settings)
    if bool(args.tasks) != bool(args.task_names):
        raise ReportError("--tasks and --task-names go together: the score CSVs and the tasks to tabulate")
    paths = report(
        ReportJob(args.out, args.eval, training, losses, settings, args.tasks, args.task_names, pooled_points)
    )
    table = next(path for key, path in paths.items() if key.endswith("_md") and key != "training_md")
    print(Path(table).read_text(encoding="utf-8"), file=sys.stderr)
    for line in data_read(settings or {}):
        print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
