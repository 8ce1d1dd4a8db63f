"""Merge the site models of a round into one model (FedAvg), streaming tensor by tensor.

Nothing here loads a whole model. The inputs are memory-mapped with `safetensors.safe_open`; each tensor
is averaged in fp32 in a few reusable buffers and written straight into its output shard, whose header
is planned up front from the input headers. Private memory therefore stays near three copies of the
largest tensor in fp32, whatever the model size, so a 7B merge fits on a login node.

Before any of that, every site must agree on tensor names, shapes and dtypes, on the model config and on
the tokenizer: averaging models that do not line up gives a model that loads and is garbage."""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import hashlib
import json
import os
import queue
import re
import shutil
import struct
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fedtune import offline
from fedtune.atomic import atomic_dir, write_json
from fedtune.checksums import sha256_file
from fedtune.models import ModelError, record_checksums, verify_checksums

METHODS = ("fedavg",)
OUTPUT_DTYPES = ("float32", "bfloat16", "float16", "auto")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
# Copied from the first site into the merged model; the tokenizer ones must agree between sites.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
COPIED_FILES = (CONFIG_FILE, "generation_config.json", *TOKENIZER_FILES)

# Config keys that say how a model was saved or run, not what it computes.
CONFIG_IGNORED = {
    "dtype",
    "torch_dtype",
    "transformers_version",
    "_name_or_path",
    "_commit_hash",
    "use_cache",
}
# tokenizer.json keys that are runtime settings of the fast tokenizer, not its vocabulary.
TOKENIZER_JSON_IGNORED = {"truncation", "padding"}
TOKENIZER_CONFIG_IGNORED = {"name_or_path"}

ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
ST_NAMES = {dtype: name for name, dtype in ST_DTYPES.items()}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# At most this many differences of one kind are spelled out; the rest are counted.
SHOWN = 8


class AggregateError(ValueError):
    """Inputs that cannot be merged or bad options: the message names the site and what differs."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    file: str  # file name inside the model folder
    offset: int  # byte offset of the data in the file, for reading in file order
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class SiteModel:
    site: str
    path: Path
    tensors: dict[str, TensorInfo]
    weight_files: list[str]
    sharded: bool
    tokens: int | None = None
    manifest: Path | None = None
    files: dict[str, int] = field(default_factory=dict)  # every file read -> size in bytes
    data_start: dict[str, int] = field(default_factory=dict)  # weight file -> bytes before its data


# ---------------------------------------------------------------------------------------------------
# Options


def parse_size(text: str | int) -> int:
    """Bytes in a size such as 5GB or 500MiB (the units of save_pretrained's max_shard_size)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*", text)
    if not match:
        raise AggregateError(f"--max-shard-size: {text!r} is not a size such as 5GB or 500MiB")
    units = {
        None: 1,
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KiB": 2**10,
        "MiB": 2**20,
        "GiB": 2**30,
        "TiB": 2**40,
    }
    size = int(float(match.group(1)) * units[match.group(2)])
    if size <= 0:
        raise AggregateError(f"--max-shard-size: {text!r} must be positive")
    return size


def parse_pairs(items: Sequence[str], option: str) -> dict[str, Path]:
    pairs: dict[str, Path] = {}
    for item in items:
        site, sep, path = item.partition("=")
        if not sep or not site or not path:
            raise AggregateError(f"{option}: {item!r} is not SITE=PATH")
        if site in pairs:
            raise AggregateError(f"{option}: site {site!r} given twice")
        pairs[site] = Path(path)
    return pairs


def manifest_tokens(site: str, path: Path) -> int:
    """Tokens the site trained on per epoch: splits.train.tokens_kept of its manifest."""
    try:
        manifest = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AggregateError(f"site {site}: manifest not found: {path}") from None
    except json.JSONDecodeError as e:
        raise AggregateError(f"site {site}: manifest {path} is not valid JSON: {e}") from None
    if manifest.get("site", site) != site:
        raise AggregateError(f"site {site}: manifest {path} belongs to site {manifest['site']!r}")
    try:
        tokens = manifest["splits"]["train"]["tokens_kept"]
    except (KeyError, TypeError):
        raise AggregateError(f"site {site}: manifest {path} has no splits.train.tokens_kept") from None
    if not isinstance(tokens, int) or isinstance(tokens, bool):
        raise AggregateError(f"site {site}: manifest {path}: splits.train.tokens_kept is not an integer")
    return tokens


def resolve_weights(
    spec: str | Mapping[str, float], sites: Sequence[str], tokens: Mapping[str, int | None]
) -> tuple[str, dict[str, float]]:
    """(source, raw weight per site) from --weights: tokens, uniform, or a JSON mapping site -> number."""
    if isinstance(spec, str) and spec not in ("tokens", "uniform"):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError:
            raise AggregateError(
                f"--weights: {spec!r} is neither tokens, uniform nor a JSON mapping site -> number"
            ) from None
        if not isinstance(spec, dict):
            raise AggregateError("--weights: a JSON value must be a mapping site -> number")
    if spec == "uniform":
        source, raw = "uniform", {site: 1.0 for site in sites}
    elif spec == "tokens":
        missing = [site for site in sites if tokens.get(site) is None]
        if missing:
            raise AggregateError(
                f"--weights tokens needs --manifest SITE=PATH for every site; missing: {missing}"
            )
        source, raw = "tokens", {site: tokens[site] for site in sites}
    else:
        unknown = sorted(set(spec) - set(sites))
        missing = sorted(set(sites) - set(spec))
        if unknown or missing:
            raise AggregateError(
                f"--weights: must name every site once; unknown: {unknown}, missing: {missing}"
            )
        bad = {s: v for s, v in spec.items() if not isinstance(v, int | float) or isinstance(v, bool)}
        if bad:
            raise AggregateError(f"--weights: weights must be numbers; got {bad}")
        source, raw = "explicit", {site: spec[site] for site in sites}
    negative = {site: w for site, w in raw.items() if w < 0}
    if negative:
        raise AggregateError(f"--weights ({source}): negative weights {negative}")
    if sum(raw.values()) <= 0:
        raise AggregateError(f"--weights ({source}): the weights sum to zero ({raw})")
    return source, raw


# ---------------------------------------------------------------------------------------------------
# Reading the inputs' metadata


def read_header(path: Path) -> dict:
    """The JSON header of a safetensors file (the format is an 8-byte length, then the JSON)."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise AggregateError(f"{path}: not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", prefix)
        if length > 100 << 20:
            raise AggregateError(f"{path}: not a safetensors file (header of {length} bytes)")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return {"_data_start": 8 + length, **header}


def read_site_model(site: str, path: Path) -> SiteModel:
    path = Path(path)
    if not path.is_dir():
        raise AggregateError(f"site {site}: model folder not found: {path}")
    if not (path / CONFIG_FILE).is_file():
        raise AggregateError(f"site {site}: {path} has no config.json (not a save_pretrained folder)")
    files: dict[str, int] = {}
    index_path = path / INDEX_FILE
    if index_path.is_file():
        index = json.loads(index_path.read_text(encoding="utf-8"))
        weight_map: dict[str, str] = index.get("weight_map", {})
        weight_files = sorted(set(weight_map.values()))
        files[INDEX_FILE] = index_path.stat().st_size
        sharded = True
    elif (path / SINGLE_FILE).is_file():
        weight_map = {}
        weight_files = [SINGLE_FILE]
        sharded = False
    else:
        raise AggregateError(f"site {site}: {path} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    tensors: dict[str, TensorInfo] = {}
    data_start: dict[str, int] = {}
    for name in weight_files:
        file = path / name
        if not file.is_file():
            raise AggregateError(f"site {site}: {INDEX_FILE} names {name}, which is missing in {path}")
        files[name] = file.stat().st_size
        header = read_header(file)
        start = data_start[name] = header.pop("_data_start")
        for tensor, meta in header.items():
            if tensor in tensors:
                raise AggregateError(f"site {site}: tensor {tensor} is stored twice ({path})")
            if sharded and weight_map.get(tensor) != name:
                raise AggregateError(
                    f"site {site}: {name} holds {tensor}, but {INDEX_FILE} puts it in {weight_map.get(tensor)}"
                )
            if meta["dtype"] not in ST_DTYPES:
                raise AggregateError(f"site {site}: tensor {tensor} has unsupported dtype {meta['dtype']}")
            begin, end = meta["data_offsets"]
            tensors[tensor] = TensorInfo(
                meta["dtype"], tuple(meta["shape"]), name, start + begin, end - begin
            )
    missing = sorted(set(weight_map) - set(tensors))
    if missing:
        raise AggregateError(f"site {site}: {INDEX_FILE} lists tensors no shard holds: {_listing(missing)}")
    for name in COPIED_FILES:
        if (path / name).is_file():
            files[name] = (path / name).stat().st_size
    return SiteModel(site, path, tensors, weight_files, sharded, files=files, data_start=data_start)


# ---------------------------------------------------------------------------------------------------
# Compatibility


def _listing(items: Sequence[str]) -> str:
    items = list(items)
    shown = ", ".join(items[:SHOWN])
    return shown + (f" (and {len(items) - SHOWN} more)" if len(items) > SHOWN else "")


def _json_or_bytes(path: Path):
    if path.suffix == ".json":
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            pass
    return path.read_bytes()


def _describe_tokenizer_json(ref: dict, other: dict) -> str:
    ref_model, other_model = ref.get("model", {}), other.get("model", {})
    ref_vocab, other_vocab = ref_model.get("vocab"), other_model.get("vocab")
    if ref_vocab != other_vocab:
        if isinstance(ref_vocab, dict) and isinstance(other_vocab, dict):
            changed = sum(1 for tok, i in ref_vocab.items() if other_vocab.get(tok) != i)
            return f"vocabulary differs ({len(other_vocab)} vs {len(ref_vocab)} entries, {changed} differ)"
        return "vocabulary differs"
    if ref_model.get("merges") != other_model.get("merges"):
        return "BPE merges differ"
    if ref.get("added_tokens") != other.get("added_tokens"):
        return "added/special tokens differ"
    keys = sorted(k for k in set(ref) | set(other) if ref.get(k) != other.get(k))
    return f"settings differ: {', '.join(keys)}"


def _tokenizer_differences(ref: SiteModel, other: SiteModel) -> list[str]:
    diffs = []
    for name in TOKENIZER_FILES:
        a, b = ref.path / name, other.path / name
        if not a.is_file() and not b.is_file():
            continue
        if a.is_file() != b.is_file():
            where = ref.site if a.is_file() else other.site
            diffs.append(f"{name} exists only at site {where}")
            continue
        va, vb = _json_or_bytes(a), _json_or_bytes(b)
        if isinstance(va, dict) and isinstance(vb, dict):
            ignored = TOKENIZER_JSON_IGNORED if name == "tokenizer.json" else TOKENIZER_CONFIG_IGNORED
            va = {k: v for k, v in va.items() if k not in ignored}
            vb = {k: v for k, v in vb.items() if k not in ignored}
            if va == vb:
                continue
            if name == "tokenizer.json":
                diffs.append(f"tokenizer.json: {_describe_tokenizer_json(va, vb)}")
            else:
                keys = sorted(k for k in set(va) | set(vb) if va.get(k) != vb.get(k))
                diffs.append(f"{name}: " + ", ".join(f"{k}={vb.get(k)!r} vs {va.get(k)!r}" for k in keys))
        elif va != vb:
            diffs.append(f"{name} differs")
    return diffs


def _config_differences(ref: SiteModel, other: SiteModel) -> list[str]:
    a = json.loads((ref.path / CONFIG_FILE).read_text(encoding="utf-8"))
    b = json.loads((other.path / CONFIG_FILE).read_text(encoding="utf-8"))
    keys = sorted(k for k in (set(a) | set(b)) - CONFIG_IGNORED if a.get(k) != b.get(k))
    return [f"{k}={b.get(k, '(absent)')!r} vs {a.get(k, '(absent)')!r}" for k in keys]


def check_compatible(models: Sequence[SiteModel]) -> None:
    """Raise AggregateError listing every way a site differs from the first one."""
    ref = models[0]
    problems = []
    for other in models[1:]:
        who = f"site {other.site} vs site {ref.site}"
        only_ref = sorted(set(ref.tensors) - set(other.tensors))
        only_other = sorted(set(other.tensors) - set(ref.tensors))
        if only_ref:
            problems.append(f"{who}: tensor names differ: missing at {other.site}: {_listing(only_ref)}")
        if only_other:
            problems.append(f"{who}: tensor names differ: only at {other.site}: {_listing(only_other)}")
        common = sorted(set(ref.tensors) & set(other.tensors))
        shapes = [
            f"{n} {list(other.tensors[n].shape)} vs {list(ref.tensors[n].shape)}"
            for n in common
            if other.tensors[n].shape != ref.tensors[n].shape
        ]
        if shapes:
            problems.append(f"{who}: tensor shapes differ: {_listing(shapes)}")
        dtypes = [
            f"{n} {other.tensors[n].dtype} vs {ref.tensors[n].dtype}"
            for n in common
            if other.tensors[n].dtype != ref.tensors[n].dtype
        ]
        if dtypes:
            problems.append(f"{who}: tensor dtypes differ: {_listing(dtypes)}")
        config = _config_differences(ref, other)
        if config:
            problems.append(f"{who}: config architecture differs (config.json): {_listing(config)}")
        tokenizer = _tokenizer_differences(ref, other)
        if tokenizer:
            problems.append(f"{who}: tokenizer differs: {'; '.join(tokenizer)}")
    if problems:
        raise AggregateError("the site models cannot be merged:\n  " + "\n  ".join(problems))


# ---------------------------------------------------------------------------------------------------
# Planning and writing the output


@dataclass
class OutTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def plan_output(ref: SiteModel, dtype: str, max_shard_size: int) -> list[list[OutTensor]]:
    """Output tensors grouped into shards, in the first site's file order (sequential reads).
    Like save_pretrained: a shard is closed when the next tensor would push it past max_shard_size."""
    order = sorted(
        ref.tensors, key=lambda n: (ref.weight_files.index(ref.tensors[n].file), ref.tensors[n].offset)
    )
    shards: list[list[OutTensor]] = [[]]
    size = 0
    for name in order:
        info = ref.tensors[name]
        in_dtype = ST_DTYPES[info.dtype]
        out_dtype = in_dtype if dtype == "auto" or not in_dtype.is_floating_point else TORCH_DTYPES[dtype]
        tensor = OutTensor(name, out_dtype, info.shape, info.numel)
        if shards[-1] and size + tensor.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    # Larger items first keeps every tensor aligned to its item size inside the file (as safetensors does).
    return [sorted(shard, key=lambda t: -t.dtype.itemsize) for shard in shards]


def shard_header(tensors: Sequence[OutTensor]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": ST_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class InputHashes:
    """sha256 of the input weight files, fed with the bytes the merge reads anyway, so that
    checksumming costs no second pass over the inputs.

    A file's digest takes its header, then its tensors in file order. The merge visits tensors in the
    first site's file order, which is every site's order when the same code saved them; a file visited
    in another order is hashed again from disk at the end."""

    def __init__(self, models: Sequence[SiteModel]):
        self.models = models
        self.state: dict[tuple[int, str], list | None] = {}
        for i, m in enumerate(models):
            for name in m.weight_files:
                digest = hashlib.sha256()
                with open(m.path / name, "rb") as f:
                    digest.update(f.read(m.data_start[name]))
                self.state[(i, name)] = [digest, m.data_start[name]]

    def feed(self, key: tuple[int, str], offset: int, data: memoryview) -> None:
        entry = self.state[key]
        if entry is None:
            return
        if offset != entry[1]:
            self.state[key] = None
            return
        entry[0].update(data)
        entry[1] += len(data)

    def result(self) -> dict[tuple[int, str], str]:
        digests = {}
        for (i, name), entry in self.state.items():
            m = self.models[i]
            if entry is not None and entry[1] == m.files[name]:
                digests[(i, name)] = entry[0].hexdigest()
            else:
                digests[(i, name)] = sha256_file(m.path / name)
        return digests


class ShardWriter:
    """Writes output shards on its own thread, so that writing tensor k overlaps reading and averaging
    tensor k+1; hashes them on the way. Buffers come back through `free` once written."""

    def __init__(self, slots: int, hashing: bool):
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="writer")
        self.free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(slots):
            self.free.put(slot)
        self.hashing = hashing
        self.file = None
        self.digest = None
        self.pending: list[concurrent.futures.Future] = []

    def open(self, path: Path, header: bytes) -> None:
        self.pending.append(self.pool.submit(self._open, path, header))

    def write(self, slot: int, data: memoryview) -> None:
        self.pending.append(self.pool.submit(self._write, slot, data))

    def close(self) -> concurrent.futures.Future:
        future = self.pool.submit(self._close)
        self.pending.append(future)
        return future

    def take_slot(self) -> int:
        slot = self.free.get()
        # Stop at the writer's first error (disk full, say) instead of merging the rest for nothing.
        failed = next((f for f in self.pending if f.done() and f.exception() is not None), None)
        if failed is not None:
            raise failed.exception()
        self.pending = [f for f in self.pending if not f.done()]
        return slot

    def _open(self, path: Path, header: bytes) -> None:
        self.file = open(path, "wb")  # closed by _close, or by shutdown after an error
        self.digest = hashlib.sha256() if self.hashing else None
        self._put(header)

    def _write(self, slot: int, data: memoryview) -> None:
        try:
            self._put(data)
        finally:
            self.free.put(slot)

    def _put(self, data) -> None:
        self.file.write(data)
        if self.digest is not None:
            self.digest.update(data)

    def _close(self) -> tuple[int, str | None]:
        self.file.flush()
        os.fsync(self.file.fileno())
        size = self.file.tell()
        self.file.close()
        self.file = None
        return size, self.digest.hexdigest() if self.digest is not None else None

    def finish(self) -> None:
        """Wait for every write; raises the first error of the writer thread."""
        for future in self.pending:
            future.result()
        self.pending.clear()

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.file is not None:
            self.file.close()


class Prefetcher:
    """Asks the kernel to read the next tensors of every site ahead of time (posix_fadvise WILLNEED),
    so that the disk keeps reading while the merge averages and writes: reading a memory map by page
    faults alone is slower than a sequential read, and it stalls on every miss."""

    AHEAD = 2  # tensors

    def __init__(self, models: Sequence[SiteModel], order: Sequence[str]):
        self.models = models
        self.order = order
        self.fds = {
            (i, f): os.open(m.path / f, os.O_RDONLY) for i, m in enumerate(models) for f in m.weight_files
        }
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        for k in range(min(self.AHEAD, len(order))):
            self.pool.submit(self._advise, k)

    def reached(self, k: int) -> None:
        if k + self.AHEAD < len(self.order):
            self.pool.submit(self._advise, k + self.AHEAD)

    def _advise(self, k: int) -> None:
        name = self.order[k]
        for i, m in enumerate(self.models):
            info = m.tensors[name]
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self.fds[(i, info.file)], info.offset, info.nbytes, os.POSIX_FADV_WILLNEED)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for fd in self.fds.values():
            os.close(fd)


class Buffers:
    """Flat scratch tensors reused for every tensor: fresh allocations of this size would be returned
    to the OS on free and page-faulted in again each time, which costs more than the arithmetic.
    Two output slots: one being written while the next tensor is averaged into the other."""

    SLOTS = 2

    def __init__(self, numel: int, out_itemsize: int):
        self.acc = torch.empty(numel, dtype=torch.float32)
        self.tmp = torch.empty(numel, dtype=torch.float32)
        self.out = [torch.empty(numel * out_itemsize, dtype=torch.uint8) for _ in range(self.SLOTS)]


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def merge_tensor(
    out: OutTensor,
    sources: Sequence[torch.Tensor],
    sites: Sequence[str],
    weights: Sequence[float],
    buffers: Buffers,
    slot: int,
) -> memoryview:
    """The weighted mean of one tensor over the sites, as `out.dtype`, in output slot `slot`.

    Computed as a running mean, acc += w_k / W_k * (x_k - acc) with W_k the cumulative weight, which
    returns an input unchanged, bit for bit, when every site holds the same values."""
    n = out.numel
    result = buffers.out[slot][: out.nbytes].view(out.dtype)
    if not sources[0].dtype.is_floating_point:
        # Integer buffers (position ids, masks) cannot be averaged; they must simply agree.
        for site, src in zip(sites[1:], sources[1:], strict=True):
            if not torch.equal(src, sources[0]):
                raise AggregateError(
                    f"tensor {out.name} ({sources[0].dtype}) differs between site {sites[0]} and "
                    f"site {site}; non-float tensors must be identical"
                )
        result.copy_(sources[0])
        return _as_bytes(result)
    acc = buffers.acc[:n]
    tmp = buffers.tmp[:n]
    total = 0.0
    for src, weight in zip(sources, weights, strict=True):
        if weight == 0:
            continue
        total += weight
        if total == weight:
            acc.copy_(src)
            continue
        tmp.copy_(src)
        tmp.sub_(acc)
        acc.add_(tmp, alpha=weight / total)
    result.copy_(acc)
    return _as_bytes(result)


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _copy_support_files(ref: SiteModel, out_dir: Path, dtype: str) -> None:
    for name in COPIED_FILES:
        src = ref.path / name
        if not src.is_file():
            continue
        if name == CONFIG_FILE and dtype != "auto":
            config = json.loads(src.read_text(encoding="utf-8"))
            # from_pretrained reads the dtype to load in from here; it must describe the merged weights.
            config["dtype"] = dtype
            if "torch_dtype" in config:
                config["torch_dtype"] = dtype
            write_json(out_dir / name, config)
        else:
            shutil.copyfile(src, out_dir / name)
            os.chmod(out_dir / name, 0o644)


def _log(message: str) -> None:
    print(f"[aggregate] {message}", file=sys.stderr, flush=True)


def aggregate(
    models: Mapping[str, str | Path],
    out_dir: str | Path,
    *,
    method: str = "fedavg",
    weights: str | Mapping[str, float] = "tokens",
    manifests: Mapping[str, str | Path] | None = None,
    dtype: str = "auto",
    max_shard_size: str | int = "5GB",
    checksums: bool = True,
) -> dict:
    """Merge the site models `models` (site -> model folder) into `out_dir`; returns aggregate.json.

    Every check (options, weights, compatibility) runs before the first byte is written."""
    started = time.perf_counter()
    if method not in METHODS:
        raise AggregateError(f"--method: {method!r} is not one of {', '.join(METHODS)}")
    if dtype not in OUTPUT_DTYPES:
        raise AggregateError(f"--dtype: {dtype!r} is not one of {', '.join(OUTPUT_DTYPES)}")
    if not models:
        raise AggregateError("no site models given (--model SITE=DIR)")
    manifests = {site: Path(p) for site, p in (manifests or {}).items()}
    sites = list(models)
    unknown = sorted(set(manifests) - set(sites))
    if unknown:
        raise AggregateError(f"--manifest given for sites without --model: {unknown}")
    resolved: dict[Path, str] = {}
    for site, path in models.items():
        real = Path(path).resolve()
        if real in resolved:
            # The published run once averaged a model with itself; a copy-paste slip must not pass.
            raise AggregateError(f"sites {resolved[real]} and {site} point at the same model folder {path}")
        resolved[real] = site
    tokens = {site: manifest_tokens(site, path) for site, path in manifests.items()}
    source, raw = resolve_weights(weights, sites, tokens)
    total = float(sum(raw.values()))
    normalised = {site: raw[site] / total for site in sites}
    shard_limit = parse_size(max_shard_size)

    site_models = [read_site_model(site, Path(models[site])) for site in sites]
    for m in site_models:
        m.tokens = tokens.get(m.site)
        m.manifest = manifests.get(m.site)
    check_compatible(site_models)

    ref = site_models[0]
    plan = plan_output(ref, dtype, shard_limit)
    n_weights = [normalised[m.site] for m in site_models]
    _log(
        f"fedavg of {len(sites)} sites ({source} weights "
        + ", ".join(f"{s}={normalised[s]:.4f}" for s in sites)
        + f"): {sum(len(s) for s in plan)} tensors into {len(plan)} shard(s)"
    )
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        output, digests = _write_shards(tmp, plan, site_models, n_weights, checksums)
        _copy_support_files(ref, tmp, dtype)
        inputs = []
        for i, m in enumerate(site_models):
            files = {}
            for name, size in m.files.items():
                digest = digests.get((i, name)) if name in m.weight_files else None
                if checksums and digest is None:
                    digest = sha256_file(m.path / name)
                files[name] = {"bytes": size, "sha256": digest}
            inputs.append(
                {
                    "site": m.site,
                    "model_dir": str(m.path),
                    "manifest": str(m.manifest) if m.manifest else None,
                    "tokens_kept": m.tokens,
                    "sharded": m.sharded,
                    "bytes": sum(m.files[f] for f in m.weight_files),
                    "files": files,
                }
            )
        if checksums:
            # Inputs were hashed while being read: compare with what training recorded, for free.
            for entry, m in zip(inputs, site_models, strict=True):
                verify_checksums(m.path, {name: f["sha256"] for name, f in entry["files"].items()})
            record_checksums(tmp, {name: f["sha256"] for name, f in output["files"].items()})
        warnings = _identical_inputs(inputs, site_models) if checksums else []
        for warning in warnings:
            _log(f"warning: {warning}")
        record = {
            "method": method,
            "weights": {"source": source, "raw": raw, "normalised": normalised},
            "dtype": dtype,
            "max_shard_size": max_shard_size,
            "inputs": inputs,
            "output": output,
            "warnings": warnings,
            "wall_time_s": round(time.perf_counter() - started, 3),
        }
        write_json(tmp / "aggregate.json", record)
    _log(f"done in {record['wall_time_s']:.1f} s: {out_dir}")
    return record


def _identical_inputs(inputs: Sequence[dict], models: Sequence[SiteModel]) -> list[str]:
    warnings = []
    seen: dict[tuple, str] = {}
    for entry, m in zip(inputs, models, strict=True):
        key = tuple(entry["files"][f]["sha256"] for f in m.weight_files)
        if key in seen:
            warnings.append(f"sites {seen[key]} and {m.site} have identical weights")
        seen.setdefault(key, m.site)
    return warnings


def _write_shards(
    out_dir: Path,
    plan: Sequence[Sequence[OutTensor]],
    models: Sequence[SiteModel],
    weights: Sequence[float],
    checksums: bool,
) -> tuple[dict, dict[tuple[int, str], str]]:
    """Write the merged shards (and the index when there are several). Returns the output record and
    the sha256 of every input weight file (empty without checksums)."""
    from safetensors import safe_open

    names = shard_names(len(plan))
    order = [t.name for shard in plan for t in shard]
    largest = max(t.numel for shard in plan for t in shard)
    buffers = Buffers(largest, max(t.dtype.itemsize for shard in plan for t in shard))
    handles = [{f: safe_open(m.path / f, framework="pt") for f in m.weight_files} for m in models]
    sites = [m.site for m in models]
    weight_map: dict[str, str] = {}
    total_bytes = total_params = 0
    closed = {}
    hashes = InputHashes(models) if checksums else None
    with contextlib.ExitStack() as stack:
        writer = ShardWriter(Buffers.SLOTS, checksums)
        stack.callback(writer.shutdown)
        prefetch = Prefetcher(models, order)
        stack.callback(prefetch.shutdown)
        hasher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hash")
        stack.callback(hasher.shutdown, wait=True, cancel_futures=True)
        k = 0
        for shard, name in zip(plan, names, strict=True):
            started = time.perf_counter()
            writer.open(out_dir / name, shard_header(shard))
            for tensor in shard:
                prefetch.reached(k)
                k += 1
                infos = [m.tensors[tensor.name] for m in models]
                sources = [
                    h[i.file].get_tensor(tensor.name).reshape(-1) for h, i in zip(handles, infos, strict=True)
                ]
                if hashes is not None:
                    for i, (info, src) in enumerate(zip(infos, sources, strict=True)):
                        hasher.submit(hashes.feed, (i, info.file), info.offset, _as_bytes(src))
                slot = writer.take_slot()
                writer.write(slot, merge_tensor(tensor, sources, sites, weights, buffers, slot))
                weight_map[tensor.name] = name
                total_bytes += tensor.nbytes
                total_params += tensor.numel
            closed[name] = writer.close()
            _log(f"shard {name}: {len(shard)} tensors merged in {time.perf_counter() - started:.1f} s")
        writer.finish()
        hasher.shutdown(wait=True)
        input_digests = hashes.result() if hashes is not None else {}
    files = {}
    for name, future in closed.items():
        size, digest = future.result()
        os.chmod(out_dir / name, 0o644)
        files[name] = {"bytes": size, "sha256": digest}
    if len(plan) > 1:
        index = {
            "metadata": {"total_parameters": total_params, "total_size": total_bytes},
            "weight_map": dict(sorted(weight_map.items())),
        }
        write_json(out_dir / INDEX_FILE, index)
    output = {"tensors": len(weight_map), "parameters": total_params, "bytes": total_bytes, "files": files}
    return output, input_digests


def main(argv: Sequence[str] | None = None) -> int:
    offline.enforce()
    parser = argparse.ArgumentParser(
        prog="python -m fedtune.aggregate",
        description="Merge site models (HF save_pretrained folders with safetensors) into one, streaming.",
    )
    parser.add_argument("--out", required=True, help="folder of the merged model (replaced atomically)")
    parser.add_argument(
        "--model", nargs="+", action="extend", required=True, metavar="SITE=DIR", help="site model folders"
    )
    parser.add_argument(
        "--manifest",
        nargs="+",
        action="extend",
        default=[],
        metavar="SITE=PATH",
        help="site manifests (data/<site>/manifest.json); needed for --weights tokens",
    )
    parser.add_argument("--method", default="fedavg", choices=METHODS)
    parser.add_argument(
        "--weights",
        default="tokens",
        help="tokens (splits.train.tokens_kept of each manifest), uniform, or a JSON mapping site -> number",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=OUTPUT_DTYPES,
        help="dtype of the merged floating-point tensors (auto: as in the inputs); the mean is taken in fp32",
    )
    parser.add_argument("--max-shard-size", default="5GB", help="largest output file, as save_pretrained")
    parser.add_argument("--no-checksums", action="store_true", help="skip the sha256 of inputs and outputs")
    args = parser.parse_args(argv)
    try:
        aggregate(
            parse_pairs(args.model, "--model"),
            args.out,
            method=args.method,
            weights=args.weights,
            manifests=parse_pairs(args.manifest, "--manifest"),
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            checksums=not args.no_checksums,
        )
    except (AggregateError, ModelError) as e:
        print(f"aggregate: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
