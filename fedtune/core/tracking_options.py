"""The tracking section (tracking.schema.yaml) as TrackingOptions: what `--tracking` of the train and
evaluate CLIs reads (fedtune.core.tracking writes the curves and results). Torch-free."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fedtune.core.options import _Options


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
