"""Downstream task scores of one model with lm-evaluation-harness (the optional extra `[downstream]`).

    python -m fedtune.downstream --model DIR --tasks fedtune_demo_alpha --include-path workflow/tasks \\
        --label aggregate --round 1 --out scores.json

Tasks are lm-eval's own (YAML task format); `--include-path` adds folders of task YAMLs, such as the
project's `workflow/tasks/`, whose data are local files. Nothing is downloaded: the CLI runs offline
(fedtune.offline), so a hub task's data set must already be in the datasets cache. The scores are
lm-eval's, unchanged: the same model, task and settings give what the `lm_eval` CLI prints.

Not wired into the workflow yet: no `evaluate.tasks` config key, no rule and no report table."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from fedtune import offline


class DownstreamError(ValueError):
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


def run_tasks(
    model_dir: str | Path,
    tasks: Sequence[str],
    *,
    include_path: Sequence[str | Path] = (),
    batch_size: int = 8,
    device: str | None = None,
    limit: int | None = None,
) -> dict[str, dict[str, float]]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise DownstreamError(f"--model: {model_dir} holds no config.json (a save_pretrained folder)")
    for folder in include_path:
        if not Path(folder).is_dir():
            raise DownstreamError(f"--include-path: {folder} is not a folder of task YAMLs")
    manager = TaskManager(include_path=[str(p) for p in include_path] or None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise DownstreamError(
            f"--tasks: unknown to lm-eval (and the --include-path folders): {', '.join(unknown)}"
        )
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    results = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(model_dir)}, tasks=list(tasks), task_manager=manager,
        batch_size=batch_size, device=device, limit=limit, log_samples=False,
    )  # fmt: skip
    table = scores(results)
    for task, metrics in table.items():
        if not metrics or any(math.isnan(v) for v in metrics.values()):
            raise DownstreamError(f"{task}: lm-eval returned no usable score ({metrics})")
    return table


def main(argv: Sequence[str] | None = None) -> int:
    offline.enforce()
    parser = argparse.ArgumentParser(
        prog="python -m fedtune.downstream", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", required=True, help="HF model folder (save_pretrained)")
    parser.add_argument("--tasks", nargs="+", required=True, help="lm-eval task names")
    parser.add_argument("--include-path", nargs="*", default=[], help="folders of task YAMLs")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    parser.add_argument("--limit", type=int, default=None, help="score the first N documents of each task")
    parser.add_argument("--label", default=None, help="name of the model: base, a site, aggregate")
    parser.add_argument("--round", type=int, default=None, help="federation round of the model (base: 0)")
    parser.add_argument("--out", required=True, help="result JSON")
    args = parser.parse_args(argv)
    try:
        table = run_tasks(
            args.model, args.tasks, include_path=args.include_path, batch_size=args.batch_size,
            device=args.device, limit=args.limit,
        )  # fmt: skip
    except DownstreamError as e:
        print(f"downstream: error: {e}", file=sys.stderr)
        return 2
    from fedtune.atomic import write_json

    write_json(args.out, {"model": args.label or Path(args.model).name, "round": args.round, "tasks": table})
    for task, metrics in table.items():
        print(
            f"[downstream] {task}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()), file=sys.stderr
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
