"""Downstream task scores of one model with lm-evaluation-harness (the optional extra `[downstream]`).

In the workflow (evaluate.tasks), two steps:

    python -m fedtune.download tasks --tasks ENTRY ... --out results/<run>/tasks       (login node)
    python -m fedtune.evaluate.downstream --model DIR --tasks-dir results/<run>/tasks --options JSON \\
        --label aggregate --round 3 --out results/<run>/round-3/eval/tasks/aggregate.csv   (offline)

`fedtune.download.tasks.prepare` (the first) resolves the entries (a task YAML, a task shipped in workflow/tasks/, or a name
of lm-eval's registry), copies each task YAML and its local data files into the run folder, loads every
task once, which fetches a hub data set into the run folder's datasets cache (hf-datasets/), and records
what it did in tasks.json. The scoring step reads only that folder, offline (fedtune.core.offline), so the
data a score was computed on stay with the run. --options is the evaluate section as JSON
(EvaluateOptions.downstream_json: batch_size, dtype, task_limit, num_fewshot); it holds every setting.

By hand, without the workflow's folder:

    python -m fedtune.evaluate.downstream --model DIR --tasks fedtune_demo_alpha --include-path workflow/tasks \\
        --label base --round 0 --out scores.csv

Tasks are lm-eval's own (YAML task format), and the scores are lm-eval's, unchanged: the same model,
task and settings give what the `lm_eval` CLI prints. --out writes CSV (model, round, entry, task,
metric, value: one row per metric of each task, `entry` the configured task or group it belongs to) or
JSON ({model, round, tasks: {task: {metric: value}}}), by its suffix."""

from __future__ import annotations

import csv
import io
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fedtune.core import cli
from fedtune.core.atomic import write_json, write_text
from fedtune.core.lm_eval_tasks import (
    DATASETS_CACHE,
    INCLUDE,
    RECORD,
    DownstreamError,
    check_downstream_installed,
    check_known,
    task_manager,
    use_datasets_cache,
)
from fedtune.evaluate.options import EvaluateOptions

CSV_COLUMNS = ["model", "round", "entry", "task", "metric", "value"]


def scores(results: dict) -> dict[str, dict[str, float]]:
    """lm-eval's results as {task: {metric: value}}, filter "none" left out of the metric names and
    the standard errors dropped (lm-eval reports "N/A" for metrics that have none)."""
    table = {}
    for task, values in results["results"].items():
        metrics = {}
        for key, value in values.items():
            name, _, flt = key.partition(",")
            if not flt or name.endswith("_stderr") or not isinstance(value, int | float):
                continue
            metrics[name if flt == "none" else f"{name},{flt}"] = float(value)
        table[task] = metrics
    return table


def entries_of(requested: Sequence[str], group_subtasks: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """Each scored task's configured entry: itself, or the requested group it belongs to (lm-eval's
    results name a group's members in group_subtasks, nested groups included)."""
    owner = {}
    for name in requested:
        stack = [name]
        while stack:
            task = stack.pop()
            owner.setdefault(task, name)
            stack.extend(group_subtasks.get(task, ()))
    return owner


# ---------------------------------------------------------------------------------------------------
def read_tasks_dir(folder: str | Path) -> dict:
    """tasks.json of a folder `prepare` finished."""
    import json

    path = Path(folder) / RECORD
    if not path.is_file():
        raise DownstreamError(
            f"--tasks-dir: {folder} holds no {RECORD}: the download stage (rule download_tasks, "
            "`python -m fedtune.download tasks`) has not finished there"
        )
    return json.loads(path.read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------------------------------
# Scoring


@dataclass(frozen=True)
class TaskJob:
    """One model scored on lm-eval tasks (the CLI's paths and task names), apart from the options: the
    model folder, the tasks, the folders of task YAMLs (`include_path`), whether lm-eval's own registry
    is read too, and the base model of an adapter folder (train.adapter)."""

    model_dir: str | Path
    tasks: Sequence[str]
    include_path: Sequence[str | Path] = ()
    registry: bool = True
    base: str | Path | None = None


def run_tasks(
    job: TaskJob, options: EvaluateOptions | None = None, device: str | None = None
) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """lm-eval's scores of the model on the tasks ({task: {metric: value}}), and each scored task's
    entry (a requested task or the requested group it belongs to), with the options' batch_size, dtype,
    task_limit and num_fewshot (their defaults when None). An adapter folder (train.adapter) is scored
    on its `base`, unmerged (lm-eval's own peft argument)."""
    import lm_eval

    from fedtune.core import adapters

    options = options or EvaluateOptions.from_mapping({})
    tasks, include_path, registry, base = job.tasks, job.include_path, job.registry, job.base
    batch_size, limit, num_fewshot, dtype = (
        options.batch_size, options.task_limit, options.num_fewshot, options.dtype
    )  # fmt: skip
    model_dir = Path(job.model_dir)
    adapter = adapters.is_adapter(model_dir)
    if adapter and base is None:
        raise DownstreamError(f"--model: {model_dir} is an adapter folder; give its base model (--base)")
    weights = Path(base) if adapter else model_dir
    if not (weights / "config.json").is_file():
        raise DownstreamError(f"--model: {weights} holds no config.json (a save_pretrained folder)")
    manager = task_manager(include_path, registry)
    check_known(manager, tasks)
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    model_args = {"pretrained": str(weights), **({"peft": str(model_dir)} if adapter else {})}
    if dtype is not None:
        model_args["dtype"] = dtype
    results = lm_eval.simple_evaluate(
        model="hf", model_args=model_args, tasks=list(tasks), task_manager=manager,
        batch_size=batch_size, device=device, limit=limit, num_fewshot=num_fewshot, log_samples=False,
    )  # fmt: skip
    table = scores(results)
    for task, metrics in table.items():
        if metrics and any(math.isnan(v) for v in metrics.values()):
            raise DownstreamError(f"{task}: lm-eval returned no usable score ({metrics})")
    for name in tasks:
        if not table.get(name) and name not in results.get("group_subtasks", {}):
            raise DownstreamError(f"{name}: lm-eval returned no score")
    return table, entries_of(tasks, results.get("group_subtasks", {}))


def to_csv(
    table: Mapping[str, Mapping[str, float]], entries: Mapping[str, str], model: str, round: int | None
):
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for task, metrics in table.items():
        for metric, value in metrics.items():
            writer.writerow(
                [model, "" if round is None else round, entries.get(task, task), task, metric, repr(value)]
            )
    return buffer.getvalue()


@cli.entry("fedtune.evaluate.downstream", offline=True)
def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.parser(
        "fedtune.evaluate.downstream",
        __doc__.split("\n\n")[0],
        epilog="Exit codes: 0 done, 2 a user error (one line naming the option, task or file).",
    )
    parser.add_argument("--model", required=True, help="HF model folder (save_pretrained)")
    parser.add_argument(
        "--tasks-dir",
        default=None,
        help="the download stage's folder (results/<run>/tasks): its tasks, YAML copies and data cache",
    )
    parser.add_argument("--base", default=None, help="the base model of an adapter --model (train.adapter)")
    # Which tasks, where the job has no --tasks-dir (a run by hand): a fact of the invocation, as the
    # folder is the workflow's.
    parser.add_argument("--tasks", nargs="+", default=None, help="lm-eval task names (default: the folder's)")
    parser.add_argument("--include-path", nargs="*", default=[], help="folders of task YAMLs")
    parser.add_argument(
        "--options",
        default=None,
        help="every setting: the evaluate config section as JSON (evaluate.schema.yaml): batch_size, dtype, "
        "task_limit (the first N documents of each task), num_fewshot (null: each task's own)",
    )
    cli.add_scored_model(parser)
    cli.add_out(parser, "result file: .csv or .json")
    args = parser.parse_args(argv)
    options = EvaluateOptions.from_json(args.options or "{}", source="--options")
    check_downstream_installed("fedtune.evaluate.downstream")
    include_path = list(args.include_path)
    tasks, registry = args.tasks, True
    if args.tasks_dir is not None:
        record = read_tasks_dir(args.tasks_dir)
        use_datasets_cache(Path(args.tasks_dir) / DATASETS_CACHE)
        include_path.insert(0, Path(args.tasks_dir) / INCLUDE)
        tasks = tasks or [t["name"] for t in record["tasks"]]
        registry = any(t["yaml"] is None for t in record["tasks"])
    if not tasks:
        raise DownstreamError("--tasks: name at least one task (or give --tasks-dir)")
    job = TaskJob(args.model, tasks, include_path=include_path, registry=registry, base=args.base)
    table, entries = run_tasks(job, options, args.device)
    label = args.label or Path(args.model).name
    if args.out.endswith(".csv"):
        write_text(args.out, to_csv(table, entries, label, args.round))
    else:
        write_json(args.out, {"model": label, "round": args.round, "tasks": table})
    for task, metrics in table.items():
        print(
            f"[downstream] {task}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()), file=sys.stderr
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
