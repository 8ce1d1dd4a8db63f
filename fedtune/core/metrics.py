"""The evaluation metrics, one registry: for each task the report's main metric and its companion, their
title and which way is better. fedtune.evaluate.scores writes each under its name into a result; the
report (fedtune.report.build, .cost, .status) and the workflow (its report tables and their captions,
workflow/report/<metric>.rst) read them from here (docs/design.md, "Adding a metric")."""

from __future__ import annotations

from dataclasses import dataclass

from fedtune.core.options import CAUSAL_LM, CLASSIFICATION


@dataclass(frozen=True)
class Metrics:
    """What a task's report shows: its main and second metric, and which way is better."""

    main: str
    second: str
    title: str
    lower_is_better: bool
    heatmap_caption: str  # the caption of the main metric's heatmap, in workflow/report/

    @property
    def names(self) -> tuple[str, str]:
        return self.main, self.second


TASK_METRICS = {
    CAUSAL_LM: Metrics("perplexity", "bits_per_byte", "Perplexity", True, "heatmap.rst"),
    CLASSIFICATION: Metrics("accuracy", "macro_f1", "Accuracy", False, "heatmap_accuracy.rst"),
}

# Every task's main metric, in the registry's order: a result carries the one of its task.
MAIN_METRICS = tuple(metrics.main for metrics in TASK_METRICS.values())
# The metrics where lower is better, whose non-finite values mean a diverged model.
LOWER_IS_BETTER = frozenset(name for m in TASK_METRICS.values() if m.lower_is_better for name in m.names)
