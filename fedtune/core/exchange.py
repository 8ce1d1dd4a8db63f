"""Compressed exchange of a site's update (federation.exchange): the codec and the update folder's
header.

A site sends its update, the model minus the round's start model, in a smaller form: bf16 or fp16, int8
with one scale per row or per block, or 4 bits a value with one scale per block (two values a byte).
Scales are bf16, rounded up so that no value leaves the integer range. The receiver rebuilds the site's
tensor as `reconstruct(start, parts)`: start + the decoded update, in fp32, rounded to the model's dtype
once. The site runs the same function to learn what it sent, so that its error feedback (what was not
sent, added to the next round's update) counts the rounding to the model's dtype too.

An update folder is a model folder's small files (config, tokenizer, training.json, token_counts.json)
and `model.safetensors` holding, per model tensor `<name>`, its parts: `<name>` (the values) and
`<name>:scale` (int8, int4). The safetensors header's metadata `fedtune.exchange` is the JSON of
`UpdateHeader`: the encoding, each tensor's dtype and shape in the model, and the identity of the start
model it was taken against (sha256 of its weight files), which the receiver checks before it decodes a
byte: a delta is never added to another start model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fedtune.core.checksums import folder_identity, weight_digests
from fedtune.core.exchange_options import ExchangeOptions
from fedtune.core.options import UserError

HEADER_KEY = "fedtune.exchange"
SCALE = ":scale"
WEIGHTS = "model.safetensors"
CHECKSUMS = "fedtune-checksums.json"
FORMAT = 1
INT_MAX = {"int8": 127, "int4": 7}
FLOAT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
ST_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


class ExchangeError(UserError):
    """An update that cannot be decoded against the start model given: the message names the item."""


@dataclass(frozen=True)
class Encoding:
    """How one tensor travels: `raw` (non-float tensors, as stored), a float dtype, or an integer code
    with its scales (`rows`: one per row, else one per `block` values)."""

    kind: str  # raw, bf16, fp16, int8, int4
    block: int = 0  # values per scale; 0: one scale per row (int8 only)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "block": self.block}


def encoding_for(options: ExchangeOptions, dtype: torch.dtype) -> Encoding:
    if not dtype.is_floating_point:
        return Encoding("raw")
    if options.dtype in FLOAT_DTYPES:
        return Encoding(options.dtype)
    block = 0 if options.dtype == "int8" and options.scale == "row" else options.block_size
    return Encoding(options.dtype, block)


def _groups(encoding: Encoding, shape: tuple[int, ...]) -> tuple[int, int]:
    """(groups, values per group) of a tensor: its rows, or its padded blocks."""
    numel = math.prod(shape)
    if encoding.block == 0:
        rows = shape[0] if len(shape) > 1 else 1
        return rows, numel // max(rows, 1)
    return -(-numel // encoding.block), encoding.block


def _aligned(dtype: torch.dtype, numel: int) -> int:
    """Parts are padded to a multiple of 8 bytes, so that the next part (int64 buffers included) starts
    aligned while the file holds every tensor's parts together, in the model's order."""
    per = max(8 // dtype.itemsize, 1)
    return -(-numel // per) * per


def part_shapes(encoding: Encoding, shape: tuple[int, ...], dtype: torch.dtype) -> dict[str, tuple]:
    """{suffix: (torch dtype, numel as stored)} of the parts a tensor of `shape` travels as."""
    numel = math.prod(shape)
    if encoding.kind == "raw":
        return {"": (dtype, _aligned(dtype, numel))}
    if encoding.kind in FLOAT_DTYPES:
        return {"": (FLOAT_DTYPES[encoding.kind], _aligned(torch.bfloat16, numel))}
    groups, size = _groups(encoding, shape)
    padded = groups * size
    values = (torch.int8, padded) if encoding.kind == "int8" else (torch.uint8, -(-padded // 2))
    return {
        "": (values[0], _aligned(values[0], values[1])),
        SCALE: (torch.bfloat16, _aligned(torch.bfloat16, groups)),
    }


def _padded(tensor: torch.Tensor, numel: int) -> torch.Tensor:
    tensor = tensor.reshape(-1)
    if tensor.numel() == numel:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(numel - tensor.numel())])


def encode(update: torch.Tensor, encoding: Encoding, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """The parts of a flat fp32 update (float encodings) or a flat tensor as stored (raw), each padded
    as part_shapes says."""
    sizes = part_shapes(encoding, shape, update.dtype)
    return {
        suffix: _padded(part, sizes[suffix][1]) for suffix, part in _encode(update, encoding, shape).items()
    }


def _encode(update: torch.Tensor, encoding: Encoding, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    if encoding.kind == "raw":
        return {"": update}
    if encoding.kind in FLOAT_DTYPES:
        return {"": update.to(FLOAT_DTYPES[encoding.kind])}
    groups, size = _groups(encoding, shape)
    flat = update.reshape(-1)
    if groups * size != flat.numel():
        flat = torch.cat([flat, flat.new_zeros(groups * size - flat.numel())])
    grouped = flat.view(groups, size)
    top = INT_MAX[encoding.kind]
    absmax = grouped.abs().amax(dim=1)
    scale = (absmax / top).to(torch.bfloat16)
    # Round the scale up where bf16 rounded it down, so that |value / scale| <= top.
    # (Positive bf16 values in order are consecutive integers in their bits.)
    low = scale.float() * top < absmax
    scale.view(torch.int16)[low] += 1
    divisor = scale.float().clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)
    q = torch.round(grouped / divisor).clamp_(-top, top)
    if encoding.kind == "int8":
        return {"": q.to(torch.int8).reshape(-1), SCALE: scale}
    nibbles = (q.reshape(-1) + 8).to(torch.uint8)
    if nibbles.numel() % 2:
        nibbles = torch.cat([nibbles, nibbles.new_full((1,), 8)])
    pairs = nibbles.view(-1, 2)
    return {"": (pairs[:, 0] | (pairs[:, 1] << 4)).contiguous(), SCALE: scale}


def decode(parts: Mapping[str, torch.Tensor], encoding: Encoding, shape: tuple[int, ...]) -> torch.Tensor:
    """The flat fp32 update the parts hold (what `encode` kept of it)."""
    numel = math.prod(shape)
    if encoding.kind in FLOAT_DTYPES:
        return parts[""][:numel].float()
    groups, size = _groups(encoding, shape)
    if encoding.kind == "int8":
        q = parts[""][: groups * size].float()
    else:
        packed = parts[""]
        q = torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)[: groups * size].float() - 8
    values = q.view(groups, size) * parts[SCALE][:groups].float().unsqueeze(1)
    return values.reshape(-1)[:numel]


def reconstruct(
    start: torch.Tensor, parts: Mapping[str, torch.Tensor], encoding: Encoding, shape: tuple[int, ...]
) -> torch.Tensor:
    """The site's tensor as the receiver rebuilds it (flat, in the start model's dtype): start + the
    decoded update, in fp32, rounded once. Raw tensors travel as they are."""
    return Rebuilder().rebuild(start, parts, encoding, shape).clone()


class Rebuilder:
    """`reconstruct` chunk by chunk into reused buffers: the merge keeps one per compressed site, so that
    decoding costs cache-resident passes and no allocation per tensor. Elementwise, the same operations
    in the same order as `decode` + start: the same bits."""

    CHUNK = 1 << 16  # values per pass, rounded to whole groups

    def __init__(self):
        self.out: torch.Tensor | None = None
        self.work = torch.empty(0)
        self.base = torch.empty(0)

    def _buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = getattr(self, name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype:
            buffer = torch.empty(max(numel, buffer.numel() if buffer is not None else 0), dtype=dtype)
            setattr(self, name, buffer)
        return buffer[:numel]

    def rebuild(
        self,
        start: torch.Tensor,
        parts: Mapping[str, torch.Tensor],
        encoding: Encoding,
        shape: tuple[int, ...],
    ) -> torch.Tensor:
        """A view of the rebuilt tensor, valid until the next call."""
        numel = math.prod(shape)
        if encoding.kind == "raw":
            return parts[""][:numel]
        out = self._buffer("out", numel, start.dtype)
        if encoding.kind in FLOAT_DTYPES:
            size = 1
        else:
            _, size = _groups(encoding, shape)
            scale = parts[SCALE]
        step = max(self.CHUNK // size, 1) * size
        values = parts[""]
        for lo in range(0, numel, step):
            hi = min(lo + step, numel)
            whole = -(-(hi - lo) // size) * size  # the chunk's groups, padding included
            work = self._buffer("work", whole, torch.float32)
            if encoding.kind == "int4":
                packed = values[lo // 2 : (lo + whole) // 2]
                pairs = work.view(-1, 2)
                pairs[:, 0].copy_(packed & 15)
                pairs[:, 1].copy_(packed >> 4)
                work.sub_(8)
            else:
                work[: min(whole, values.numel() - lo)].copy_(values[lo : lo + whole])
            if size > 1:
                groups = work.view(-1, size)
                groups.mul_(self._scale(scale, lo // size, whole // size).unsqueeze(1))
            base = self._buffer("base", hi - lo, torch.float32).copy_(start[lo:hi])
            out[lo:hi].copy_(work[: hi - lo].add_(base))
        return out

    def _scale(self, scale: torch.Tensor, first: int, count: int) -> torch.Tensor:
        return scale[first : first + count].float()


# ---------------------------------------------------------------------------------------------------
# The update folder's header


def start_identity(start_dir: str | Path) -> dict:
    """The start model's identity: sha256 of each weight file, from the record its writer left
    (fedtune-checksums.json), else hashed here; and one sha256 over them."""
    files = weight_digests(start_dir)
    return {"identity": folder_identity(files), "files": files}


def attempt() -> dict:
    """This attempt at making a model: a fresh id, the Slurm job (if any), the host and the time. Two
    makings of the same item (a rerun, a requeue that exported again) never share the id."""
    import datetime
    import os
    import socket
    import uuid

    return {
        "id": uuid.uuid4().hex,
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "host": socket.gethostname(),
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def origin(start_dir: str | Path) -> dict:
    """What a model that crosses carries about where it comes from: the identity of the start model it
    was made from (`start_identity`'s one hash; the merge refuses a site model of another start than
    its round's) and its attempt."""
    return {
        "start": {"identity": start_identity(start_dir)["identity"], "model": str(start_dir)},
        "attempt": attempt(),
    }


@dataclass(frozen=True)
class TensorEntry:
    dtype: str  # the model's safetensors dtype name
    shape: tuple[int, ...]
    encoding: Encoding


@dataclass(frozen=True)
class UpdateHeader:
    exchange: dict  # the ExchangeOptions it was made with
    start: dict  # start_identity of the model it was taken against
    tensors: dict[str, TensorEntry] = field(default_factory=dict)  # in the site model's file order

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "exchange": self.exchange,
                "start": self.start,
                "tensors": {
                    name: {"dtype": t.dtype, "shape": list(t.shape), **t.encoding.to_dict()}
                    for name, t in self.tensors.items()
                },
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str, where: str) -> UpdateHeader:
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise ExchangeError(
                    f"{where}: update format {raw.get('format')!r}, this fedtune reads {FORMAT}"
                )
            tensors = {
                name: TensorEntry(t["dtype"], tuple(t["shape"]), Encoding(t["kind"], t["block"]))
                for name, t in raw["tensors"].items()
            }
            return cls(raw["exchange"], raw["start"], tensors)
        except (ValueError, KeyError, TypeError) as e:
            raise ExchangeError(f"{where}: the update's header ({HEADER_KEY}) is unreadable: {e}") from None


def is_update(folder: str | Path) -> bool:
    """Whether a folder holds a compressed update rather than a model."""
    path = Path(folder) / WEIGHTS
    return path.is_file() and read_metadata(path).get(HEADER_KEY) is not None


def read_metadata(path: Path) -> dict:
    import struct

    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            return {}
        (length,) = struct.unpack("<Q", prefix)
        if length > 100 << 20:
            return {}
        try:
            return json.loads(f.read(length)).get("__metadata__") or {}
        except ValueError:
            return {}


def read_header(folder: str | Path, label: str) -> UpdateHeader:
    text = read_metadata(Path(folder) / WEIGHTS).get(HEADER_KEY)
    if text is None:
        raise ExchangeError(f"{label}: {folder}/{WEIGHTS} is not a fedtune update (no {HEADER_KEY} header)")
    return UpdateHeader.from_json(text, f"{label} ({folder})")


def check_start(header: UpdateHeader, start_dir: str | Path, label: str, folder: str | Path) -> None:
    """Refuse an update taken against another start model than `start_dir`: its delta would be added
    to the wrong weights."""
    here = start_identity(start_dir)
    if header.start.get("identity") != here["identity"]:
        raise ExchangeError(
            f"{label}: the update {folder} was taken against start model {header.start.get('identity')} "
            f"({_files(header.start)}), but {start_dir} is {here['identity']} ({_files(here)}): it cannot be "
            "rebuilt from this start model; fetch the round's start model again, or retrain the site"
        )


KINDS = ("raw", *FLOAT_DTYPES, *INT_MAX)


def entry_problem(entry: TensorEntry) -> str | None:
    """Why a header's tensor entry cannot be decoded (None: it can): an unknown dtype or codec, a
    shape that is not a list of sizes, a block that is no positive size."""
    from fedtune.core.safetensors_stream import ST_DTYPES

    if entry.dtype not in ST_DTYPES:
        return f"dtype {entry.dtype!r} is not a safetensors dtype"
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry.shape):
        return f"shape {list(entry.shape)} is not a list of sizes"
    kind, block = entry.encoding.kind, entry.encoding.block
    if kind not in KINDS:
        return f"encoding {kind!r} is not one of {', '.join(KINDS)}"
    if not isinstance(block, int) or isinstance(block, bool) or block < 0 or (kind == "int4" and block == 0):
        return f"block {block!r} is not a size for {kind}"
    if (kind == "raw") == ST_DTYPES[entry.dtype].is_floating_point:
        return f"encoding {kind} does not fit dtype {entry.dtype}"
    return None


def check_parts(header: UpdateHeader, parts: Mapping, label: str, folder: str | Path) -> None:
    """Refuse an update whose parts (name -> the stored tensor's dtype name, shape and bytes) are not
    exactly what the header's codec makes of each tensor's shape: a short part would be decoded from
    whatever the decoder's buffer held before (the previous tensor's values), a long one would hide
    bytes. Every part of every tensor, before a byte is decoded."""
    from fedtune.core.safetensors_stream import ST_DTYPES, ST_NAMES

    where = f"{label}: the update {folder}"
    expected = {}
    for name, entry in header.tensors.items():
        problem = entry_problem(entry)
        if problem:
            raise ExchangeError(f"{where}: its header's tensor {name}: {problem}")
        sizes = part_shapes(entry.encoding, entry.shape, ST_DTYPES[entry.dtype])
        for suffix, (dtype, numel) in sizes.items():
            expected[name + suffix] = (name, ST_NAMES[dtype], numel, numel * dtype.itemsize)
    missing = [part for part in expected if part not in parts]
    if missing:
        raise ExchangeError(f"{where} lacks parts its header lists: {', '.join(missing[:8])}")
    extra = [part for part in parts if part not in expected]
    if extra:
        raise ExchangeError(f"{where} holds parts its header does not list: {', '.join(sorted(extra)[:8])}")
    for part, (name, dtype, numel, nbytes) in expected.items():
        info = parts[part]
        got = math.prod(info.shape)
        if info.dtype != dtype or got != numel or info.nbytes != nbytes:
            entry = header.tensors[name]
            raise ExchangeError(
                f"{where}: tensor {name}'s part {part!r} holds {got} {info.dtype} values ({info.nbytes} "
                f"bytes), but {entry.encoding.kind} of shape {list(entry.shape)} makes {numel} {dtype} "
                f"values ({nbytes} bytes); refused"
            )


def _files(identity: dict) -> str:
    return ", ".join(f"{name} {digest[:12]}" for name, digest in sorted(identity.get("files", {}).items()))
