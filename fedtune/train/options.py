"""How a site trains (train.schema.yaml): TrainOptions after the cross-key rules, with AdapterOptions for
train.adapter, and what a train job asks Slurm for. Torch-free, so that the run config (and Snakemake's
start-up) never loads torch; `python -m fedtune.train --options` turns its JSON form back into it."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from fedtune.core.options import (
    DTYPES,
    PRECISION_DTYPES,
    ConfigError,
    _Options,
    check_global_batch,
    deep_merge,
    parse_json,
)

LR_SCHEDULES = ("continue", "restart")


def check_run_keys(values: Mapping, where: str) -> None:
    """The run's keys of a train job's options (TrainOptions.RUN_KEYS), where the JSON form gives them;
    build_run_config takes them from sections the schema has checked."""
    expected = {
        "dtype": (lambda v: v in DTYPES, f"one of {', '.join(DTYPES)}"),
        "allow_pickle": (lambda v: isinstance(v, bool), "true or false"),
        "rounds": (
            lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
            "a whole number >= 1",
        ),
        "lr_schedule": (lambda v: v in LR_SCHEDULES, f"one of {', '.join(LR_SCHEDULES)}"),
        "token_counts": (lambda v: isinstance(v, bool), "true or false"),
    }
    for key, value in values.items():
        valid, what = expected[key]
        if not valid(value):
            raise ConfigError(f"{where}{key}: {value!r} is not {what}")


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
    round_warmup_steps: int
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
    # What a train job reads of the run beyond its train section (RUN_KEYS: not keys of train.schema.yaml,
    # so a config's train section cannot set them; build_run_config does, from the sections that own
    # them). The defaults are one training of its own (the pooled baseline's and a sweep's).
    dtype: str = "float32"  # model.dtype: what the model is exported in
    allow_pickle: bool = False  # model.allow_pickle: .bin weights in --init are accepted
    rounds: int = 1  # federation.rounds
    lr_schedule: str = "continue"  # federation.lr_schedule
    token_counts: bool = True  # token_counts.json written beside the model (aggregate.vocab_rows counts)

    RUN_KEYS = ("dtype", "allow_pickle", "rounds", "lr_schedule", "token_counts")

    @classmethod
    def from_mapping(cls, data: Mapping, *, source: str = "--options", prefix: str = "") -> TrainOptions:
        options = cls.from_valid(cls._validated(data, source, prefix))
        options.check(f"{source}: {prefix + '.' if prefix else ''}")
        return options

    @classmethod
    def from_json(cls, text: str, *, source: str = "--options") -> TrainOptions:
        """The JSON form, with the run's keys (RUN_KEYS) beside the section's."""
        data = parse_json(text, source)
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: options: expected a mapping, got {data!r}")
        run = {key: data[key] for key in cls.RUN_KEYS if key in data}
        check_run_keys(run, f"{source}: ")
        section = {key: value for key, value in data.items() if key not in cls.RUN_KEYS}
        return dataclasses.replace(cls.from_mapping(section, source=source), **run)

    def section(self) -> dict:
        """The train section's keys only (what train.schema.yaml validates), as plain values."""
        return {key: value for key, value in self.to_dict().items() if key not in self.RUN_KEYS}

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


def site_train_options(config: Mapping, site: str, *, source: str = "config") -> TrainOptions:
    """The train section with the site's overrides merged over it, checked."""
    merged = deep_merge(config.get("train", {}), config["sites"][site].get("train", {}))
    return TrainOptions.from_mapping(merged, source=source, prefix=f"sites.{site}.train")


def train_run_keys(config: Mapping, *, federated: bool) -> dict:
    """What a train job reads of the run beyond its train section (TrainOptions.RUN_KEYS), from a
    validated config: the model's dtype and pickle switch; for a round of the federation its rounds, its
    learning-rate schedule and whether the aggregate reads token counts; one training of its own (the
    pooled baseline, a sweep point) is one round that writes them, as before these were options."""
    keys = {"dtype": config["model"]["dtype"], "allow_pickle": config["model"]["allow_pickle"]}
    if not federated:
        return {**keys, "rounds": 1, "lr_schedule": "continue", "token_counts": True}
    federation = config["federation"]
    return {
        **keys,
        "rounds": federation["rounds"],
        "lr_schedule": federation["lr_schedule"],
        # Nothing reads the counts under vocab_rows weights: the site's token histogram stays home.
        "token_counts": config["aggregate"]["vocab_rows"] == "counts",
    }
