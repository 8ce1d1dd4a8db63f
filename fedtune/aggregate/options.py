"""How site models are merged (aggregate.schema.yaml): AggregateOptions with ServerOptimizerOptions,
what `python -m fedtune.aggregate` and `python -m fedtune.aggregate.adapters` read from --options.
Torch-free."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass

from fedtune.core.options import DTYPES, ConfigError, _Options

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


# The server optimizers whose update is linear in the pseudo-gradients, which LoRA adapters carry exactly
# (fedtune.aggregate.server_optimizers marks them `linear`; a test holds the two equal).
LOW_RANK_SERVER_OPTIMIZERS = ("sgd", "fedavgm")
