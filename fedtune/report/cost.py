"""What the run cost, per round and cluster: bytes sent and received, where the time went, node-hours,
GPU-hours and energy; and at the end the final perplexity beside the node-hours spent, the pooled
baseline's beside it.

    python -m fedtune.report.cost --run results/<run> --settings results/<run>/report/settings.json \\
        --eval results/<run>/round-*/eval/aggregate/*.json ... --crossing 1:leonardo:karolina=round-1/beta/model \\
        --out results/<run>/report

Inputs, all read from the run folder:
- the job records of <run>/logs/jobs/ (fedtune.core.job_record: each command's start, end, processes and
  Slurm job id);
- for the jobs that ran under Slurm, `sacct` (run here, with a time limit): submit and start times (the
  queue wait), elapsed time x allocated nodes (node-hours) and GPUs (GPU-hours, from AllocTRES), and
  ConsumedEnergyRaw where the site measures it ("not measured by the site" where it gives none). Without
  sacct, or when it fails, the table says "not available" and counts wall time x processes, as for jobs
  that ran without Slurm;
- the crossing items' completion markers (whatever files they list, their sizes: what crossed);
- the other clusters' own tables (--remote-jobs: each cluster where the models do not meet runs
  `--jobs-only CLUSTER` after its last job, with its own sacct, and sends the CSV like a score);
- the sites' training.json (tokens; the wall time of a site trained on a cluster that sent no table) and
  the evaluation results (the final perplexity).

Outputs in --out: cost.csv / .md / .html (one row per round and cluster), cost.png (the time split and the
node-hours), cost_items.csv (each crossing item's bytes), cost_jobs.csv (each command with its job's
accounting), cost_summary.csv (perplexity and node-hours of the federation and of the pooled baseline).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pandas as pd

from fedtune.core import cli
from fedtune.core.atomic import write_text
from fedtune.core.metrics import LOWER_IS_BETTER, MAIN_METRICS
from fedtune.report.build import ReportError, html_page, markdown

NOT_MEASURED = "not measured by the site"
NOT_MEASURED_LOCAL = "not measured (local)"
NOT_AVAILABLE = "not available"
SACCT_FIELDS = ["JobID", "Submit", "Start", "End", "ElapsedRaw", "NNodes", "AllocTRES", "ConsumedEnergyRaw"]
# The columns of the time split, in the order a round spends them.
TIME_COLUMNS = ["prepare_s", "queue_s", "training_s", "transfer_s", "wait_s", "merge_s", "evaluation_s"]
ROUND_COLUMNS = [
    "round",
    "cluster",
    "bytes_sent",
    "bytes_received",
    *TIME_COLUMNS,
    "node_hours",
    "gpu_hours",
    "energy_kwh",
    "accounting",
]
STAGES = {
    "fedtune.train": "training",
    "fedtune.aggregate": "merge",
    "fedtune.aggregate.adapters": "merge",
    "fedtune.evaluate": "evaluation",
    "fedtune.evaluate.downstream": "evaluation",
    "fedtune.core.transfer": "transfer",
    # federation.exchange compressed: compressing an update and rebuilding a model are the exchange's cost.
    "fedtune.core.updates": "transfer",
    "fedtune.tokenize": "prepare",
    "fedtune.download": "prepare",
}
COST_CAPTION = (
    "What each round cost on each cluster. bytes_sent / bytes_received: the files the crossing items' "
    "completion markers list. Times are the commands' seconds, summed over a round's jobs (sites trained at "
    "once add up): prepare_s (download, tokenize: round 0), queue_s (Slurm: submit to start), training_s, "
    "transfer_s (copying, and with a compressed exchange compressing and rebuilding), wait_s (a fetch waiting for another cluster's item), merge_s, evaluation_s. "
    "node_hours and gpu_hours: Slurm's accounting (elapsed x allocated nodes or GPUs) where the jobs ran "
    "under Slurm, else wall time x processes (node-hours) and x visible GPUs. energy_kwh: sacct's "
    f"ConsumedEnergy; '{NOT_MEASURED}' where the site gives none. accounting says which applies."
)


@dataclass
class Accounting:
    """sacct's record of one job (an allocation)."""

    job_id: str
    queue_s: float | None
    elapsed_s: float
    nodes: int
    gpus: int
    energy_j: float | None  # None: the site does not measure it


def _arg(argv: Sequence[str], option: str) -> str | None:
    for k, word in enumerate(argv):
        if word == option and k + 1 < len(argv):
            return argv[k + 1]
        if word.startswith(option + "="):
            return word.split("=", 1)[1]
    return None


def _round_of_path(path: str | None) -> int | None:
    match = re.search(r"(?:^|/)round-(\d+)/", path or "")
    return int(match.group(1)) if match else None


def classify(record: dict) -> tuple[str, int | None, str | None] | None:
    """(stage, round, site or model) of a job record; None for commands that cost nothing worth a column
    (the report, tracking) or a run of the scaling sweep."""
    stage = STAGES.get(record["command"])
    argv = record.get("argv", [])
    if stage is None:
        return None
    if stage == "prepare":
        return stage, 0, None
    if stage == "training":
        out = _arg(argv, "--out") or ""
        if re.search(r"(?:^|/)pooled/model/?$", out):
            return "pooled", None, "pooled"
        match = re.search(r"(?:^|/)round-(\d+)/([^/]+)/model/?$", out)
        return (stage, int(match.group(1)), match.group(2)) if match else None
    if stage == "merge":
        return stage, _round_of_path(_arg(argv, "--out")), None
    if stage == "evaluation":
        label, rnd = _arg(argv, "--label"), _arg(argv, "--round")
        if label == "pooled":
            return "pooled", None, "pooled"
        return stage, int(rnd) if rnd and rnd.isdigit() else 0, label
    rnd = _arg(argv, "--round")
    item = _arg(argv, "--out") or _arg(argv, "--path") or _arg(argv, "--item")
    # A manifest crosses before the rounds: round 0.
    return stage, int(rnd) if rnd and rnd.isdigit() else _round_of_path(item) or 0, item


def load_records(folder: Path) -> list[dict]:
    records = []
    for path in sorted(Path(folder).glob("*.json")) if Path(folder).is_dir() else []:
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            print(f"report: warning: {path}: not a job record ({e}); left out", file=sys.stderr)
            continue
        if isinstance(record, dict) and {"command", "started", "ended"} <= set(record):
            records.append(record)
    return records


# ---------------------------------------------------------------------------------------------------
# Slurm's accounting


def parse_tres(tres: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in tres.split(",") if "=" in part)


def _count(text: str | None) -> int:
    match = re.match(r"\d+", text or "")
    return int(match.group(0)) if match else 0


def _time(text: str) -> datetime | None:
    try:
        return datetime.fromisoformat(text)
    except ValueError:  # Unknown, None
        return None


def parse_sacct(text: str) -> dict[str, Accounting]:
    """`sacct -X -n -P -o <SACCT_FIELDS>` lines -> job id -> Accounting (a requeued job: its last line)."""
    jobs = {}
    for line in text.splitlines():
        cells = line.split("|")
        if len(cells) != len(SACCT_FIELDS):
            continue
        row = dict(zip(SACCT_FIELDS, cells, strict=True))
        submit, start = _time(row["Submit"]), _time(row["Start"])
        energy = row["ConsumedEnergyRaw"].strip()
        tres = parse_tres(row["AllocTRES"])
        jobs[row["JobID"]] = Accounting(
            job_id=row["JobID"],
            queue_s=(start - submit).total_seconds() if submit and start else None,
            elapsed_s=float(_count(row["ElapsedRaw"])),
            nodes=_count(row["NNodes"]) or _count(tres.get("node")),
            gpus=_count(tres.get("gres/gpu")),
            # A site without an energy plugin reports nothing, or 0 (no job uses 0 J).
            energy_j=float(energy) if energy.isdigit() and int(energy) > 0 else None,
        )
    return jobs


def slurm_accounting(job_ids: Sequence[str], timeout: float = 60) -> tuple[dict[str, Accounting], str]:
    """sacct's records of the jobs, and a note: "" when sacct answered, else why it is not available."""
    if not job_ids:
        return {}, ""
    if shutil.which("sacct") is None:
        return {}, "sacct not found"
    command = ["sacct", "-X", "-n", "-P", "-j", ",".join(sorted(set(job_ids))), "-o", ",".join(SACCT_FIELDS)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {}, f"sacct gave no answer in {timeout:g} s"
    if result.returncode != 0:
        return {}, f"sacct failed: {result.stderr.strip().splitlines()[-1:] or result.returncode}"
    return parse_sacct(result.stdout), ""


# ---------------------------------------------------------------------------------------------------
# Bytes that crossed


@dataclass(frozen=True)
class CrossingItem:
    round: int
    maker: str
    receiver: str
    item: str


def parse_crossing(text: str) -> CrossingItem:
    key, sep, item = text.partition("=")
    parts = key.split(":")
    if not (sep and item and len(parts) == 3 and parts[0].isdigit() and all(parts)):
        raise ReportError(f"--crossing: {text!r} is not ROUND:MAKER:RECEIVER=ITEM")
    return CrossingItem(int(parts[0]), parts[1], parts[2], item)


def _marker_files(marker: Path) -> list[Path] | None:
    """The files a completion marker lists (sha256sum lines, named relative to the marker's folder)."""
    try:
        lines = marker.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    names = [line.partition("  ")[2] for line in lines if "  " in line]
    return [marker.parent / name for name in names if name]


def item_bytes(run: Path, item: str) -> tuple[int, int, str]:
    """(files, bytes, where from) of what crossed for `item`: the files its marker lists (in the exchange
    folder first: what actually travels, compressed or not), else the item's own files here."""
    for base in (run / "exchange" / "outbox", run / "exchange" / "inbox", run):
        marker = base / f"{item}.COMPLETE"
        files = _marker_files(marker)
        if files is not None:
            present = [f for f in files if f.is_file()]
            # A received item's marker names files that may since have moved into place (receive).
            present += [
                run / f.relative_to(base)
                for f in files
                if not f.is_file() and (run / f.relative_to(base)).is_file()
            ]
            return len(files), sum(f.stat().st_size for f in present), str(marker.relative_to(run))
    path = run / item
    if path.is_dir():
        files = [p for p in path.rglob("*") if p.is_file()]
        return len(files), sum(p.stat().st_size for p in files), f"{item}/ (no marker here)"
    if path.is_file():
        return 1, path.stat().st_size, f"{item} (no marker here)"
    return 0, 0, "not here"


def items_table(run: Path, crossings: Sequence[CrossingItem]) -> pd.DataFrame:
    rows = []
    for c in crossings:
        files, size, source = item_bytes(run, c.item)
        rows.append(
            {"round": c.round, "item": c.item, "from": c.maker, "to": c.receiver, "files": files,
             "bytes": size if source != "not here" else None, "counted_from": source}
        )  # fmt: skip
    return pd.DataFrame(rows, columns=["round", "item", "from", "to", "files", "bytes", "counted_from"])


# ---------------------------------------------------------------------------------------------------
# The tables


def _newest_mtime(path: Path) -> float | None:
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path] if path.is_file() else []
    return max((p.stat().st_mtime for p in files), default=None)


def transfer_split(record: dict, run: Path) -> tuple[float, float]:
    """(transfer_s, wait_s) of a fetch or receive: the time before the item was ready at its maker (its
    newest file's time, which rsync -a keeps) is waiting for the other cluster, the rest is the copy.
    The clusters' clocks are taken to agree (NTP); a push or mark is all transfer."""
    wall = record["ended"] - record["started"]
    argv = record.get("argv", [])
    if not argv or argv[0] not in ("fetch", "receive"):
        return wall, 0.0
    out = _arg(argv, "--out") or _arg(argv, "--item")
    if not out:
        return wall, 0.0
    # --out is relative to the workflow's directory, where this report runs too; --item to the run folder.
    found = [p for p in (Path(out), run / out) if p.exists()]
    ready = _newest_mtime(found[0]) if found else None
    if ready is None:
        return wall, 0.0
    wait = min(max(ready - record["started"], 0.0), wall)
    return wall - wait, wait


def jobs_table(
    records: Sequence[dict], accounting: dict[str, Accounting], run: Path, cluster: str, note: str
) -> pd.DataFrame:
    """One row per command: its stage, round, seconds, and its share of its Slurm job's accounting (a job
    that ran several commands, a round's merge and evaluations, shares it by their seconds)."""
    shares: dict[str, float] = {}
    for r in records:
        if r.get("slurm_job_id"):
            shares[r["slurm_job_id"]] = shares.get(r["slurm_job_id"], 0.0) + max(
                r["ended"] - r["started"], 1e-9
            )
    rows, queued = [], set()
    for r in sorted(records, key=lambda r: r["started"]):
        kind = classify(r)
        if kind is None:
            continue
        stage, rnd, what = kind
        wall = r["ended"] - r["started"]
        transfer, wait = transfer_split(r, run) if stage == "transfer" else (None, None)
        job = r.get("slurm_job_id")
        acct = accounting.get(job) if job else None
        row = {
            "round": rnd, "cluster": cluster, "stage": stage, "what": what, "command": r["command"],
            "wall_s": wall, "transfer_s": transfer, "wait_s": wait, "processes": r.get("processes", 1),
            "slurm_job_id": job, "queue_s": None, "nodes": None, "gpus": None, "elapsed_s": None,
            "node_hours": None, "gpu_hours": None, "energy_kwh": None,
        }  # fmt: skip
        if acct is not None:
            share = max(wall, 1e-9) / shares[job]
            row.update(
                nodes=acct.nodes, gpus=acct.gpus, elapsed_s=acct.elapsed_s,
                node_hours=acct.elapsed_s * acct.nodes * share / 3600,
                gpu_hours=acct.elapsed_s * acct.gpus * share / 3600,
                energy_kwh=acct.energy_j * share / 3.6e6 if acct.energy_j is not None else NOT_MEASURED,
                accounting="sacct",
            )  # fmt: skip
            if job not in queued:  # the queue wait belongs to the job, once
                row["queue_s"] = acct.queue_s
                queued.add(job)
        else:
            processes = r.get("processes") or 1
            row.update(
                node_hours=wall * processes / 3600,
                gpu_hours=wall * (r.get("gpus") or 0) / 3600,
                energy_kwh=NOT_MEASURED if job else NOT_MEASURED_LOCAL,
                accounting=f"wall x processes (sacct {note})" if job else "wall x processes (local)",
            )
        rows.append(row)
    columns = [
        "round", "cluster", "stage", "what", "command", "wall_s", "transfer_s", "wait_s", "processes",
        "slurm_job_id", "queue_s", "nodes", "gpus", "elapsed_s", "node_hours", "gpu_hours", "energy_kwh",
        "accounting",
    ]  # fmt: skip
    table = pd.DataFrame(rows, columns=columns)
    table["round"] = pd.to_numeric(table["round"]).astype("Int64")
    return table


def remote_training(
    training: Sequence[tuple[int, str, Path]], jobs: pd.DataFrame, clusters: dict
) -> list[dict]:
    """Sites trained elsewhere (no record here): their training.json's wall time; their accounting is on
    their own cluster."""
    here = {(r, w) for r, w in zip(jobs["round"], jobs["what"], strict=True)} if len(jobs) else set()
    rows = []
    for rnd, site, path in training:
        if (rnd, site) in here or site == "pooled" or not Path(path).is_file():
            continue
        t = json.loads(Path(path).read_text(encoding="utf-8"))
        rows.append(
            {"round": rnd, "cluster": clusters.get(site, "?"), "stage": "training", "what": site,
             "command": "fedtune.train", "wall_s": t.get("wall_time_s"),
             "accounting": f"training.json only (accounting on {clusters.get(site, 'its cluster')})"}
        )  # fmt: skip
    return rows


def _sum(values) -> float | None:
    numbers = [
        v for v in values if isinstance(v, int | float) and not (isinstance(v, float) and math.isnan(v))
    ]
    return sum(numbers) if numbers else None


def round_table(jobs: pd.DataFrame, items: pd.DataFrame) -> pd.DataFrame:
    """One row per (round, cluster): bytes, the time split, node-hours, GPU-hours, energy."""
    keys = set()
    part = jobs[jobs["stage"] != "pooled"] if len(jobs) else jobs
    keys |= {(int(r), c) for r, c in zip(part["round"], part["cluster"], strict=True) if pd.notna(r)}
    for _, item in items.iterrows():
        keys |= {(int(item["round"]), item["from"]), (int(item["round"]), item["to"])}
    rows = []
    for rnd, cluster in sorted(keys):
        mine = (
            part[((part["round"] == rnd) & (part["cluster"] == cluster)).fillna(False)] if len(part) else part
        )
        by_stage = {
            s: mine[mine["stage"] == s] for s in ("prepare", "training", "merge", "evaluation", "transfer")
        }
        energy = list(mine["energy_kwh"]) if len(mine) else []
        measured = [e for e in energy if isinstance(e, float)]
        unmeasured = sorted({e for e in energy if isinstance(e, str)})
        sent = items[(items["round"] == rnd) & (items["from"] == cluster)]["bytes"] if len(items) else []
        received = items[(items["round"] == rnd) & (items["to"] == cluster)]["bytes"] if len(items) else []
        ways = sorted({a for a in mine["accounting"] if isinstance(a, str)}) if len(mine) else []
        rows.append(
            {
                "round": rnd,
                "cluster": cluster,
                "bytes_sent": int(_sum(sent) or 0),
                "bytes_received": int(_sum(received) or 0),
                "prepare_s": _sum(by_stage["prepare"]["wall_s"]),
                "queue_s": _sum(mine["queue_s"]) if len(mine) else None,
                "training_s": _sum(by_stage["training"]["wall_s"]),
                "transfer_s": _sum(by_stage["transfer"]["transfer_s"]),
                "wait_s": _sum(by_stage["transfer"]["wait_s"]),
                "merge_s": _sum(by_stage["merge"]["wall_s"]),
                "evaluation_s": _sum(by_stage["evaluation"]["wall_s"]),
                "node_hours": _sum(mine["node_hours"]) if len(mine) else None,
                "gpu_hours": _sum(mine["gpu_hours"]) if len(mine) else None,
                # Measured only where every job of the row was: a partial sum would pass for the whole.
                "energy_kwh": sum(measured) if energy and len(measured) == len(energy) else (
                    "; ".join(unmeasured) if energy else None),
                "accounting": "; ".join(ways) if ways else "–",
            }
        )  # fmt: skip
    return pd.DataFrame(rows, columns=ROUND_COLUMNS)


def _mean_metric(evals: Sequence[dict], model: str, rnd: int | None) -> tuple[str | None, float | None]:
    chosen = [
        e for e in evals if e.get("model") == model and (rnd is None or int(e.get("round") or 0) == rnd)
    ]
    for metric in MAIN_METRICS:
        values = [e[metric] for e in chosen if e.get(metric) is not None]
        if values:
            if metric in LOWER_IS_BETTER and not all(math.isfinite(v) for v in values):
                return metric, math.inf  # a diverged site: the report prints "diverged"
            return metric, sum(values) / len(values)
    return None, None


def summary_table(
    jobs: pd.DataFrame, evals: Sequence[dict], training: Sequence[tuple[int, str, Path]]
) -> pd.DataFrame:
    """The federation's final metric (the last round's aggregate, the mean over the sites) beside the
    node-hours it took, and the pooled baseline's (trained on the same tokens) beside its own."""
    tokens = {"federation": 0, "pooled": 0}
    for _, site, path in training:
        if Path(path).is_file():
            t = json.loads(Path(path).read_text(encoding="utf-8"))
            value = t.get("tokens_seen", t.get("tokens")) or 0
            tokens["pooled" if site == "pooled" else "federation"] += value
    last = max((int(e.get("round") or 0) for e in evals if e.get("model") == "aggregate"), default=None)
    rows = []
    for name, model, rnd in (("federation", "aggregate", last), ("pooled baseline", "pooled", None)):
        metric, value = _mean_metric(evals, model, rnd)
        if value is None:
            continue
        if name == "federation":
            part = jobs[jobs["stage"] != "pooled"] if len(jobs) else jobs
            trained = part[part["stage"] == "training"] if len(part) else part
        else:
            part = jobs[jobs["stage"] == "pooled"] if len(jobs) else jobs
            trained = part[part["command"] == "fedtune.train"] if len(part) else part
        total = _sum(part["node_hours"]) if len(part) else None
        rows.append(
            {"model": name, "round": rnd, "tokens": tokens["pooled" if model == "pooled" else "federation"],
             "metric": metric, "value": value,
             "node_hours_training": _sum(trained["node_hours"]) if len(trained) else None,
             "node_hours_total": total}
        )  # fmt: skip
    # Each against the pooled baseline, which reads the right way whichever way the metric is better (a
    # metric divided by node-hours would reward a higher perplexity).
    pooled = next((row for row in rows if row["model"] == "pooled baseline"), None)
    for row in rows:
        row["value_vs_pooled"] = row["value"] / pooled["value"] if pooled and pooled["value"] else None
        hours, pooled_hours = row["node_hours_total"], pooled and pooled["node_hours_total"]
        row["node_hours_vs_pooled"] = hours / pooled_hours if hours is not None and pooled_hours else None
    columns = ["model", "round", "tokens", "metric", "value", "node_hours_training", "node_hours_total",
               "value_vs_pooled", "node_hours_vs_pooled"]  # fmt: skip
    table = pd.DataFrame(rows, columns=columns)
    table["round"] = pd.to_numeric(table["round"]).astype("Int64")
    return table


def cost_figure(table: pd.DataFrame, path: Path) -> None:
    """Per (round, cluster), the time split as stacked bars; the node-hours written above each bar."""
    from fedtune.report.build import _pyplot

    plt = _pyplot()
    labels = [f"r{r} {c}" for r, c in zip(table["round"], table["cluster"], strict=True)]
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(labels) + 2), 4), layout="constrained")
    bottom = [0.0] * len(table)
    for k, column in enumerate(TIME_COLUMNS):
        values = [
            float(v) if isinstance(v, int | float) and not math.isnan(v) else 0.0 for v in table[column]
        ]
        if any(values):
            ax.bar(labels, values, bottom=bottom, color=f"C{k}", label=column.removesuffix("_s"))
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for x, (top, hours) in enumerate(zip(bottom, table["node_hours"], strict=True)):
        if isinstance(hours, int | float) and not math.isnan(hours):
            ax.annotate(f"{hours:.3g} nh", (x, top), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("seconds (the round's jobs summed)")
    ax.set_xlabel("round, cluster (nh: node-hours)")
    if len(labels):
        # Room above the tallest bar for its node-hours, and the legend outside the bars, to their right:
        # inside, it covered the label of the last bar.
        ax.set_ylim(0, max(bottom) * 1.12 or 1)
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    else:
        ax.text(0.5, 0.5, "no job records", ha="center", va="center", transform=ax.transAxes)
    ax.grid(alpha=0.3, axis="y")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def own_jobs(run: Path, cluster: str, sacct_timeout: float) -> tuple[pd.DataFrame, str]:
    """This cluster's commands with their accounting (jobs_table), and why sacct gave none ("" if it did)."""
    if not run.is_dir():
        raise ReportError(f"--run: {run} is not a folder")
    records = load_records(run / "logs" / "jobs")
    job_ids = [r["slurm_job_id"] for r in records if r.get("slurm_job_id")]
    accounting, note = slurm_accounting(job_ids, sacct_timeout)
    if note:
        print(f"report: warning: Slurm accounting {NOT_AVAILABLE}: {note}", file=sys.stderr)
    return jobs_table(records, accounting, run, cluster, f"{NOT_AVAILABLE}: {note}" if note else ""), note


def read_jobs_part(path: Path, columns) -> pd.DataFrame:
    """Another cluster's jobs table (its --jobs-only output), checked for the columns this one writes."""
    try:
        part = pd.read_csv(path)
    except (OSError, ValueError) as error:
        raise ReportError(f"--remote-jobs: {path}: {error}") from error
    missing = [c for c in columns if c not in part.columns]
    if missing:
        raise ReportError(
            f"--remote-jobs: {path}: no column {', '.join(missing)} (written by another version?)"
        )
    return part[list(columns)]


@dataclass(frozen=True)
class CostJob:
    """What one cost report reads and where it goes (the CLI's arguments): the run folder, the report
    folder, the run's validated config, the evaluation results, each site model's training.json as
    (round, site, path), what crosses between clusters, and the other clusters' job tables."""

    run: str | Path
    out_dir: str | Path
    settings: dict | None = None
    evals: Sequence[str | Path] = ()
    training: Sequence[tuple[int, str, Path]] = ()
    crossings: Sequence[CrossingItem] = ()
    remote_jobs: Sequence[str | Path] = ()


def cost_report(job: CostJob, sacct_timeout: float = 60) -> dict[str, Path]:
    """The cost tables and figure in `job.out_dir`, sacct given `sacct_timeout` seconds; returns their
    paths by file name."""
    run, out_dir = Path(job.run), Path(job.out_dir)
    evals, training, crossings, remote_jobs = job.evals, job.training, job.crossings, job.remote_jobs
    settings = job.settings or {}
    sites = settings.get("sites") or {}
    named = {(site or {}).get("cluster") for site in sites.values()} - {None}
    # A one-cluster run is named by its sites' cluster when they name one (slurm-local), else "local".
    cluster = settings.get("cluster") or (named.pop() if len(named) == 1 else "local")
    site_clusters = {name: (site or {}).get("cluster") or cluster for name, site in sites.items()}
    jobs, note = own_jobs(run, cluster, sacct_timeout)
    # The other clusters' own accounting (each sends its table after its last job); what none sent is
    # estimated from the sites' training.json below.
    parts = [read_jobs_part(Path(p), jobs.columns) for p in remote_jobs]
    if parts:
        jobs = pd.concat([jobs, *parts], ignore_index=True)
        jobs["round"] = pd.to_numeric(jobs["round"]).astype("Int64")
    remote = remote_training(training, jobs, site_clusters)
    if remote:
        jobs = pd.concat([jobs, pd.DataFrame(remote, columns=jobs.columns)], ignore_index=True)
    items = items_table(run, crossings)
    table = round_table(jobs, items)
    results = [json.loads(Path(p).read_text(encoding="utf-8")) for p in evals]
    summary = summary_table(jobs, results, training)

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: out_dir / name for name in ("cost.csv", "cost.md", "cost.html", "cost.png", "cost_items.csv",
                                                "cost_jobs.csv", "cost_summary.csv")}  # fmt: skip
    write_text(paths["cost.csv"], table.to_csv(index=False))
    write_text(paths["cost_items.csv"], items.to_csv(index=False))
    write_text(paths["cost_jobs.csv"], jobs.to_csv(index=False))
    write_text(paths["cost_summary.csv"], summary.to_csv(index=False))
    digits = {c: 1 for c in TIME_COLUMNS} | {"node_hours": 4, "gpu_hours": 4, "energy_kwh": 4}
    summary_note = (
        "The final metric (the mean over the sites' test splits) beside the node-hours spent: the federation's "
        "(its training alone, and everything this cluster ran) and the pooled baseline's, trained on the "
        "same tokens. value_vs_pooled: the metric as a multiple of the pooled baseline's (1 is as good as "
        "pooling; for a perplexity, above 1 is worse, for an accuracy, below 1); node_hours_vs_pooled: all "
        "node-hours as a multiple of the pooled baseline's."
    )
    accounting_note = f"Slurm accounting {NOT_AVAILABLE}: {note}." if note else ""
    text = f"{COST_CAPTION}\n\n{accounting_note}\n\n" if accounting_note else f"{COST_CAPTION}\n\n"
    text += markdown(table, digits=digits)
    text += (
        "\nBytes of each item that crossed between clusters:\n\n" + markdown(items, digits=0)
        if len(items)
        else "\nNothing crossed between clusters (a one-cluster run).\n"
    )
    text += f"\n{summary_note}\n\n" + markdown(
        summary,
        digits={
            "value": 3,
            "value_vs_pooled": 3,
            "node_hours_vs_pooled": 3,
            "node_hours_training": 4,
            "node_hours_total": 4,
        },
    )
    write_text(paths["cost.md"], text)
    sections = [(f"{COST_CAPTION}\n{accounting_note}".strip(), table, {"digits": digits})]
    if len(items):
        sections.append(("Bytes of each item that crossed between clusters:", items, {"digits": 0}))
    sections.append((summary_note, summary, {"digits": 4}))
    write_text(paths["cost.html"], html_page("What the run cost, per round and cluster", sections))
    cost_figure(table, paths["cost.png"])
    return paths


@cli.entry("fedtune.report.cost", offline=True)
def main(argv: Sequence[str] | None = None) -> int:
    from fedtune.report.build import _settings, parse_labelled

    parser = cli.parser("fedtune.report.cost", __doc__.split("\n\n")[0])
    cli.add_out(parser, "report folder")
    parser.add_argument("--run", required=True, help="the run folder (its logs/jobs/ records, its items)")
    parser.add_argument(
        "--settings", metavar="JSON", help="the run's validated config (report/settings.json)"
    )
    cli.add_list(parser, "--eval", "JSON", "evaluate results (the final perplexity)")
    cli.add_list(parser, "--training", "ROUND:SITE=JSON", "training.json of each site model")
    cli.add_list(parser, "--crossing", "ROUND:MAKER:RECEIVER=ITEM", "what crosses between clusters")
    cli.add_list(parser, "--remote-jobs", "CSV", "the other clusters' tables written with --jobs-only")
    parser.add_argument(
        "--jobs-only",
        metavar="CLUSTER",
        help="write only this cluster's commands with their accounting to --out (a CSV file): what a cluster "
        "where the models do not meet sends to the report",
    )
    parser.add_argument("--sacct-timeout", type=float, default=60, help="seconds sacct may take (default 60)")
    args = parser.parse_args(argv)
    if args.jobs_only:
        jobs, _ = own_jobs(Path(args.run), args.jobs_only, args.sacct_timeout)
        write_text(Path(args.out), jobs.to_csv(index=False))
        print(f"report: {len(jobs)} commands of {args.jobs_only} -> {args.out}", file=sys.stderr)
        return 0
    job = CostJob(
        args.run,
        args.out,
        settings=_settings(args.settings),
        evals=args.eval,
        training=[parse_labelled(item, "--training") for item in args.training],
        crossings=[parse_crossing(item) for item in args.crossing],
        remote_jobs=args.remote_jobs,
    )
    paths = cost_report(job, args.sacct_timeout)
    print(paths["cost.md"].read_text(encoding="utf-8"), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
