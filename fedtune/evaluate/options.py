"""The evaluate section (evaluate.schema.yaml) as EvaluateOptions: what `python -m fedtune.evaluate
--options` and `python -m fedtune.evaluate.downstream --options` read. Torch-free."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass

from fedtune.core.options import CAUSAL_LM, CLASSIFICATION, TASKS, ConfigError, _Options


@dataclass(frozen=True)
class EvaluateOptions(_Options):
    """evaluate.schema.yaml, plus the run's task and tokenize.add_bos (RUN_KEYS: settings of other
    sections that decide how the test text is read, so that a scoring job's --options holds them all)."""

    SCHEMA = "evaluate.schema.yaml"
    PREFIX = "evaluate"

    intermediate: str
    max_length: int
    stride: int | None
    batch_size: int
    max_documents: int | None
    dtype: str | None
    tasks: tuple[str, ...]
    task_limit: int | None
    num_fewshot: int | None
    # Where each score is made (the workflow's choice, `resolve_cross_site`); no evaluation reads it.
    cross_site: str | None = None
    # The run's task and tokenize.add_bos: the text is built as the tokenize stage built it.
    task: str = CAUSAL_LM
    add_bos: bool = True

    # Read by the downstream tasks only: the perplexity jobs get the options without them, so that a
    # task added to the config does not rerun every perplexity evaluation (Snakemake reruns on params).
    DOWNSTREAM_KEYS = ("tasks", "task_limit", "num_fewshot")
    WORKFLOW_KEYS = ("cross_site",)
    RUN_KEYS = ("task", "add_bos")

    @classmethod
    def from_mapping(cls, data: Mapping, *, source: str = "--options", prefix: str | None = None):
        if not isinstance(data, Mapping):
            return super().from_mapping(data, source=source, prefix=prefix)  # its error
        section = {k: v for k, v in data.items() if k not in cls.RUN_KEYS}
        run = {k: v for k, v in data.items() if k in cls.RUN_KEYS}
        options = super().from_mapping(section, source=source, prefix=prefix)
        where = f"{source}: "
        if run.get("task", CAUSAL_LM) not in TASKS:
            raise ConfigError(f"{where}task: {run['task']!r} is not one of {', '.join(TASKS)}")
        if not isinstance(run.get("add_bos", True), bool):
            raise ConfigError(f"{where}add_bos: {run['add_bos']!r} is not true or false")
        return dataclasses.replace(options, **run)

    @classmethod
    def from_valid(cls, values: Mapping) -> EvaluateOptions:
        return cls(**{**values, "tasks": tuple(values["tasks"])})

    def perplexity_json(self) -> str:
        """The JSON form without the downstream tasks' keys: what fedtune.evaluate.scores reads."""
        skipped = (*self.DOWNSTREAM_KEYS, *self.WORKFLOW_KEYS)
        values = {k: v for k, v in self.to_dict().items() if k not in skipped}
        return json.dumps(values, separators=(",", ":"))

    def for_run(self, task: str, add_bos: bool, block_size: int) -> EvaluateOptions:
        """These options with the run's task and BOS choice; a classifier sees each document cut where
        training cut it (tokenize.block_size), not at evaluate.max_length."""
        max_length = block_size if task == CLASSIFICATION else self.max_length
        return dataclasses.replace(self, task=task, add_bos=add_bos, max_length=max_length)

    def downstream_json(self) -> str:
        """What fedtune.evaluate.downstream reads: batch size, dtype, task_limit and num_fewshot. Not
        `tasks`: the job reads the tasks from the download stage's folder (lm-eval names, not entries)."""
        keys = ("batch_size", "dtype", "task_limit", "num_fewshot")
        return json.dumps({k: v for k, v in self.to_dict().items() if k in keys}, separators=(",", ":"))
