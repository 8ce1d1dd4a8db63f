"""The federation yardstick's compressed exchange (federation_yardstick.py --exchange): each round's
model folders go through the product's codec both ways, as the workflow's rules run it (exchange.smk).

- A site's trained model folder is compressed against the round's start model with the site's residual
  of its previous round (fedtune.core.updates.compress, as compress_update) and rebuilt from the update
  (updates.decode_folder, as decode_site_model; the merge's own rebuild gives the same bits): the merge
  takes the rebuilt model.
- The merged aggregate is compressed against the round's start model (the previous aggregate, round 1:
  the base model) with the server's residual (as compress_aggregate) and rebuilt (as decode_aggregate):
  the next round starts from the rebuilt aggregate, as every cluster does.

The updates and residuals live under the work folder, one round at a time: a round's folders are
deleted once the next round's are written, but for the residuals and the start model it needs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from fedtune.core import updates
from fedtune.core.exchange_options import ExchangeOptions


class Exchange:
    """One federation's exchange: its options, its work folder, and where each residual is."""

    def __init__(self, options: ExchangeOptions, work: Path):
        self.options, self.work = options, Path(work)
        self.residuals: dict[str, Path] = {}  # site (or "aggregate") -> its residual of the round before
        self.bytes: list[dict] = []  # per round and item: the model's bytes and the update's

    def send(self, r: int, item: str, model_dir: Path, start_dir: Path) -> Path:
        """`model_dir` through the codec against `start_dir`: the folder of the model the receiver
        rebuilds. Item "aggregate" is the merged model going back; once it is sent, the round before's
        folders are deleted (the new start and the new residuals replace them)."""
        folder = self.work / f"round-{r}" / item
        residual_out = folder / "residual" if self.options.keeps_residual else None
        job = updates.CompressJob(
            model_dir, start_dir, folder / "update",
            residual_in=self.residuals.get(item), residual_out=residual_out, label=f"{item} round {r}",
        )  # fmt: skip
        summary = updates.compress(job, self.options)
        rebuilt = folder / "rebuilt"
        updates.decode_folder(folder / "update", start_dir, rebuilt, label=f"{item}'s update of round {r}")
        if residual_out is not None:
            self.residuals[item] = residual_out
        self.bytes.append(
            {"round": r, "item": item, "model_bytes": summary["model_bytes"],
             "update_bytes": summary["update_bytes"]}
        )  # fmt: skip
        if item == "aggregate" and r > 1:
            shutil.rmtree(self.work / f"round-{r - 1}", ignore_errors=True)
        return rebuilt

    def sent_fraction(self) -> float:
        """The bytes that crossed, both ways, over those of the models they stand for."""
        return sum(b["update_bytes"] for b in self.bytes) / sum(b["model_bytes"] for b in self.bytes)
