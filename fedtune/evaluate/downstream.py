"""Downstream task scores of one model with lm-evaluation-harness (the optional extra `[downstream]`).

In the workflow (evaluate.tasks), two steps:

    python -m fedtune.download tasks --tasks ENTRY ... --out results/<run>/tasks       (login node)
    python -m fedtune.evaluate.downstream --model DIR --tasks-dir results/<run>/tasks \\
        --label aggregate --round 3 --out results/<run>/round-3/eval/tasks/aggregate.csv   (offline)

`prepare` (the first) resolves the entries (a task YAML, a task shipped in workflow/tasks/, or a name
of lm-eval's registry), copies each task YAML and its local data files into the run folder, loads every
task once, which fetches a hub data set into the run folder's datasets cache (hf-datasets/), and records
what it did in tasks.json. The scoring step reads only that folder, offline (fedtune.core.offline), so the
data a score was computed on stay with the run.

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
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from fedtune.core import cli
from fedtune.core.atomic import atomic_dir, write_json, write_text
from fedtune.core.config import UserError, check_downstream_installed, downstream_task, resolve_path

# The folder the download stage fills (results/<run>/tasks/).
RECORD = "tasks.json"
INCLUDE = "include"  # a copy of each task YAML (data_files rewritten), one folder per task
DATA = "data"  # the task YAMLs' local data files
DATASETS_CACHE = "hf-datasets"  # datasets' cache: the hub data sets, read offline by the evaluate jobs

CSV_COLUMNS = ["model", "round", "entry", "task", "metric", "value"]


class DownstreamError(UserError):
    """A task, folder or model that cannot be scored: the message names it."""


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
# The download stage: the tasks' definitions and data into the run folder.


def use_datasets_cache(folder: str | Path | None) -> str | None:
    """Point datasets' cache at `folder` (None: unset) and return the previous setting. The variable is
    read when datasets is imported, so an imported module is told too (download's progress set-up
    imports it first). Absolute: a later change of directory must not move the cache."""
    previous = os.environ.get("HF_DATASETS_CACHE")
    if folder is None:
        os.environ.pop("HF_DATASETS_CACHE", None)
    else:
        os.environ["HF_DATASETS_CACHE"] = str(Path(folder).resolve())
    if "datasets" in sys.modules and folder is not None:
        import datasets

        datasets.config.HF_DATASETS_CACHE = Path(folder).resolve()
    return previous


class _Tagged(str):
    """A YAML scalar with a tag (lm-eval's `!function utils.process_docs`), written back as it was."""

    tag = ""


def _tagged(loader, suffix, node):
    value = _Tagged(loader.construct_scalar(node))
    value.tag = "!" + suffix
    return value


class _KeepTags(yaml.SafeLoader):
    pass


class _WriteTags(yaml.SafeDumper):
    pass


_KeepTags.add_multi_constructor("!", _tagged)
_WriteTags.add_representer(_Tagged, lambda dumper, value: dumper.represent_scalar(value.tag, str(value)))


def _rewrite_data_files(files, copy):
    """data_files in the shape lm-eval was given (a path, a list, or a mapping by split), each local path
    replaced by copy(split, index, path)."""
    if isinstance(files, Mapping):
        return {split: _rewrite_data_files_list(value, split, copy) for split, value in files.items()}
    return _rewrite_data_files_list(files, "train", copy)


def _rewrite_data_files_list(value, split, copy):
    if isinstance(value, str):
        return copy(split, 0, value)
    return [copy(split, i, path) for i, path in enumerate(value)]


def _copy_task_yaml(source: Path, folder: Path, data: Path, final_data: Path, base_dir: Path) -> None:
    """One task YAML into `folder`, its local data files into `data` (the YAML names them by their place
    after the rename, `final_data`), and what it refers to beside it: the files it includes and the
    Python modules of its `!function`s (both found next to the YAML, as lm-eval looks for them)."""
    with open(source, encoding="utf-8") as f:
        document = yaml.load(f, Loader=_KeepTags)  # noqa: S506 - a SafeLoader that keeps tags
    kwargs = document.get("dataset_kwargs") or {}
    if kwargs.get("data_files") is not None:

        def copy(split, index, path):
            if "://" in path:
                return path
            target = data / str(split) / f"{index}-{Path(path).name}"
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(resolve_path(path, base_dir), target)
            return str(final_data / str(split) / target.name)

        kwargs["data_files"] = _rewrite_data_files(kwargs["data_files"], copy)
    includes = document.get("include")
    if includes is not None:
        names = []
        for include in [includes] if isinstance(includes, str) else includes:
            path = source.parent / include
            if not path.is_file():
                raise DownstreamError(f"{source}: include: {include} not found beside it")
            _copy_task_yaml(
                path, folder, data / Path(include).stem, final_data / Path(include).stem, base_dir
            )
            names.append(path.name)
        document["include"] = names if isinstance(includes, list) else names[0]
    folder.mkdir(parents=True, exist_ok=True)
    for module in source.parent.glob("*.py"):
        shutil.copy2(module, folder / module.name)
    text = yaml.dump(document, Dumper=_WriteTags, sort_keys=False, allow_unicode=True)
    write_text(folder / source.name, f"# Copied from {source} by fedtune.download.fetch tasks.\n" + text)


def _task_manager(include_path: Sequence[str | Path], registry: bool):
    from lm_eval.tasks import TaskManager

    for folder in include_path:
        if not Path(folder).is_dir():
            raise DownstreamError(f"--include-path: {folder} is not a folder of task YAMLs")
    # Indexing lm-eval's own thousands of tasks takes seconds: only when a registry name is asked for.
    return TaskManager(include_path=[str(p) for p in include_path] or None, include_defaults=registry)


def _check_known(manager, names: Sequence[str]) -> None:
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        raise DownstreamError(
            f"--tasks: unknown to lm-eval (and the --include-path folders): {', '.join(unknown)}"
        )


def _documents(task) -> dict[str, int]:
    dataset = getattr(task, "dataset", None)
    if not isinstance(dataset, Mapping):
        return {}
    return {str(split): len(rows) for split, rows in dataset.items()}


def prepare(entries: Sequence[str], out: str | Path, *, base_dir: str | Path = ".") -> dict:
    """The download stage of evaluate.tasks: copies and fetched data sets in `out`, and tasks.json.

    The copies are written into a temporary folder and renamed; the tasks are then loaded from their
    final place, so that datasets' cache holds them under the paths the evaluate jobs will read.
    tasks.json is written last and marks the folder complete; a failure removes the folder."""
    check_downstream_installed("--tasks")
    base_dir = Path(base_dir)
    out = Path(out)
    tasks = [downstream_task(entry, base_dir=base_dir, where=f"--tasks {entry}") for entry in entries]
    with atomic_dir(out) as tmp:
        (tmp / INCLUDE).mkdir()
        for task in tasks:
            if task.yaml is not None:
                _copy_task_yaml(
                    task.yaml, tmp / INCLUDE / task.name, tmp / DATA / task.name, out / DATA / task.name,
                    base_dir,
                )  # fmt: skip
    previous_cache = os.environ.get("HF_DATASETS_CACHE")
    previous_config = sys.modules["datasets"].config.HF_DATASETS_CACHE if "datasets" in sys.modules else None
    try:
        use_datasets_cache(out / DATASETS_CACHE)
        manager = _task_manager([out / INCLUDE], registry=any(t.yaml is None for t in tasks))
        _check_known(manager, [t.name for t in tasks])
        record = {"tasks": [], "lm_eval": _lm_eval_version()}
        for task in tasks:
            # Loading a task downloads its data set (hub) or reads its files, through datasets' cache.
            try:
                loaded = manager.load([task.name])
            except Exception as e:
                raise DownstreamError(
                    f"--tasks {task.entry}: lm-eval cannot load task {task.name}: {type(e).__name__}: {e}"
                ) from e
            record["tasks"].append(
                {
                    "entry": task.entry,
                    "name": task.name,
                    "yaml": None if task.yaml is None else str(task.yaml),
                    "subtasks": sorted(loaded["tasks"]),
                    "documents": {name: _documents(t) for name, t in sorted(loaded["tasks"].items())},
                }
            )
        write_json(out / RECORD, record)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        # The caller's cache again (a test, or a process that loads other data sets after this).
        use_datasets_cache(previous_cache)
        if previous_config is not None:
            sys.modules["datasets"].config.HF_DATASETS_CACHE = previous_config
    return record


def _lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


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


def run_tasks(
    model_dir: str | Path,
    tasks: Sequence[str],
    *,
    include_path: Sequence[str | Path] = (),
    registry: bool = True,
    batch_size: int = 8,
    device: str | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    dtype: str | None = None,
    base: str | Path | None = None,
) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """lm-eval's scores of the model on the tasks ({task: {metric: value}}), and each scored task's
    entry (a requested task or the requested group it belongs to). An adapter folder (train.adapter) is
    scored on its `base`, unmerged (lm-eval's own peft argument)."""
    import lm_eval

    from fedtune.core import adapters

    model_dir = Path(model_dir)
    adapter = adapters.is_adapter(model_dir)
    if adapter and base is None:
        raise DownstreamError(f"--model: {model_dir} is an adapter folder; give its base model (--base)")
    weights = Path(base) if adapter else model_dir
    if not (weights / "config.json").is_file():
        raise DownstreamError(f"--model: {weights} holds no config.json (a save_pretrained folder)")
    manager = _task_manager(include_path, registry)
    _check_known(manager, tasks)
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
    parser.add_argument("--tasks", nargs="+", default=None, help="lm-eval task names (default: the folder's)")
    parser.add_argument("--include-path", nargs="*", default=[], help="folders of task YAMLs")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--limit", type=int, default=None, help="score the first N documents of each task")
    parser.add_argument("--num-fewshot", type=int, default=None, help="default: each task's own")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    cli.add_scored_model(parser)
    cli.add_out(parser, "result file: .csv or .json")
    args = parser.parse_args(argv)
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
    table, entries = run_tasks(
        args.model, tasks, include_path=include_path, registry=registry, batch_size=args.batch_size,
        device=args.device, limit=args.limit, num_fewshot=args.num_fewshot, dtype=args.dtype,
        base=args.base,
    )  # fmt: skip
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
