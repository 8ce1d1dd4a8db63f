"""How site models are merged (aggregate.schema.yaml): AggregateOptions with ServerOptimizerOptions,
what `python -m fedtune.aggregate` and `python -m fedtune.aggregate.adapters` read from --options.
Torch-free."""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from fedtune.core.options import DTYPES, ConfigError, _Options

# ---------------------------------------------------------------------------------------------------
# The registries: each merge method and server optimizer described once, here. Its function (which
# needs torch) is named by `function` / `step`: a name in fedtune.aggregate.methods or
# fedtune.aggregate.server_optimizers, or "module:name" for one defined elsewhere. Adding a merge method
# is its function and one entry in MERGE_METHODS (docs/design.md, "Adding a merge method");
# tests/test_aggregate_registries.py holds aggregate.schema.yaml's enums and defaults equal to these
# entries and names the entry that differs.


@dataclass(frozen=True)
class MergeMethodEntry:
    """A merge method: the name aggregate.method gives it, its function f(base, sites, weights, params),
    the aggregate options it reads by their config names with their defaults (the schema's), and what
    the rest of the aggregate may assume of it."""

    name: str
    function: str
    parameters: Mapping[str, object] = field(default_factory=dict)
    # The sites' weighted mean: with a plain server step the merged model is computed without the start
    # model, and with vocab_rows counts its rows per token id are merged by the sites' token counts.
    mean: bool = False
    # Combines the sites' LoRA adapters (train.adapter; aggregate.adapter_merge says how).
    adapters: bool = False


@dataclass(frozen=True)
class ServerOptimizerEntry:
    """A server optimizer: the name aggregate.server_optimizer.name gives it, its step function, the
    options it reads with their defaults (the schema's), and the state it keeps per tensor."""

    name: str
    step: str
    parameters: Mapping[str, object] = field(default_factory=dict)
    slots: tuple[str, ...] = ()
    # Its update is a linear combination of this and past rounds' pseudo-gradients, so that it steps
    # LoRA adapters' low-rank factors exactly (fedtune.aggregate.adapters.server_factors), the kept
    # state m (if any) decaying by `momentum`: m = momentum * m + delta.
    low_rank: bool = False
    # With no state yet its update is lr * delta: at lr 1 a one-shot merge (no state read or kept) is
    # the plain mean.
    plain_first_step: bool = False
    # Its step is scaled per tensor by FedExP's extrapolation (server_optimizers.fedexp_scale), which
    # reads each site's update of the tensor as well as the merged one.
    extrapolates: bool = False


def resolve(function: str, module: str):
    """The function a registry entry names: `name` in `module`, or "other.module:name"."""
    other, _, name = function.rpartition(":")
    return getattr(importlib.import_module(other or module), name)


_DARE = {"lambda": 1.0, "density": 1.0, "seed": 0, "rescale": "l1"}
_ADAPTIVE = {"lr": 1.0, "betas": (0.9, 0.99), "tau": 1e-3}

MERGE_METHODS: dict[str, MergeMethodEntry] = {
    m.name: m
    for m in (
        MergeMethodEntry("fedavg", "fedavg", mean=True, adapters=True),
        MergeMethodEntry("task_arithmetic", "task_arithmetic", {"lambda": 1.0}),
        MergeMethodEntry("ties", "ties", {"lambda": 1.0, "density": 1.0}),
        MergeMethodEntry("dare_linear", "dare_linear", _DARE),
        MergeMethodEntry("dare_ties", "dare_ties", _DARE),
    )
}

SERVER_OPTIMIZERS: dict[str, ServerOptimizerEntry] = {
    o.name: o
    for o in (
        ServerOptimizerEntry("sgd", "sgd", {"lr": 1.0}, low_rank=True, plain_first_step=True),
        ServerOptimizerEntry(
            "fedavgm", "fedavgm", {"lr": 1.0, "momentum": 0.5}, ("m",), low_rank=True, plain_first_step=True
        ),
        # DiLoCo's outer step (Nesterov momentum): m = momentum * m + delta, lr * (delta + momentum * m);
        # on adapters delta's factors stacked with m's (fedtune.aggregate.adapters.server_factors)
        ServerOptimizerEntry("nesterov", "nesterov", {"lr": 1.0, "momentum": 0.5}, ("m",), low_rank=True),
        # sgd's step; the merge scales it by the extrapolation factor, which reads every site's update
        ServerOptimizerEntry("fedexp", "sgd", {"lr": 1.0}, extrapolates=True),
        ServerOptimizerEntry("fedadam", "fedadam", _ADAPTIVE, ("m", "v")),
        ServerOptimizerEntry("fedyogi", "fedyogi", _ADAPTIVE, ("m", "v")),
        ServerOptimizerEntry("fedadagrad", "fedadagrad", _ADAPTIVE, ("m", "v")),
    )
}

# The server optimizers that step LoRA adapters (their names, for messages and the adapter check).
LOW_RANK_SERVER_OPTIMIZERS = tuple(name for name, o in SERVER_OPTIMIZERS.items() if o.low_rank)
# The optimizer whose every step is the merged task vector itself at lr 1: stateless, plain first step.
PLAIN_SERVER_OPTIMIZER = next(n for n, o in SERVER_OPTIMIZERS.items() if o.plain_first_step and not o.slots)

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

    @classmethod
    def plain_step(cls) -> ServerOptimizerOptions:
        """The optimizer whose update is the merged task vector itself (sgd at lr 1)."""
        return cls.from_mapping({"name": PLAIN_SERVER_OPTIMIZER, "lr": 1.0})

    @property
    def entry(self) -> ServerOptimizerEntry:
        return SERVER_OPTIMIZERS[self.name]

    @property
    def slots(self) -> tuple[str, ...]:
        """Names of the state tensors it keeps per model tensor."""
        return self.entry.slots

    @property
    def plain(self) -> bool:
        """The update is the merged task vector itself (sgd at lr 1): x = start + delta."""
        return self.plain_first_step and not self.slots

    @property
    def plain_first_step(self) -> bool:
        """Its first round, with no state yet, is the plain step: sgd or fedavgm (m = delta) at lr 1. A
        one-shot merge (no state read or kept) is then the plain mean."""
        return self.entry.plain_first_step and self.lr == 1.0

    def adapter_problem(self, adapter_merge: str) -> str | None:
        """Why this optimizer cannot step LoRA adapters combined by `adapter_merge` (None: it can). The one
        place of this rule: the run config and a direct call of the adapter aggregate both ask here."""
        if not self.entry.low_rank:
            what = (
                "reads the sites' full updates, not their low-rank factors"
                if self.entry.extrapolates
                else "keeps per-coordinate state that is not low-rank"
            )
            return (
                f"aggregate.server_optimizer: {self.name} {what}; "
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
    non_finite: str
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
    def entry(self) -> MergeMethodEntry:
        return MERGE_METHODS[self.method]

    @property
    def parameters(self) -> dict:
        """The merge methods' parameters by their config names (each method reads its own)."""
        return {"lambda": self.lam, "density": self.density, "seed": self.seed, "rescale": self.rescale}

    @property
    def rows_by_counts(self) -> bool:
        """The vocab rows are merged by the sites' token counts (and stepped by vocab_step): vocab_rows
        counts, which only the mean (method fedavg) reads."""
        return self.vocab_rows == "counts" and self.entry.mean

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
        plain = ServerOptimizerOptions.plain_step()
        return dataclasses.replace(self, method=method, server_optimizer=plain, compare=()).to_json()
