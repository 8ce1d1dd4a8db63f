"""How far a run is, read from its folder alone (no Slurm call): per round and site, the training step
reached, the newest checkpoint, the last loss and tokens/s and an estimate of the time left; then
whether each round's aggregate and evaluations exist. After the run it prints the same table as a
summary.

    python -m fedtune.report.status [--configfile config/config.yaml] [--profile profiles/karolina]

In a multi-cluster federation it reports the part of the cluster it runs on, which the profile names
(its `config: cluster:`, as Snakemake reads it; `--profile`, else $SNAKEMAKE_PROFILE) or `--cluster`
names: that cluster's sites, what it sends the others (the markers and receipts of
fedtune.core.transfer), and on a cluster where the models do not meet, the newest aggregate it received.

Sources, newest information first: the train job's log (`logs/train/round-<r>/<site>.log`, one line
every `log_every` steps), the newest complete checkpoint (`checkpoints/step-*/trainer.json` and
`loss.csv`) and, once a site is done, its model folder (`model/training.json` and `loss.csv`)."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from fedtune.core import cli
from fedtune.core.metrics import TASK_METRICS
from fedtune.core.options import UserError
from fedtune.run import scoring
from fedtune.run.crossings import Crossing, aggregate_item, crossing_items, transfer_mode
from fedtune.train import checkpoint

DEFAULT_CONFIG = "config/config.yaml"
# The progress line fedtune.train.loop prints: "step 40/60 | loss 3.1234 | ... | 12,345 tok/s | ...".
LOG_STEP = re.compile(r"^step (\d+)/(\d+) \| loss ([-+.\deE]+|nan) \|.*\| ([\d,.]+) tok/s")


@dataclass(frozen=True)
class RunLayout:
    """What status needs from a config: where the run lives and what it holds."""

    run_dir: Path
    rounds: int
    sites: tuple[str, ...]
    report_table: str = "perplexity.csv"  # the report's main table, written last
    merged: tuple[str, ...] = ("aggregate",)  # the aggregate and the methods of aggregate.compare
    intermediate: str = "all"  # evaluate.intermediate: which models of the rounds before the last
    # A multi-cluster federation: the cluster status runs on, where the models meet, what crosses.
    cluster: str | None = None
    aggregate_on: str | None = None
    crossings: tuple[Crossing, ...] = ()
    push_to: frozenset[str] = frozenset()  # receivers whose files their makers push
    aggregate_item: str = "model"
    # federation.participation: each round's sites (index round - 1); empty: every site, every round.
    participants: tuple[tuple[str, ...], ...] = ()

    def round_sites(self, round: int) -> tuple[str, ...]:
        """This layout's sites that train in `round`."""
        if not self.participants:
            return self.sites
        return tuple(s for s in self.sites if s in self.participants[round - 1])

    # (round, path) of each round's scores, wherever made (fedtune.run.scoring); empty: `evaluated` x sites.
    round_scores: tuple[tuple[int, str], ...] = ()

    @property
    def aggregates_here(self) -> bool:
        return self.cluster is None or self.cluster == self.aggregate_on

    def evaluated(self, round: int) -> tuple[str, ...]:
        """The models the workflow evaluates after `round` (as common.smk's round_models)."""
        if round == self.rounds or self.intermediate == "all":
            return (*self.round_sites(round), *self.merged)
        return self.merged if self.intermediate == "aggregate" else ()


def layout_from_config(path: str | Path, cluster: str | None = None) -> RunLayout:
    """The run folder, rounds and sites of a config, with the schema's defaults applied; `cluster`, where
    given, replaces the config's (as a profile's `config: cluster:` does for Snakemake)."""
    from fedtune.core.config_files import read_config_file
    from fedtune.run.config import build_run_config

    raw = read_config_file(path)
    if cluster is not None:
        raw = {**raw, "cluster": cluster}
    run = build_run_config(raw, source=str(path))
    if run.cluster is not None:
        known = sorted({site.cluster for site in run.sites.values()} | {run.aggregate_on})
        if run.cluster not in known:
            raise UserError(
                f"{path}: cluster {run.cluster!r} trains no site and does not aggregate; the config's "
                f"clusters are {', '.join(known)}"
            )
    here = run.cluster
    return RunLayout(
        run_dir=run.run_dir,
        rounds=run.rounds,
        # Where the models meet every site's model comes (and is evaluated); elsewhere only its own.
        sites=tuple(
            name
            for name, site in run.sites.items()
            if here in (None, run.aggregate_on) or site.cluster == here
        ),
        report_table=f"{TASK_METRICS[run.task].main}.csv",
        merged=("aggregate", *run.aggregate.compare),
        intermediate=run.evaluate.intermediate,
        cluster=here,
        aggregate_on=run.aggregate_on if here is not None else None,
        crossings=tuple(crossing_items(run)),
        push_to=frozenset(c for c in run.remotes if transfer_mode(run, c) == "push"),
        aggregate_item=aggregate_item(run),
        participants=run.participants,
        round_scores=tuple(
            (r, scoring.score_path(model, site, r))
            for r, model, site in scoring.scores(run)
            if r > 0 and model != scoring.POOLED
        ),
    )


def profile_cluster(profile: str | Path) -> str | None:
    """The cluster a Snakemake profile sets (`config: cluster: ...` in its config.yaml), or None."""
    import yaml

    folder = Path(profile)
    if not folder.is_dir() and not folder.is_absolute():
        # Snakemake looks a bare profile name up in the working directory, then in ~/.config/snakemake.
        folder = Path.home() / ".config" / "snakemake" / profile
    path = folder / "config.yaml"
    if not path.is_file():
        raise UserError(f"--profile {profile}: no {path}")
    # Read as plain YAML: the yte expressions (the account) are strings here, and only `config` matters.
    settings = yaml.safe_load(path.read_text()) or {}
    return (settings.get("config") or {}).get("cluster")


@dataclass
class SiteStatus:
    round: int
    site: str
    state: str  # done | training | waiting | failed
    step: int | None = None
    total_steps: int | None = None
    checkpoint: str | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    elapsed_s: float | None = None
    eta_s: float | None = None


def _last_row(loss_csv: Path) -> dict | None:
    if not loss_csv.is_file():
        return None
    rows = list(csv.DictReader(io.StringIO(loss_csv.read_text())))
    return rows[-1] if rows else None


def _last_log_step(log: Path) -> tuple[int, int, float, float] | None:
    """(step, total, loss, tokens/s) of the last progress line in a train log (retries append)."""
    if not log.is_file():
        return None
    found = None
    for line in log.read_text(errors="replace").splitlines():
        if m := LOG_STEP.match(line.strip()):
            found = (int(m[1]), int(m[2]), float(m[3]), float(m[4].replace(",", "")))
    return found


def _log_failed(log: Path) -> bool:
    """A job that stopped on an error leaves `error: ...` (a user error) or a traceback last."""
    if not log.is_file():
        return False
    tail = log.read_text(errors="replace").strip().splitlines()[-30:]
    return any(line.startswith(("error:", "Traceback")) for line in tail)


def site_status(run_dir: Path, round: int, site: str) -> SiteStatus:
    folder = run_dir / f"round-{round}" / site
    model = folder / "model"
    log = run_dir / "logs" / "train" / f"round-{round}" / f"{site}.log"
    newest = checkpoint.newest(folder / "checkpoints")
    checkpoint_name = newest.name if newest else None
    summary_file = model / "training.json"
    if summary_file.is_file():
        summary = json.loads(summary_file.read_text())
        row = _last_row(model / "loss.csv") or {}
        return SiteStatus(
            round, site, "done",
            step=summary["steps"], total_steps=summary["steps"], checkpoint=checkpoint_name,
            loss=summary["final_loss"],
            # The job's mean over its steps, as the report's training table (a summary written before
            # training.json had it: the last step's).
            tokens_per_s=summary.get("tokens_per_s") or (float(row["tokens_per_s"]) if row else None),
            elapsed_s=summary["wall_time_s"], eta_s=0.0,
        )  # fmt: skip
    status = SiteStatus(round, site, "waiting", checkpoint=checkpoint_name)
    per_step = None
    if newest is not None:
        trainer = checkpoint.read_trainer_state(newest)
        # Seconds per step so far, start-up and checkpoints included.
        per_step = trainer["wall_time_s"] / trainer["step"] if trainer["step"] else None
        row = _last_row(newest / checkpoint.LOSS_LOG)
        status.state = "training"
        status.step, status.total_steps = trainer["step"], trainer["total_steps"]
        status.elapsed_s = trainer["wall_time_s"]
        if row:
            status.loss, status.tokens_per_s = float(row["loss"]), float(row["tokens_per_s"])
    # The log is written every few steps, checkpoints more rarely: the log's line is the newer news.
    logged = _last_log_step(log)
    if logged and (status.step is None or logged[0] >= status.step):
        status.state = "training"
        status.step, status.total_steps, status.loss, status.tokens_per_s = logged
    if per_step is not None:
        status.eta_s = per_step * max(0, status.total_steps - status.step)
    if _log_failed(log):
        status.state = "failed"
    return status


def round_stages(layout: RunLayout, round: int) -> dict:
    """Whether the round's aggregate exists and how many of its evaluations are written."""
    run_dir, sites = layout.run_dir, layout.sites
    if not layout.aggregates_here:
        # Made and evaluated where the models meet; what comes here is in `received`.
        return {"round": round, "aggregate_on": layout.aggregate_on}
    evals = (
        [run_dir / path for r, path in layout.round_scores if r == round]
        if layout.round_scores
        else [
            run_dir / f"round-{round}" / "eval" / m / f"{s}.json"
            for m in layout.evaluated(round)
            for s in sites
        ]
    )
    return {
        "round": round,
        "aggregate": (run_dir / f"round-{round}" / "aggregate" / "model" / "aggregate.json").is_file(),
        "evaluations": sum(p.is_file() for p in evals),
        "evaluations_expected": len(evals),
    }


def _utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def sent(layout: RunLayout) -> list[dict]:
    """What this cluster owes the others, and whether it is done: a receiver that pulls finds the item's
    COMPLETE marker beside it; a push leaves a receipt under sent/<receiver>/."""
    items = []
    for c in layout.crossings:
        if c.maker != layout.cluster:
            continue
        push = c.receiver in layout.push_to
        record = (
            layout.run_dir / "sent" / c.receiver / f"{c.item}.COMPLETE"
            if push
            else layout.run_dir / f"{c.item}.COMPLETE"
        )
        done = record.is_file()
        items.append({
            "item": c.item, "what": c.what, "round": c.round, "to": c.receiver,
            "how": "push" if push else "pull", "done": done,
            "at": _utc(record.stat().st_mtime) if done else None,
        })  # fmt: skip
    return items


def received(layout: RunLayout) -> dict | None:
    """The newest aggregate this cluster took from the one where the models meet: its round, folder and
    when it arrived (when its fetch job finished writing its log; the folder keeps the maker's times)."""
    rounds = sorted(
        {c.round for c in layout.crossings if c.receiver == layout.cluster and c.what == "the aggregate"}
    )
    for r in reversed(rounds):
        folder = layout.run_dir / f"round-{r}" / "aggregate" / layout.aggregate_item
        if folder.is_dir():
            log = layout.run_dir / "logs" / "fetch_aggregate" / f"{r}.log"
            when = (log if log.is_file() else folder).stat().st_mtime
            return {"round": r, "path": str(folder), "from": layout.aggregate_on, "at": _utc(when),
                    "of": len(rounds), "last_stays": max(rounds) < layout.rounds}  # fmt: skip
    return {"round": None, "from": layout.aggregate_on, "of": len(rounds)} if rounds else None


def collect(layout: RunLayout) -> dict:
    federation = {}
    if layout.cluster is not None:
        federation = {"cluster": layout.cluster, "aggregate_on": layout.aggregate_on, "sent": sent(layout)}
        if not layout.aggregates_here:
            federation["received"] = received(layout)
    return {
        "run_dir": str(layout.run_dir),
        **federation,
        "sites": [
            asdict(site_status(layout.run_dir, r, s))
            for r in range(1, layout.rounds + 1)
            for s in layout.round_sites(r)
        ],
        "rounds": [round_stages(layout, r) for r in range(1, layout.rounds + 1)],
        # The report is written where the models meet.
        "report": (layout.run_dir / "report" / layout.report_table).is_file()
        if layout.aggregates_here
        else None,
    }


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def format_status(status: dict) -> str:
    header = ("round", "site", "state", "step", "checkpoint", "loss", "tok/s", "elapsed", "left")
    rows = [header]
    for s in status["sites"]:
        step = f"{s['step']}/{s['total_steps']}" if s["step"] is not None else "-"
        rows.append((
            str(s["round"]), s["site"], s["state"], step, s["checkpoint"] or "-",
            f"{s['loss']:.4f}" if s["loss"] is not None else "-",
            f"{s['tokens_per_s']:,.0f}" if s["tokens_per_s"] is not None else "-",
            _duration(s["elapsed_s"]), _duration(s["eta_s"]),
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [f"run folder: {status['run_dir']}"]
    cluster = status.get("cluster")
    if cluster is not None:
        where = "here" if cluster == status["aggregate_on"] else f"on {status['aggregate_on']}"
        lines.append(f"cluster: {cluster} (the models meet {where})")
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.append(
        "tok/s: tokens per second of training steps (done: the mean of all steps; else the last one)"
    )
    for r in status["rounds"]:
        if "aggregate" not in r:
            continue  # this cluster neither aggregates nor evaluates
        lines.append(
            f"round {r['round']}: aggregate {'done' if r['aggregate'] else 'pending'}, "
            f"evaluations {r['evaluations']}/{r['evaluations_expected']}"
        )
    for item in status.get("sent", []):
        verb = "sent to" if item["how"] == "push" else "ready for"
        state = f"{verb} {item['to']} at {item['at']}" if item["done"] else f"not yet {verb} {item['to']}"
        lines.append(f"sent: {item['what']}{_of_round(item['round'])}: {state}")
    if "received" in status:
        got = status["received"]
        if got is None:
            lines.append(
                f"received: nothing to receive (one round: the aggregate stays on {status['aggregate_on']})"
            )
        elif got["round"] is None:
            lines.append(f"received: no aggregate from {got['from']} yet (it sends rounds 1-{got['of']})")
        else:
            lines.append(
                f"received: round {got['round']}'s aggregate from {got['from']} at {got['at']} "
                f"({got['round']} of the {got['of']} it sends"
                + ("; the last round's stays there)" if got["last_stays"] else ")")
            )
    if status["report"] is None:
        lines.append(f"report: written on {status['aggregate_on']}")
    else:
        lines.append(f"report: {'written' if status['report'] else 'pending'}")
    return "\n".join(lines)


def _of_round(round: int) -> str:
    return f" of round {round}" if round else ""


@cli.entry("fedtune.report.status")
def main(argv=None) -> int:
    parser = cli.parser("fedtune.report.status", __doc__.split("\n\n")[0])
    parser.add_argument(
        "--configfile", default=DEFAULT_CONFIG, help=f"the run's config (default {DEFAULT_CONFIG})"
    )
    parser.add_argument(
        "--profile",
        default=os.environ.get("SNAKEMAKE_PROFILE"),
        help="the cluster profile the run uses; its `config: cluster:` says which cluster this is "
        "(default $SNAKEMAKE_PROFILE)",
    )
    parser.add_argument(
        "--cluster", default=None, help="the cluster this runs on (default: the profile's, else the config's)"
    )
    parser.add_argument("--json", action="store_true", help="print the status as JSON")
    args = parser.parse_args(argv)
    cluster = args.cluster or (profile_cluster(args.profile) if args.profile else None)
    layout = layout_from_config(args.configfile, cluster)
    if not layout.run_dir.is_dir():
        raise UserError(f"{layout.run_dir}: no run folder yet (nothing has run for {args.configfile})")
    status = collect(layout)
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


if __name__ == "__main__":
    sys.exit(main())
