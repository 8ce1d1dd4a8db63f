"""A site's update, compressed (federation.exchange), and the site model rebuilt from it; streamed
tensor by tensor, never a whole model in memory.

`python -m fedtune.core.updates compress`: the site's side, after training. Per tensor: the update
(site - start) plus what earlier rounds did not send (the residual), compressed
(fedtune.core.exchange), and the new residual: what was meant minus what the receiver will rebuild. The
error feedback of Seide et al. (1-bit SGD, 2014) and Karimireddy et al. (EF-SGD, 2019), applied to a
round's update as INTELLECT-1 and DiLoCo apply it to pseudo-gradients; the residual stays at the site
(round-<r>/<site>/residual, fp32), written atomically.

`python -m fedtune.core.updates decode`: a full model folder from an update and its start model, where
something needs the site's model itself (the aggregating cluster's evaluation of a remote site). The
merge does not need it: it rebuilds each tensor inside its own stream (fedtune.aggregate.merge)."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fedtune.core import cli
from fedtune.core.atomic import atomic_dir, write_json
from fedtune.core.checksums import SOURCE_RECORD
from fedtune.core.exchange import (
    CHECKSUMS,
    HEADER_KEY,
    ExchangeError,
    Rebuilder,
    TensorEntry,
    UpdateHeader,
    check_parts,
    check_start,
    encode,
    encoding_for,
    part_shapes,
    read_header,
    start_identity,
)
from fedtune.core.exchange_options import ExchangeOptions
from fedtune.core.models import record_checksums, verify_checksums
from fedtune.core.safetensors_stream import (
    INDEX_FILE,
    ST_DTYPES,
    FolderReader,
    OutTensor,
    ShardedOutput,
    WeightFolder,
    file_order,
    plan_shards,
    read_weights,
)

RESIDUAL_RECORD = "residual.json"
UPDATE_RECORD = "update.json"
# A rebuilt model's shards, as save_pretrained's default.
MAX_SHARD = 5 * 10**9


def _log(message: str) -> None:
    print(f"[updates] {message}", file=sys.stderr, flush=True)


def small_files(folder: Path) -> list[Path]:
    """A model folder's files but its weights and their record: config, tokenizer, training.json, ..."""
    skip = {INDEX_FILE, CHECKSUMS, SOURCE_RECORD, UPDATE_RECORD, RESIDUAL_RECORD}
    return [
        p
        for p in sorted(folder.iterdir())
        if p.is_file() and not p.name.startswith(".") and p.suffix != ".safetensors" and p.name not in skip
    ]


def _copy_small_files(src: Path, dst: Path) -> None:
    for path in small_files(src):
        shutil.copyfile(path, dst / path.name)


def _check_lined_up(site: WeightFolder, other: WeightFolder, what: str) -> None:
    problems = [
        f"{name}: {info.dtype} {list(info.shape)} against {other.tensors[name].dtype} {list(other.tensors[name].shape)}"
        for name, info in site.tensors.items()
        if name in other.tensors and other.tensors[name].shape != info.shape
    ]
    missing = sorted(set(site.tensors) ^ set(other.tensors))
    if missing:
        problems.append(f"tensors in one only: {', '.join(missing[:8])}")
    if problems:
        raise ExchangeError(
            f"{site.label}: does not line up with {what} {other.path}: {'; '.join(problems[:8])}"
        )


@dataclass(frozen=True)
class CompressJob:
    """The folders of one compression (the CLI's paths), apart from the options: the model, the start
    model it is the update of, the update's folder, the residual of the previous round (read) and of
    this one (written), and what the messages call the model."""

    model_dir: str | Path
    start_dir: str | Path
    out_dir: str | Path
    residual_in: str | Path | None = None
    residual_out: str | Path | None = None
    label: str = "the site model"


def compress(job: CompressJob, options: ExchangeOptions) -> dict:
    """Write the update of `model_dir` against `start_dir` into `out_dir` (atomically), with the
    residual of the previous round added and this round's written to `residual_out` (`job`'s fields).
    Returns update.json's record: bytes of the model and of the update, per-tensor error."""
    model_dir, start_dir, out_dir = Path(job.model_dir), Path(job.start_dir), Path(job.out_dir)
    residual_in, residual_out, label = job.residual_in, job.residual_out, job.label
    if not options.compressed:
        raise ExchangeError("federation.exchange.dtype: full sends the model; there is no update to compress")
    site = read_weights("site", model_dir, label)
    start = read_weights("start", start_dir, f"the start model {start_dir}")
    _check_lined_up(site, start, "the start model")
    folders = [site, start]
    if residual_in is not None:
        residual = read_weights("residual", Path(residual_in), f"the residual {residual_in}")
        for name, info in residual.tensors.items():
            if name not in site.tensors or info.shape != site.tensors[name].shape or info.dtype != "F32":
                raise ExchangeError(f"the residual {residual_in}: {name} does not fit {model_dir}")
        folders.append(residual)
    order = file_order(site)
    entries = {
        name: TensorEntry(
            site.tensors[name].dtype,
            site.tensors[name].shape,
            encoding_for(options, ST_DTYPES[site.tensors[name].dtype]),
        )
        for name in order
    }
    header = UpdateHeader(json.loads(options.to_json()), start_identity(start_dir), entries)
    parts = [
        OutTensor(name + suffix, dtype, (numel,), numel)
        for name, entry in entries.items()
        for suffix, (dtype, numel) in part_shapes(entry.encoding, entry.shape, ST_DTYPES[entry.dtype]).items()
    ]
    float_names = [name for name in order if entries[name].encoding.kind != "raw"]
    keep = residual_out is not None
    reads = [[[name] for name in order], [[name] for name in order]]
    if residual_in is not None:
        reads.append([[name] if name in residual.tensors else [] for name in order])
    squared = {"update": 0.0, "error": 0.0}
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(atomic_dir(out_dir))
        residual_tmp = stack.enter_context(atomic_dir(Path(residual_out))) if keep else None
        reader = FolderReader(folders, reads, hashing=True)
        output = ShardedOutput(tmp, [parts], hashing=True, metadata={HEADER_KEY: header.to_json()})
        kept = None
        if keep:
            plan = [
                [
                    OutTensor(name, torch.float32, entries[name].shape, site.tensors[name].numel)
                    for name in float_names
                ]
            ]
            kept = ShardedOutput(residual_tmp, plan, hashing=True) if float_names else None
        try:
            by_name = {t.name: t for t in parts}
            rebuilder = Rebuilder()
            for k, name in enumerate(order):
                reader.reached(k)
                entry = entries[name]
                value, base = reader.get(0, name), reader.get(1, name)
                if entry.encoding.kind == "raw":
                    encoded = encode(value, entry.encoding, entry.shape)
                else:
                    update = value.float() - base.float()
                    if residual_in is not None and name in residual.tensors:
                        update += reader.get(2, name)
                    encoded = encode(update, entry.encoding, entry.shape)
                    sent = (
                        rebuilder.rebuild(base, encoded, entry.encoding, entry.shape).float() - base.float()
                    )
                    error = update - sent
                    squared["update"] += float(update.double().square().sum())
                    squared["error"] += float(error.double().square().sum())
                    if kept is not None:
                        slot, buffer = kept.slot(kept.plan[0][float_names.index(name)])
                        buffer.copy_(error)
                        kept.put(kept.plan[0][float_names.index(name)], slot)
                for suffix, part in encoded.items():
                    tensor = by_name[name + suffix]
                    slot, buffer = output.slot(tensor)
                    buffer.copy_(part)
                    output.put(tensor, slot)
            record = output.finish()
            kept_record = kept.finish() if kept is not None else None
            digests = reader.digests()
        finally:
            reader.shutdown()
            output.shutdown()
            if kept is not None:
                kept.shutdown()
        verify_checksums(model_dir, {n: d for (i, n), d in digests.items() if i == 0})
        record_checksums(tmp, {name: f["sha256"] for name, f in record["files"].items()})
        _copy_small_files(model_dir, tmp)
        model_bytes = sum(site.files[f] for f in site.weight_files)
        summary = {
            "exchange": json.loads(options.to_json()),
            "start": header.start,
            "model_bytes": model_bytes,
            "update_bytes": sum(f["bytes"] for f in record["files"].values()),
            "ratio": round(sum(f["bytes"] for f in record["files"].values()) / max(model_bytes, 1), 4),
            "files": record["files"],
            # |error| / |update| over every float tensor: what this round did not send, relative.
            "relative_error": (squared["error"] / squared["update"]) ** 0.5 if squared["update"] else 0.0,
            "residual_in": str(residual_in) if residual_in else None,
        }
        write_json(tmp / UPDATE_RECORD, summary)
        if residual_tmp is not None:
            if kept_record is not None:
                record_checksums(residual_tmp, {n: f["sha256"] for n, f in kept_record["files"].items()})
            write_json(residual_tmp / RESIDUAL_RECORD, {"start": header.start, "update": str(out_dir)})
    _log(
        f"{label}: update {summary['update_bytes']:,} bytes ({summary['ratio']:.3f} of the model's "
        f"{model_bytes:,}), {options.dtype}, relative error {summary['relative_error']:.4g}: {out_dir}"
    )
    return summary


def decode_folder(
    update_dir: str | Path, start_dir: str | Path, out_dir: str | Path, label: str = "the update"
) -> dict:
    """A model folder rebuilt from `update_dir` and the start model it was taken against."""
    update_dir, start_dir, out_dir = Path(update_dir), Path(start_dir), Path(out_dir)
    header = read_header(update_dir, label)
    check_start(header, start_dir, label, update_dir)
    update = read_weights("update", update_dir, label)
    check_parts(header, update.tensors, label, update_dir)
    start = read_weights("start", start_dir, f"the start model {start_dir}")
    _check_header_fits(header, start, label, update_dir)
    tensors = [
        OutTensor(name, ST_DTYPES[entry.dtype], entry.shape, torch.Size(entry.shape).numel())
        for name, entry in header.tensors.items()
    ]
    plan = plan_shards(tensors, MAX_SHARD)
    order = [t for shard in plan for t in shard]
    parts = {name: [name + s for s in _suffixes(update, name)] for name in header.tensors}
    reads = [[parts[t.name] for t in order], [[t.name] if t.name in start.tensors else [] for t in order]]
    with atomic_dir(out_dir) as tmp:
        reader = FolderReader([update, start], reads, hashing=True)
        output = ShardedOutput(tmp, plan, hashing=True)
        rebuilder = Rebuilder()
        try:
            for k, tensor in enumerate(order):
                reader.reached(k)
                entry = header.tensors[tensor.name]
                got = {p[len(tensor.name) :]: reader.get(0, p) for p in parts[tensor.name]}
                base = reader.get(1, tensor.name) if entry.encoding.kind != "raw" else None
                value = rebuilder.rebuild(base, got, entry.encoding, entry.shape)
                slot, buffer = output.slot(tensor)
                buffer.copy_(value[: tensor.numel])
                output.put(tensor, slot)
            record = output.finish()
            digests = reader.digests()
        finally:
            reader.shutdown()
            output.shutdown()
        verify_checksums(update_dir, {n: d for (i, n), d in digests.items() if i == 0})
        verify_checksums(start_dir, {n: d for (i, n), d in digests.items() if i == 1})
        record_checksums(tmp, {name: f["sha256"] for name, f in record["files"].items()})
        _copy_small_files(update_dir, tmp)
    _log(f"{label}: rebuilt {out_dir} from {update_dir} and {start_dir}")
    return record


def _check_header_fits(header: UpdateHeader, start: WeightFolder, label: str, folder: Path) -> None:
    """The update's tensors are the start model's: the same names and shapes, and a float tensor where the
    start holds one (the model's float dtype may differ from the start's: a hub model in fp16)."""
    problems = [
        f"{name} missing from the start model" for name in header.tensors if name not in start.tensors
    ]
    problems += [f"{name} missing from the update" for name in start.tensors if name not in header.tensors]
    for name, entry in header.tensors.items():
        info = start.tensors.get(name)
        if info is None:
            continue
        floats = ST_DTYPES[entry.dtype].is_floating_point and ST_DTYPES[info.dtype].is_floating_point
        if tuple(entry.shape) != tuple(info.shape) or (entry.dtype != info.dtype and not floats):
            problems.append(
                f"{name} {entry.dtype} {list(entry.shape)} against {info.dtype} {list(info.shape)}"
            )
    if problems:
        raise ExchangeError(
            f"{label}: the update {folder} does not fit the start model {start.path}: {'; '.join(problems[:8])}"
        )


def _suffixes(update: WeightFolder, name: str) -> list[str]:
    return [s for s in ("", ":scale") if name + s in update.tensors]


@cli.entry("fedtune.core.updates", offline=True)
def main(argv: Sequence[str] | None = None) -> None:
    parser = cli.parser("fedtune.core.updates", __doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    packing = commands.add_parser("compress", help="a site model's update against its start model")
    packing.add_argument("--model", required=True, help="the site model folder")
    packing.add_argument("--start", required=True, help="the round's start model")
    packing.add_argument("--options", required=True, help="federation.exchange as JSON")
    packing.add_argument("--residual-in", default=None, help="the previous round's residual (error feedback)")
    packing.add_argument("--residual-out", default=None, help="this round's residual (error feedback)")
    packing.add_argument("--label", default="the site model", help="who it is, in messages")
    packing.add_argument("--out", required=True, help="the update folder (replaced atomically)")
    unpacking = commands.add_parser("decode", help="a site model rebuilt from its update")
    unpacking.add_argument("--update", required=True)
    unpacking.add_argument("--start", required=True)
    unpacking.add_argument("--label", default="the update")
    unpacking.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.command == "compress":
        job = CompressJob(
            args.model,
            args.start,
            args.out,
            residual_in=args.residual_in,
            residual_out=args.residual_out,
            label=args.label,
        )
        compress(job, ExchangeOptions.from_json(args.options))
    else:
        decode_folder(args.update, args.start, args.out, args.label)


if __name__ == "__main__":
    sys.exit(main())
