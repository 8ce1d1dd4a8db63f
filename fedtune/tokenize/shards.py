"""tokenize: a site's raw text -> fixed-size blocks of token ids, one shard per job.

    python -m fedtune.tokenize shard --raw DIR --split train --shard K --tokenizer DIR --site NAME \\
        --options '{"shards": N, "block_size": 128, "mode": "packing", "template": "...{text}...", ...}' --out DIR
    python -m fedtune.tokenize manifest --out manifest.json SHARD_DIR...

A shard holds the documents `Dataset.shard(N, K, contiguous=True)` gives it, so every document lands in
exactly one shard whatever N is. Each document becomes [BOS] text [EOS]; `packing` concatenates them and
cuts full blocks (the shard's remainder is dropped and counted), `padding` puts one document per block,
truncated or right-padded, with labels -100 on padding. The fast tokenizer's Rust `encode_batch_fast`
does the work on all the job's threads; no Python loop touches a token.

--options is the site's TokenizeOptions (fedtune.tokenize.options): the tokenize section with the site's
template, text and label columns and the task. With task sequence-classification a shard holds one row
per document: the templated text with the tokenizer's own special tokens ([CLS] text [SEP] for BERT, as
Hugging Face's run_glue does), truncated and right-padded to block_size, its length, and its class from
label_field as the label."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedtune.core import cli, offline
from fedtune.core.atomic import atomic_dir, write_json
from fedtune.core.checksums import sha256_file
from fedtune.core.options import CAUSAL_LM, CLASSIFICATION, UserError, check_fits, label_problem
from fedtune.tokenize.options import TokenizeOptions

COUNTS = "counts.json"
LABEL_IGNORE = -100
SUM_KEYS = ("documents", "bytes", "tokens", "tokens_kept", "tokens_dropped", "blocks")


class TokenizeError(UserError):
    """Bad input to the tokenize stage: the message names the file, option or value."""


def templated_batches(texts, template: str, batch_size: int, progress=None):
    """The documents with the template applied, in lists of batch_size (the tokenizer's batch)."""
    batch: list[str] = []
    for text in texts:
        batch.append(template.format(text=text))
        if len(batch) == batch_size:
            yield batch
            if progress is not None:
                progress.update(len(batch))
            batch = []
    if batch:
        yield batch
        if progress is not None:
            progress.update(len(batch))


def utf8_bytes(texts: list[str]) -> int:
    return sum(len(t.encode("utf-8")) for t in texts)


def encode_documents(texts, tokenizer, template: str, add_bos: bool, batch_size: int = 2048, progress=None):
    """Token ids of every templated document with BOS/EOS placed, as (flat ids, lengths, bytes)."""
    backend = tokenizer.backend_tokenizer
    prefix = [tokenizer.bos_token_id] if add_bos and tokenizer.bos_token_id is not None else []
    eos = tokenizer.eos_token_id
    if eos is None:
        raise TokenizeError("the tokenizer has no EOS token, which separates documents")
    pieces, lengths, n_bytes = [], [], 0
    for batch in templated_batches(texts, template, batch_size, progress):
        for encoding in backend.encode_batch_fast(batch, add_special_tokens=False):
            ids = prefix + encoding.ids + [eos]
            pieces.append(np.asarray(ids, dtype=np.int32))
            lengths.append(len(ids))
        n_bytes += utf8_bytes(batch)
    flat = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    return flat, np.asarray(lengths, dtype=np.int64), n_bytes


def pack(flat: np.ndarray, block_size: int):
    """Full blocks of the concatenated stream; labels equal the ids."""
    n_blocks = len(flat) // block_size
    blocks = flat[: n_blocks * block_size].reshape(n_blocks, block_size)
    return blocks, blocks.copy()


def pad(flat: np.ndarray, lengths: np.ndarray, block_size: int, pad_id: int):
    """One block per document: truncated to block_size or right-padded; labels -100 on padding."""
    n = len(lengths)
    kept = np.minimum(lengths, block_size)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if n else np.zeros(0, dtype=np.int64)
    rows = np.repeat(np.arange(n), kept)
    cols = np.arange(kept.sum()) - np.repeat(np.cumsum(kept) - kept, kept)
    source = np.repeat(starts, kept) + cols
    blocks = np.full((n, block_size), pad_id, dtype=np.int32)
    labels = np.full((n, block_size), LABEL_IGNORE, dtype=np.int32)
    blocks[rows, cols] = flat[source]
    labels[rows, cols] = flat[source]
    return blocks, labels


def encode_examples(texts, tokenizer, template: str, block_size: int, batch_size: int = 2048, progress=None):
    """Classification rows: each templated document with the tokenizer's special tokens, truncated to
    block_size and right-padded with the padding id. Returns (rows, lengths, tokens dropped, documents
    truncated, bytes)."""
    from tokenizers import Tokenizer

    # A copy: truncation is tokenizer state, and the caller's tokenizer must stay as it was.
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_padding()
    backend.enable_truncation(max_length=block_size)
    specials = backend.num_special_tokens_to_add(False)
    if block_size <= specials:
        raise TokenizeError(
            f"--block-size: {block_size} leaves no room for text after {specials} special tokens"
        )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise TokenizeError("the tokenizer has neither a padding nor an EOS token to pad rows with")
    rows, lengths, dropped, truncated, n_bytes = [], [], 0, 0, 0
    for batch in templated_batches(texts, template, batch_size, progress):
        for encoding in backend.encode_batch_fast(batch, add_special_tokens=True):
            row = np.full(block_size, pad_id, dtype=np.int32)
            row[: len(encoding.ids)] = encoding.ids
            rows.append(row)
            lengths.append(len(encoding.ids))
            if encoding.overflowing:
                truncated += 1
                # Each overflow piece carries its own special tokens, which the text never had.
                dropped += sum(len(piece.ids) - specials for piece in encoding.overflowing)
        n_bytes += utf8_bytes(batch)
    matrix = np.stack(rows) if rows else np.zeros((0, block_size), dtype=np.int32)
    return matrix, np.asarray(lengths, dtype=np.int32), dropped, truncated, n_bytes


def model_num_labels(model_dir: Path) -> int | None:
    """Classes of a saved classifier, None for other models. Read through transformers: config.json
    leaves num_labels out when it is the default (2)."""
    from transformers import AutoConfig

    from fedtune.core.models import model_task

    if not (Path(model_dir) / "config.json").is_file() or model_task(model_dir) != CLASSIFICATION:
        return None
    return AutoConfig.from_pretrained(model_dir).num_labels


def blocks_dataset(
    blocks: np.ndarray, labels: np.ndarray, block_size: int, lengths: np.ndarray | None = None
):
    """The shard's table. Language modelling: input_ids and labels, block_size tokens each.
    Classification: input_ids, one label per row, and each row's length before padding."""
    import pyarrow as pa
    from datasets import Dataset

    def column(array):
        return pa.FixedSizeListArray.from_arrays(pa.array(array.reshape(-1), type=pa.int32()), block_size)

    if lengths is None:
        return Dataset(pa.table({"input_ids": column(blocks), "labels": column(labels)}))
    return Dataset(
        pa.table(
            {
                "input_ids": column(blocks),
                "labels": pa.array(labels, type=pa.int32()),
                "length": pa.array(lengths, type=pa.int32()),
            }
        )
    )


@dataclass(frozen=True)
class ShardJob:
    """One shard's files (the CLI's paths), apart from the options: the downloaded data set `raw`, the
    split and the shard's index in it, the tokenizer's folder, the output folder, and the site (recorded
    in counts.json)."""

    raw: str | Path
    split: str
    shard: int
    tokenizer_dir: str | Path
    out: str | Path
    site: str | None = None


def tokenize_shard(job: ShardJob, options: TokenizeOptions) -> dict:
    """Tokenize shard `job.shard` of `job.raw`'s split into `job.out` as `options` say; returns its
    counts.json."""
    from datasets import load_from_disk

    from fedtune.core.models import load_tokenizer
    from fedtune.core.progress import Progress

    raw, split, shard, tokenizer_dir, out, site = (
        job.raw, job.split, job.shard, job.tokenizer_dir, job.out, job.site
    )  # fmt: skip
    num_shards, template, text_field = options.shards, options.template, options.text_field
    block_size, mode = options.block_size, options.mode
    if not 0 <= shard < num_shards:
        raise TokenizeError(
            f"--shard: {shard} is not in 0..{num_shards - 1} (--options: shards {num_shards})"
        )
    model_config = Path(tokenizer_dir) / "config.json"
    if model_config.is_file():
        check_fits(
            block_size, json.loads(model_config.read_text()), "--options: block_size", str(model_config)
        )
    try:
        splits = load_from_disk(str(raw))
    except FileNotFoundError as error:
        raise TokenizeError(f"--raw: {raw}: not a saved dataset ({error})") from None
    if split not in splits:
        raise TokenizeError(f"--split: {raw} has no split {split!r}; it has {sorted(splits)}")
    data = splits[split]
    if text_field not in data.column_names:
        raise TokenizeError(
            f"--options: text_field: {text_field!r} is not a column of {raw} ({data.column_names})"
        )
    if options.task == CLASSIFICATION:
        return _tokenize_classification_shard(data, job, options)
    tokenizer = load_tokenizer(tokenizer_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    part = data.shard(num_shards=num_shards, index=shard, contiguous=True).select_columns([text_field])
    texts = (text for batch in part.iter(batch_size=4096) for text in batch[text_field])
    with Progress(len(part), desc=f"tokenize {split} shard {shard}", unit="doc") as bar:
        flat, lengths, n_bytes = encode_documents(texts, tokenizer, template, options.add_bos, progress=bar)
    if mode == "packing":
        blocks, labels = pack(flat, block_size)
        kept = int(blocks.size)
    else:
        blocks, labels = pad(flat, lengths, block_size, pad_id)
        kept = int(np.minimum(lengths, block_size).sum())

    counts = {
        "site": site,
        "task": options.task,
        "split": split,
        "shard": shard,
        "num_shards": num_shards,
        "block_size": block_size,
        "mode": mode,
        "documents": len(part),
        "bytes": n_bytes,
        "tokens": int(lengths.sum()),
        "tokens_kept": kept,
        "tokens_dropped": int(lengths.sum()) - kept,
        "blocks": int(len(blocks)),
    }
    return _save_shard(out, blocks_dataset(blocks, labels, block_size), counts)


def _save_shard(out, dataset, counts: dict) -> dict:
    with atomic_dir(out) as tmp:
        dataset.save_to_disk(str(tmp))
        counts["files"] = arrow_files(tmp)
        write_json(tmp / COUNTS, counts)
    print(json.dumps({k: v for k, v in counts.items() if k != "files"}))
    return counts


def _tokenize_classification_shard(data, job: ShardJob, options: TokenizeOptions) -> dict:
    from fedtune.core.models import load_tokenizer
    from fedtune.core.progress import Progress

    raw, split, shard, tokenizer_dir, out, site = (
        job.raw, job.split, job.shard, job.tokenizer_dir, job.out, job.site
    )  # fmt: skip

    num_shards, template, text_field, label_field = (
        options.shards, options.template, options.text_field, options.label_field
    )  # fmt: skip
    block_size = options.block_size
    num_labels = model_num_labels(Path(tokenizer_dir))
    if num_labels is None:
        raise TokenizeError(
            f"--tokenizer: {tokenizer_dir} is not a sequence classifier (config.json architectures); "
            f"the download stage makes one for task {CLASSIFICATION}"
        )
    if label_field not in data.column_names:
        raise TokenizeError(
            f"--options: label_field: {label_field!r} is not a column of {raw} ({data.column_names})"
        )
    part = data.shard(num_shards=num_shards, index=shard, contiguous=True)
    labels = np.asarray(part.with_format("numpy")[label_field]) if len(part) else np.zeros(0, np.int64)
    problem = label_problem(labels, num_labels)
    if problem:
        raise TokenizeError(f"--options: label_field: {raw} ({split}) column {label_field!r}: {problem}")
    tokenizer = load_tokenizer(tokenizer_dir)
    texts = (
        t for batch in part.select_columns([text_field]).iter(batch_size=4096) for t in batch[text_field]
    )
    with Progress(len(part), desc=f"tokenize {split} shard {shard}", unit="doc") as bar:
        rows, lengths, dropped, truncated, n_bytes = encode_examples(
            texts, tokenizer, template, block_size, progress=bar
        )
    kept = int(lengths.sum())
    counts = {
        "site": site,
        "task": CLASSIFICATION,
        "split": split,
        "shard": shard,
        "num_shards": num_shards,
        "block_size": block_size,
        "mode": "padding",
        "documents": len(part),
        "bytes": n_bytes,
        "tokens": kept + dropped,
        "tokens_kept": kept,
        "tokens_dropped": dropped,
        "blocks": len(rows),
        "truncated": truncated,
        "num_labels": num_labels,
        "label_counts": {str(k): int((labels == k).sum()) for k in range(num_labels)},
    }
    return _save_shard(out, blocks_dataset(rows, labels.astype(np.int32), block_size, lengths), counts)


def arrow_files(shard_dir: Path) -> dict:
    """Size and sha256 of each Arrow file of a shard, as counts.json records them."""
    return {
        p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(Path(shard_dir).glob("*.arrow"))
    }


def verify_shard(shard_dir: str | Path) -> dict:
    """The shard's counts, after checking its Arrow files against the sizes and checksums recorded."""
    shard_dir = Path(shard_dir)
    counts_path = shard_dir / COUNTS
    if not counts_path.is_file():
        raise TokenizeError(f"{shard_dir}: no {COUNTS}: the shard is incomplete; rerun its tokenize job")
    counts = json.loads(counts_path.read_text())
    for name, expected in counts["files"].items():
        path = shard_dir / name
        if (
            not path.is_file()
            or path.stat().st_size != expected["bytes"]
            or sha256_file(path) != expected["sha256"]
        ):
            raise TokenizeError(f"{path}: missing or corrupted (size or checksum differs from {counts_path})")
    return counts


def write_manifest(shard_dirs: list[str | Path], out: str | Path) -> dict:
    """Per-split totals over a site's shards; checks that every shard of every split is there once."""
    out = Path(out)
    manifest: dict = {"site": None, "task": None, "block_size": None, "mode": None, "splits": {}}
    seen: dict[str, set[int]] = {}
    for shard_dir in map(Path, shard_dirs):
        counts_path = shard_dir / COUNTS
        if not counts_path.is_file():
            raise TokenizeError(f"{shard_dir}: no {COUNTS}: the shard is incomplete; rerun its tokenize job")
        counts = json.loads(counts_path.read_text())
        counts.setdefault("task", CAUSAL_LM)
        for key in ("site", "task", "block_size", "mode"):
            if manifest[key] is None:
                manifest[key] = counts[key]
            elif manifest[key] != counts[key]:
                raise TokenizeError(
                    f"{counts_path}: {key} is {counts[key]!r}, other shards have {manifest[key]!r}"
                )
        split = manifest["splits"].setdefault(
            counts["split"], {**dict.fromkeys(SUM_KEYS, 0), "num_shards": counts["num_shards"], "shards": []}
        )
        if counts["shard"] in seen.setdefault(counts["split"], set()):
            raise TokenizeError(f"{shard_dir}: shard {counts['shard']} of {counts['split']} given twice")
        seen[counts["split"]].add(counts["shard"])
        for key in SUM_KEYS:
            split[key] += counts[key]
        for label, n in counts.get("label_counts", {}).items():
            split.setdefault("label_counts", {}).setdefault(label, 0)
            split["label_counts"][label] += n
        split["shards"].append(os.path.relpath(shard_dir.resolve(), out.resolve().parent))
    for name, split in manifest["splits"].items():
        missing = sorted(set(range(split["num_shards"])) - seen[name])
        if missing:
            raise TokenizeError(f"{out}: split {name} lacks shards {missing}")
    write_json(out, manifest)
    return manifest


@cli.entry("fedtune.tokenize.shards")
def main(argv=None) -> int:
    parser, sub = cli.subcommands("fedtune.tokenize.shards", __doc__)
    shard = sub.add_parser("shard", help="tokenize one shard of one split")
    shard.add_argument("--raw", required=True, help="the site's raw DatasetDict (download data)")
    shard.add_argument("--split", required=True)
    shard.add_argument("--shard", type=int, required=True)
    shard.add_argument("--tokenizer", required=True, help="folder with the tokenizer (the base model)")
    cli.add_options(shard, "the tokenize section with the site's template and columns (TokenizeOptions)")
    shard.add_argument("--site", default=None, help="site name recorded in counts.json")
    shard.add_argument("--num-proc", type=int, default=None, help="tokenizer threads (the job's cores)")
    cli.add_out(shard, "the output")
    manifest = sub.add_parser("manifest", help="gather a site's shard counts")
    cli.add_out(manifest, "the output")
    manifest.add_argument("shards", nargs="+")
    args = parser.parse_args(argv)
    offline.enforce()
    if getattr(args, "num_proc", None):
        # The Rust tokenizer sizes its thread pool from this at first use, which comes later.
        os.environ["RAYON_NUM_THREADS"] = str(args.num_proc)
    if args.what == "shard":
        options = TokenizeOptions.from_json(args.options)
        job = ShardJob(args.raw, args.split, args.shard, args.tokenizer, args.out, site=args.site)
        tokenize_shard(job, options)
    else:
        write_manifest(args.shards, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
