"""The federation benchmark's compressed exchange (federation_bench.py --exchange): each round's models
go through the product's codec both ways, on files, as the workflow's rules run it (exchange.smk).

- A site's trained model is saved, compressed against the round's start model with the site's residual
  of its previous round (fedtune.core.updates.compress, as compress_update), and rebuilt from the update
  (updates.decode_folder, as decode_site_model; the merge's own rebuild gives the same bits): the merge
  takes the rebuilt model.
- The merged aggregate is compressed against the round's start model (the previous aggregate, round 1:
  the base model) with the server's residual (as compress_aggregate) and rebuilt (as decode_aggregate):
  the next round starts from the rebuilt aggregate, as every cluster does.

The files live in a temporary folder, one round at a time: a round's folders are deleted once the next
round's are written, but for the residuals and the start model it needs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import load_file

from fedtune.core import models, updates
from fedtune.core.config import ExchangeOptions
from fedtune.core.safetensors_stream import INDEX_FILE


class Exchange:
    """One federation's exchange: its options, its work folder, and where each residual is."""

    def __init__(self, options: ExchangeOptions, model, tokenizer, work: Path):
        self.options, self.model, self.tokenizer, self.work = options, model, tokenizer, Path(work)
        self.residuals: dict[str, Path] = {}  # site (or "aggregate") -> its residual of the round before
        self.bytes: list[dict] = []  # per round and item: the model's bytes and the update's

    def save(self, state: dict, folder: Path) -> Path:
        """A model folder of `state`, as training writes one (models.save_model)."""
        self.model.load_state_dict(state)
        models.save_model(self.model, self.tokenizer, folder)
        return folder

    def load(self, folder: Path) -> dict:
        """The state dict of a model folder (tied weights, saved once, filled in by load_state_dict)."""
        if (folder / INDEX_FILE).is_file():
            raise SystemExit(f"error: {folder}: a sharded model; the benchmark's models fit one file")
        missing, unexpected = self.model.load_state_dict(
            load_file(folder / "model.safetensors"), strict=False
        )
        tied = {
            name
            for name in missing
            if self.model.get_parameter(name) is self.model.get_output_embeddings().weight
        }
        if unexpected or set(missing) - tied:
            raise SystemExit(
                f"error: {folder}: missing {sorted(set(missing) - tied)}, unexpected {unexpected}"
            )
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def _send(self, r: int, item: str, state: dict, start_dir: Path) -> tuple[dict, Path]:
        """`state` through the codec against `start_dir`: (the state rebuilt at the receiver, its folder)."""
        folder = self.work / f"round-{r}" / item
        model_dir = self.save(state, folder / "model")
        residual_in = self.residuals.get(item)
        residual_out = folder / "residual" if self.options.keeps_residual else None
        summary = updates.compress(
            model_dir,
            start_dir,
            folder / "update",
            self.options,
            residual_in=residual_in,
            residual_out=residual_out,
            label=f"{item} round {r}",
        )
        updates.decode_folder(
            folder / "update", start_dir, folder / "rebuilt", label=f"{item}'s update of round {r}"
        )
        if residual_out is not None:
            self.residuals[item] = residual_out
        self.bytes.append(
            {
                "round": r,
                "item": item,
                "model_bytes": summary["model_bytes"],
                "update_bytes": summary["update_bytes"],
            }
        )
        shutil.rmtree(model_dir)
        return self.load(folder / "rebuilt"), folder / "rebuilt"

    def site(self, r: int, site: str, trained: dict, start_dir: Path) -> dict:
        """The site's model of round r as the merge sees it."""
        state, folder = self._send(r, site, trained, start_dir)
        shutil.rmtree(folder)
        return state

    def aggregate(self, r: int, merged: dict, start_dir: Path) -> tuple[dict, Path]:
        """The aggregate of round r as every cluster continues from it, and its folder (the next round's
        start model)."""
        state, folder = self._send(r, "aggregate", merged, start_dir)
        self._forget(r - 1)
        return state, folder

    def _forget(self, r: int) -> None:
        """Round r's folders once round r + 1 is done: its residuals and start model are no longer read."""
        if r >= 1:
            shutil.rmtree(self.work / f"round-{r}", ignore_errors=True)
