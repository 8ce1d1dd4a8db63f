"""How often a site trained on each token id in one round, and how the aggregate uses it.

Training from scratch, or on text in a script the base model barely knows, a token's rows in the input
embeddings and the LM head are trained by the sites whose text holds that token, and by no other. The
weighted mean of the site models then moves the row of a token only one site saw by that site's weight
alone: a tenth as far as that site moved it, where the site is a tenth of the federation, and a pooled
model moves it every time the token comes up. So the aggregate merges each row with the sites' weights,
each multiplied by how often that site trained on the token (per token it trained on that round),
renormalised per row: a token only one site saw keeps that site's update whole, a token every site saw
as often takes the sites' weights (aggregate.vocab_rows: counts, the default; docs/federation.md has the
benchmark).

Training writes the counts into each site model's folder (`token_counts.json`, beside the weights), so
they cross clusters with the model; they are a histogram of the site's training tokens, which is what
aggregate.vocab_rows: weights avoids sharing."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedtune.core.atomic import write_json
from fedtune.core.options import UserError

FILE = "token_counts.json"


class TokenCountsError(UserError):
    """A token_counts.json that cannot be read: the message names the file."""


@dataclass(frozen=True)
class TokenCounts:
    """One site's round: the count of every token id it trained on, and the names of the tensors with a
    row per token id (the input embeddings and, when not tied to them, the LM head)."""

    counts: np.ndarray  # int64, one per token id (the input embeddings' rows)
    tensors: tuple[str, ...]

    @property
    def tokens(self) -> int:
        return int(self.counts.sum())


def count(batches: Iterable, vocab: int) -> np.ndarray:
    """How often each token id occurs as an input in batches of a causal language model's input_ids.
    Every position counts, labels aside: one whose own label is ignored (a prompt under the
    completion-only loss) is still the context of the targets after it."""
    counts = np.zeros(vocab, dtype=np.int64)
    for input_ids in batches:
        counts += np.bincount(np.asarray(input_ids).ravel(), minlength=vocab)[:vocab]
    return counts


def vocab_tensors(model) -> tuple[str, ...]:
    """The names (as saved) of the model's tensors with a row per token id: the input embeddings' weight
    and the output embeddings' weight when it is a tensor of its own (not tied)."""
    names: dict[int, str] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), name)
    embeddings = model.get_input_embeddings().weight
    tensors = [names[id(embeddings)]]
    output = model.get_output_embeddings()
    if output is not None and output.weight is not embeddings and id(output.weight) in names:
        tensors.append(names[id(output.weight)])
    return tuple(tensors)


def write(
    folder: str | Path, counts: np.ndarray, tensors: Sequence[str], *, first_step: int, steps: int
) -> None:
    write_json(
        Path(folder) / FILE,
        {
            "tensors": list(tensors),
            "first_step": first_step,
            "steps": steps,
            "tokens": int(counts.sum()),
            "counts": counts.tolist(),
        },
    )


def read(folder: str | Path) -> TokenCounts | None:
    """A site model's counts, or None where its folder has none (a model trained elsewhere, an adapter,
    a classifier)."""
    path = Path(folder) / FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        counts = np.asarray(record["counts"], dtype=np.int64)
        tensors = tuple(str(name) for name in record["tensors"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise TokenCountsError(
            f"{path}: not a token counts record ({error}); rerun the training that wrote it"
        ) from None
    if counts.ndim != 1 or (counts < 0).any():
        raise TokenCountsError(f"{path}: counts must be one non-negative integer per token id")
    return TokenCounts(counts, tensors)


def row_weights(counts: Sequence[np.ndarray], weights: Sequence[float]) -> torch.Tensor:
    """(sites, vocab) fp32: each token's row weights. Site i's weight w_i times its frequency of the
    token, c_i(t) / sum_t c_i(t), normalised over the sites; a token no site trained on takes the sites'
    weights."""
    c = torch.from_numpy(np.stack(counts)).double()
    frequency = c / c.sum(dim=1, keepdim=True).clamp(min=1)
    w = torch.tensor(list(weights), dtype=torch.float64)[:, None]
    mass = w * frequency
    total = mass.sum(dim=0, keepdim=True)
    plain = (w / w.sum()).expand_as(mass)
    return torch.where(total > 0, mass / total.clamp(min=torch.finfo(torch.float64).tiny), plain).float()


def site_row_weights(
    counts: Mapping[str, TokenCounts | None], weights: Mapping[str, float]
) -> tuple[dict[str, torch.Tensor], str]:
    """(tensor name -> (sites, vocab) row weights, why not) for the sites' counts: empty, with the
    reason, where a site has none or the sites disagree on the vocabulary or the tensors."""
    missing = [site for site, c in counts.items() if c is None]
    if missing:
        return {}, f"no {FILE} from site(s) {', '.join(missing)}"
    first = next(iter(counts.values()))
    for site, c in counts.items():
        if len(c.counts) != len(first.counts) or c.tensors != first.tensors:
            return {}, f"site {site}'s {FILE} lists another vocabulary or other tensors"
    table = row_weights([c.counts for c in counts.values()], [weights[s] for s in counts])
    return {name: table for name in first.tensors}, ""


def rows_of_chunk(table: torch.Tensor, start: int, end: int, row_length: int) -> torch.Tensor:
    """(sites, end - start): each site's weight of every entry start..end-1 of a flat (vocab, d)
    tensor."""
    rows = torch.arange(start, end) // row_length
    return table[:, rows]
