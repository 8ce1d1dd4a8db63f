"""Training blocks: the tokenize stage's shards read memory-mapped, and the order in which the ranks
see them.

The order is a pure function of (seed, epoch, step), so a resumed run continues exactly where it
stopped and every backend and world size sees the same global batches: an optimizer step takes the
next `global_batch` blocks of the epoch's permutation, and each rank takes its own slice of them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedtune.core.options import UserError, check_global_batch

LABEL_IGNORE = -100


class DataError(UserError):
    """Training data that cannot be used: the message names the file or the option to fix."""


def _read_arrow_table(path: Path):
    import pyarrow as pa

    # Dataset.save_to_disk writes Arrow IPC streams; memory-mapping them costs no RAM per rank.
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_stream(source).read_all()


def _column_blocks(table, name: str, block_size: int, where: Path) -> list[np.ndarray]:
    if name not in table.column_names:
        raise DataError(f"{where}: no column {name!r} (columns: {table.column_names})")
    chunks = []
    for chunk in table.column(name).chunks:
        values = chunk.flatten().to_numpy(zero_copy_only=False)
        if len(values) != len(chunk) * block_size:
            raise DataError(f"{where}: column {name!r} has rows that are not {block_size} tokens long")
        chunks.append(values.reshape(len(chunk), block_size))
    return chunks


def _column_values(table, name: str, where: Path) -> list[np.ndarray]:
    if name not in table.column_names:
        raise DataError(f"{where}: no column {name!r} (columns: {table.column_names})")
    return [chunk.to_numpy(zero_copy_only=False) for chunk in table.column(name).chunks]


class Blocks:
    """All training blocks of a site, over its shards, indexed 0..len-1 in shard order. A language
    modelling block has a label per token; a classification row (task sequence-classification) has one
    label and the length of its text before padding, from which its attention mask follows."""

    def __init__(self, shard_dirs: list[str | Path]):
        import pyarrow as pa

        if not shard_dirs:
            raise DataError("no training shards given")
        self.block_size: int | None = None
        self.classification: bool | None = None
        self._input_ids: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []
        self._lengths: list[np.ndarray] = []
        for shard_dir in map(Path, shard_dirs):
            state = shard_dir / "state.json"
            if not state.is_file():
                raise DataError(f"{shard_dir}: not a saved dataset (no state.json); rerun its tokenize job")
            counts = shard_dir / "counts.json"
            if counts.is_file():
                block_size = json.loads(counts.read_text())["block_size"]
            else:
                block_size = None
            for entry in json.loads(state.read_text())["_data_files"]:
                path = shard_dir / entry["filename"]
                table = _read_arrow_table(path)
                if table.num_rows == 0:
                    continue
                if block_size is None:
                    block_size = len(table.column("input_ids")[0])
                if self.block_size is None:
                    self.block_size = block_size
                elif block_size != self.block_size:
                    raise DataError(
                        f"{shard_dir}: block_size {block_size} differs from the other shards' {self.block_size}"
                    )
                classification = "labels" in table.column_names and not pa.types.is_fixed_size_list(
                    table.schema.field("labels").type
                )
                if self.classification is None:
                    self.classification = classification
                elif classification != self.classification:
                    raise DataError(f"{path}: classification and language-modelling shards mixed")
                self._input_ids += _column_blocks(table, "input_ids", block_size, path)
                if classification:
                    self._labels += _column_values(table, "labels", path)
                    self._lengths += _column_values(table, "length", path)
                else:
                    self._labels += _column_blocks(table, "labels", block_size, path)
        sizes = [len(chunk) for chunk in self._input_ids]
        self._starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        if len(self) == 0:
            raise DataError(f"the training shards hold no blocks: {', '.join(map(str, shard_dirs))}")

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _rows(self, chunks: list[np.ndarray], indices: np.ndarray) -> np.ndarray:
        which = np.searchsorted(self._starts, indices, side="right") - 1
        return np.stack([chunks[c][i - self._starts[c]] for c, i in zip(which, indices, strict=True)])

    def get(self, indices):
        """input_ids and labels of the given blocks, as int64 tensors: (len(indices), block_size) both,
        or for classification rows labels of shape (len(indices),)."""
        import torch

        indices = np.asarray(indices, dtype=np.int64)
        input_ids = torch.from_numpy(self._rows(self._input_ids, indices).astype(np.int64))
        labels = torch.from_numpy(self._rows(self._labels, indices).astype(np.int64))
        return input_ids, labels

    def attention_mask(self, indices):
        """1 on each classification row's text, 0 on its padding; None for language-modelling blocks
        (packed blocks have no padding, and a causal model never looks at the padding to its right)."""
        if not self.classification:
            return None
        import torch

        lengths = self._rows(self._lengths, np.asarray(indices, dtype=np.int64))
        return torch.from_numpy((np.arange(self.block_size)[None, :] < lengths[:, None]).astype(np.int64))


def trained_tokens(labels) -> int:
    """Targets that contribute to the loss. Classification: one per row. Causal LM: a token t+1 is
    predicted from t, so the first label of each block is never a target."""
    if labels.dim() == 1:
        return int((labels != LABEL_IGNORE).sum())
    return int((labels[:, 1:] != LABEL_IGNORE).sum())


@dataclass(frozen=True)
class BlockOrder:
    """Which blocks each rank trains on at each optimizer step.

    A step's global batch is split as (accumulation, world, micro): micro step m of rank r takes
    rows [m, r] -- so the set of blocks of a step does not depend on the world size."""

    num_blocks: int
    global_batch: int
    micro_batch: int
    world_size: int
    seed: int

    def __post_init__(self):
        check_global_batch(self.global_batch, self.micro_batch, self.world_size, "global_batch")
        if self.steps_per_epoch == 0:
            raise DataError(
                f"global_batch ({self.global_batch}) is larger than the {self.num_blocks} training blocks "
                "of this site; lower global_batch or tokenize more data"
            )

    @property
    def accumulation(self) -> int:
        return self.global_batch // (self.micro_batch * self.world_size)

    @property
    def steps_per_epoch(self) -> int:
        # The last partial global batch of an epoch is dropped: every step has the same size.
        return self.num_blocks // self.global_batch

    def position(self, step: int) -> dict:
        """Where step `step` (0-based) reads: epoch and global batch within it."""
        return {"epoch": step // self.steps_per_epoch, "batch": step % self.steps_per_epoch}

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_blocks)

    def global_indices(self, step: int) -> np.ndarray:
        where = self.position(step)
        start = where["batch"] * self.global_batch
        return self._permutation(where["epoch"])[start : start + self.global_batch]

    def micro_batches(self, step: int, rank: int) -> list[np.ndarray]:
        """This rank's micro batches of step `step`, in accumulation order."""
        grid = self.global_indices(step).reshape(self.accumulation, self.world_size, self.micro_batch)
        return [grid[m, rank] for m in range(self.accumulation)]


def manifest_tokens(site: str, path: Path, *, error: type[UserError] = UserError) -> int:
    """Tokens the site trained on per epoch: splits.train.tokens_kept of its manifest, checked (`error`:
    the caller's error class). What the merge weighs a site by, and what federation.site_steps tokens
    shares a round's steps by."""
    try:
        manifest = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"site {site}: manifest not found: {path}") from None
    except json.JSONDecodeError as e:
        raise error(f"site {site}: manifest {path} is not valid JSON: {e}") from None
    if manifest.get("site", site) != site:
        raise error(f"site {site}: manifest {path} belongs to site {manifest['site']!r}")
    try:
        train = manifest["splits"]["train"]
        tokens = train["tokens_kept"]
    except (KeyError, TypeError):
        raise error(f"site {site}: manifest {path} has no splits.train.tokens_kept") from None
    if not _integer(tokens):
        raise error(f"site {site}: manifest {path}: splits.train.tokens_kept is not an integer")
    # The manifest may have crossed from the site's cluster: its count weighs the site in the merge (and
    # shares out steps), so it must be one the site could have trained on: positive, and within what the
    # same manifest says it tokenized.
    if tokens <= 0:
        raise error(
            f"site {site}: manifest {path}: splits.train.tokens_kept is {tokens}; a site's token count "
            "must be positive (a site that trained on nothing has no model to merge)"
        )
    bounds = {"splits.train.tokens (tokenized)": train.get("tokens")}
    if _integer(train.get("blocks")) and _integer(manifest.get("block_size")):
        bounds["splits.train.blocks x block_size"] = train["blocks"] * manifest["block_size"]
    for what, bound in bounds.items():
        if _integer(bound) and tokens > bound:
            raise error(
                f"site {site}: manifest {path}: splits.train.tokens_kept is {tokens}, more than the "
                f"{bound} of its {what}; refused"
            )
    return tokens


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def manifest_shards(manifest_path: str | Path, split: str = "train") -> list[Path]:
    """The shard folders a site's manifest lists for `split`, resolved against the manifest's folder.

    Each must lie inside that folder (data/<site>/ of the run, where tokenize writes them): a manifest
    that names a path outside it (`../../other-site/train/shard-0`, `/data/elsewhere`, or a link that
    leads out) is refused, so that an edited manifest cannot point training at other data on disk."""
    manifest_path = Path(manifest_path)
    if not manifest_path.is_file():
        raise DataError(f"{manifest_path}: manifest not found; run the tokenize stage first")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{manifest_path}: not a valid manifest: {e}") from None
    try:
        shards = manifest["splits"][split]["shards"]
    except (KeyError, TypeError):
        raise DataError(f"{manifest_path}: no shard list for split {split!r}") from None
    if not isinstance(shards, list) or not all(isinstance(shard, str) and shard for shard in shards):
        raise DataError(f"{manifest_path}: splits.{split}.shards is not a list of shard folders")
    root = manifest_path.parent.resolve()
    for shard in shards:
        if not (root / shard).resolve().is_relative_to(root):
            raise DataError(
                f"{manifest_path}: splits.{split}.shards names {shard!r}, which lies outside the manifest's "
                f"folder {root}; refused (tokenize writes a site's shards beside its manifest)"
            )
    return [manifest_path.parent / shard for shard in shards]
