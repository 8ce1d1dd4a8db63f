"""federation.exchange (config.schema.yaml) as ExchangeOptions: what `python -m fedtune.core.updates
compress|decode --options` reads (fedtune.core.exchange holds the codec). Checked by the schema, which holds
its choices and limits; torch-free, so that the run config never loads torch."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from fedtune.core.options import _Options


@dataclass(frozen=True)
class ExchangeOptions(_Options):
    """federation.exchange: what a site sends each round, its model (dtype full) or its update
    compressed (fedtune.core.exchange), and whether it keeps what compression dropped (error feedback).
    The defaults are the schema's (tests/test_exchange_options.py)."""

    SCHEMA = "config.schema.yaml#/properties/federation/properties/exchange"
    PREFIX = "federation.exchange"

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
        # Sorted and spaced as ever: the compress rules' --options, and the update headers, keep their text.
        return json.dumps(dataclasses.asdict(self), sort_keys=True)
