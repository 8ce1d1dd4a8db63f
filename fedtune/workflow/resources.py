"""Host memory of the workflow's evaluation and exchange jobs (their Slurm --mem), from the base model's
size."""

from __future__ import annotations

from pathlib import Path

from fedtune.run.config import RunConfig

# Evaluation jobs: host memory from the model's size (fedtune.aggregate.adapter_size.evaluation_mem_mb:
# weights in the evaluation dtype x 1.25 + 4 GB), read from the config.json this machine has (the
# downloaded base, model.architecture, a local or GGUF model, the Hugging Face cache). Snakemake evaluates
# the resources of a job again once its inputs exist, so a hub model's jobs are sized from its download
# even where the dry run before it could not know (it then shows EVAL_MEM_MB_UNKNOWN).
EVAL_MEM_MB_UNKNOWN = 16000
# Sizes by (kind, run, base folder, state of the downloaded base): read once per state, not once per job.
_SIZES: dict[tuple, int] = {}


def _downloaded(base_dir) -> int | None:
    """The state of the downloaded base: the mtime of its model config file, or None before the download."""
    path = Path(base_dir, "config.json")
    return path.stat().st_mtime_ns if path.is_file() else None


def _sized(kind: str, run: RunConfig, base_dir, size) -> int:
    key = (kind, id(run), str(base_dir), _downloaded(base_dir))
    if key not in _SIZES:
        _SIZES[key] = size(run, base_dir)
    return _SIZES[key]


def _evaluation_size(run: RunConfig, base_dir) -> int:
    from fedtune.aggregate.adapter_size import (
        AdapterSizeError,
        evaluation_mem_mb,
        known_model_config,
        weights_mem_mb,
    )

    dtype = run.evaluate.dtype or run.model.dtype
    try:
        model_config, _ = known_model_config(run, base_dir)
    except ImportError:  # a GGUF model without the gguf extra: its download says so
        model_config = None
    if model_config is not None:
        try:
            return evaluation_mem_mb(model_config, dtype)
        # A layout the formula does not know: the size of the downloaded files, if here.
        except AdapterSizeError:
            pass
    return weights_mem_mb(base_dir, dtype, model_config) or EVAL_MEM_MB_UNKNOWN


def _exchange_size(run: RunConfig, base_dir) -> int:
    from fedtune.aggregate.adapter_size import AdapterSizeError, exchange_mem_mb, known_model_config

    try:
        model_config, _ = known_model_config(run, base_dir)
        return exchange_mem_mb(model_config)
    except (ImportError, AdapterSizeError):
        return exchange_mem_mb(None)


def evaluation_mem_mb(run: RunConfig, base_dir) -> int:
    """--mem of an evaluation job (the model's weights in the evaluation dtype, and room)."""
    return _sized("evaluation", run, base_dir, _evaluation_size)


def exchange_mem_mb(run: RunConfig, base_dir) -> int:
    """--mem of the exchange's compress and decode jobs: several fp32 copies of the largest tensor."""
    return _sized("exchange", run, base_dir, _exchange_size)
