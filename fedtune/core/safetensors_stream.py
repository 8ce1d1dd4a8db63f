"""Safetensors folders read and written tensor by tensor, never whole.

Reading: the headers are parsed up front (`read_weights`), the tensors are memory-mapped with
`safetensors.safe_open`, the kernel is asked to read ahead (`Prefetcher`), and each file's sha256 is
computed from the bytes read anyway (`InputHashes`). Writing: the output's shards and headers are
planned before the first tensor is computed (`plan_shards`), and a writer thread fills the files from
reusable buffers while the next tensor is computed (`ShardedOutput`). Private memory therefore stays
near a few copies of the largest tensor, whatever the model size.

What is computed from the tensors is not this module's business: see fedtune.aggregate.merge and
fedtune.aggregate.methods."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import queue
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fedtune.core.atomic import write_json
from fedtune.core.checksums import sha256_file
from fedtune.core.options import UserError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

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

# At most this many names are spelled out in an error; the rest are counted.
SHOWN = 8


class WeightsError(UserError):
    """A weights folder that cannot be read as safetensors: the message names the folder and file."""


def listing(items: Sequence[str]) -> str:
    items = list(items)
    shown = ", ".join(items[:SHOWN])
    return shown + (f" (and {len(items) - SHOWN} more)" if len(items) > SHOWN else "")


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    file: str  # file name inside the folder
    offset: int  # byte offset of the data in the file, for reading in file order
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class WeightFolder:
    """The safetensors files of one folder (a save_pretrained model, a server state): where each
    tensor lies, and the size of every file read."""

    site: str  # whose folder it is: a site, "start", "server state"
    path: Path
    tensors: dict[str, TensorInfo]
    weight_files: list[str]
    sharded: bool
    tokens: int | None = None
    manifest: Path | None = None
    files: dict[str, int] = field(default_factory=dict)  # every file read -> size in bytes
    data_start: dict[str, int] = field(default_factory=dict)  # weight file -> bytes before its data
    label: str = ""  # the folder in messages: "site alpha", "the start model"
    update: tuple | None = None  # a compressed update (fedtune.core.exchange): (header, its parts' folder)


def read_header(path: Path) -> dict:
    """The JSON header of a safetensors file (the format is an 8-byte length, then the JSON)."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise WeightsError(f"{path}: not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", prefix)
        if length > 100 << 20:
            raise WeightsError(f"{path}: not a safetensors file (header of {length} bytes)")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return {"_data_start": 8 + length, **header}


def index_problem(tensor: object, file: object) -> str | None:
    """Why an entry of a weight index is not a plain file of the index's own folder (None: it is one).
    An index comes with the folder, from whoever wrote it: another cluster's site model may name
    `../../it/model/model.safetensors` to have this cluster's own site model read as its weights."""
    if not isinstance(tensor, str) or not isinstance(file, str):
        return "is not a tensor name mapped to a file name"
    if not file or file in (".", "..") or "/" in file or "\\" in file or "\0" in file:
        return "is not a plain file name of the index's own folder"
    return None


def read_index(path: Path, label: str) -> dict[str, str]:
    """The weight map of the folder's model.safetensors.index.json: tensor name -> file, every file a plain
    name of the folder itself; raises WeightsError naming the folder's owner, the file and the entry."""
    index_path = Path(path) / INDEX_FILE
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(f"{label}: {index_path} is not valid JSON: {e}") from None
    weight_map = index.get("weight_map", {}) if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise WeightsError(f"{label}: {index_path}: weight_map is not a mapping of tensor names to files")
    for tensor, file in weight_map.items():
        problem = index_problem(tensor, file)
        if problem:
            raise WeightsError(f"{label}: {index_path}: entry {tensor!r}: {file!r} {problem}; refused")
    return weight_map


def read_weights(site: str, path: Path, label: str | None = None) -> WeightFolder:
    """The tensor table of a folder holding model.safetensors, or shards and their index."""
    path = Path(path)
    label = label or site
    who = label
    files: dict[str, int] = {}
    index_path = path / INDEX_FILE
    if index_path.is_file():
        weight_map: dict[str, str] = read_index(path, who)
        weight_files = sorted(set(weight_map.values()))
        files[INDEX_FILE] = index_path.stat().st_size
        sharded = True
    elif (path / SINGLE_FILE).is_file():
        weight_map = {}
        weight_files = [SINGLE_FILE]
        sharded = False
    else:
        raise WeightsError(f"{who}: {path} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    tensors: dict[str, TensorInfo] = {}
    data_start: dict[str, int] = {}
    for name in weight_files:
        file = path / name
        if not file.is_file():
            raise WeightsError(f"{who}: {INDEX_FILE} names {name}, which is missing in {path}")
        files[name] = file.stat().st_size
        header = read_header(file)
        start = data_start[name] = header.pop("_data_start")
        for tensor, meta in header.items():
            if tensor in tensors:
                raise WeightsError(f"{who}: tensor {tensor} is stored twice ({path})")
            if sharded and weight_map.get(tensor) != name:
                raise WeightsError(
                    f"{who}: {name} holds {tensor}, but {INDEX_FILE} puts it in {weight_map.get(tensor)}"
                )
            if meta["dtype"] not in ST_DTYPES:
                raise WeightsError(f"{who}: tensor {tensor} has unsupported dtype {meta['dtype']}")
            begin, end = meta["data_offsets"]
            tensors[tensor] = TensorInfo(
                meta["dtype"], tuple(meta["shape"]), name, start + begin, end - begin
            )
    missing = sorted(set(weight_map) - set(tensors))
    if missing:
        raise WeightsError(f"{who}: {INDEX_FILE} lists tensors no shard holds: {listing(missing)}")
    return WeightFolder(
        site, path, tensors, weight_files, sharded, files=files, data_start=data_start, label=label
    )


def file_order(folder: WeightFolder) -> list[str]:
    """Tensor names in the order their bytes lie on disk (sequential reads)."""
    return sorted(
        folder.tensors,
        key=lambda n: (folder.weight_files.index(folder.tensors[n].file), folder.tensors[n].offset),
    )


# ---------------------------------------------------------------------------------------------------
# Output planning


@dataclass
class OutTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def plan_shards(tensors: Sequence[OutTensor], max_shard_size: int) -> list[list[OutTensor]]:
    """Tensors grouped into shards in the given order. Like save_pretrained: a shard is closed when the
    next tensor would push it past max_shard_size."""
    shards: list[list[OutTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    # Larger items first keeps every tensor aligned to its item size inside the file (as safetensors does).
    return [sorted(shard, key=lambda t: -t.dtype.itemsize) for shard in shards]


def shard_header(tensors: Sequence[OutTensor], metadata: dict[str, str] | None = None) -> bytes:
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
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


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


# ---------------------------------------------------------------------------------------------------
# Reading


def as_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


class InputHashes:
    """sha256 of the input weight files, fed with the bytes the merge reads anyway, so that
    checksumming costs no second pass over the inputs.

    A file's digest takes its header, then its tensors in file order. The merge visits tensors in the
    first site's file order, which is every site's order when the same code saved them; a file visited
    in another order is hashed again from disk at the end."""

    def __init__(self, models: Sequence[WeightFolder]):
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


class Prefetcher:
    """Asks the kernel to read the next tensors of every folder ahead of time (posix_fadvise
    WILLNEED), so that the disk keeps reading while the merge computes and writes: reading a memory map
    by page faults alone is slower than a sequential read, and it stalls on every miss."""

    AHEAD = 2  # tensors

    def __init__(self, models: Sequence[WeightFolder], orders: Sequence[Sequence[Sequence[str]]]):
        """orders[i][k]: the tensors of folder i read at step k."""
        self.models = models
        self.orders = orders
        self.steps = max((len(o) for o in orders), default=0)
        self.fds = {
            (i, f): os.open(m.path / f, os.O_RDONLY) for i, m in enumerate(models) for f in m.weight_files
        }
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        for k in range(min(self.AHEAD, self.steps)):
            self.pool.submit(self._advise, k)

    def reached(self, k: int) -> None:
        if k + self.AHEAD < self.steps:
            self.pool.submit(self._advise, k + self.AHEAD)

    def _advise(self, k: int) -> None:
        for i, m in enumerate(self.models):
            for name in self.orders[i][k] if k < len(self.orders[i]) else ():
                info = m.tensors[name]
                if hasattr(os, "posix_fadvise"):
                    fd = self.fds[(i, info.file)]
                    os.posix_fadvise(fd, info.offset, info.nbytes, os.POSIX_FADV_WILLNEED)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for fd in self.fds.values():
            os.close(fd)


class FolderReader:
    """Memory-mapped tensors of several folders, read ahead and hashed on the way."""

    def __init__(
        self, folders: Sequence[WeightFolder], orders: Sequence[Sequence[Sequence[str]]], hashing: bool
    ):
        from safetensors import safe_open

        self.folders = folders
        self.handles = [{f: safe_open(m.path / f, framework="pt") for f in m.weight_files} for m in folders]
        self.hashes = InputHashes(folders) if hashing else None
        self.hasher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hash")
        self.prefetch = Prefetcher(folders, orders)

    def reached(self, k: int) -> None:
        self.prefetch.reached(k)

    def get(self, i: int, name: str) -> torch.Tensor:
        """Tensor `name` of folder i, flat, as stored (a view of the memory map)."""
        info = self.folders[i].tensors[name]
        tensor = self.handles[i][info.file].get_tensor(name).reshape(-1)
        if self.hashes is not None:
            self.hasher.submit(self.hashes.feed, (i, info.file), info.offset, as_bytes(tensor))
        return tensor

    def digests(self) -> dict[tuple[int, str], str]:
        """sha256 of every file (empty without hashing); call once, after the last get."""
        self.hasher.shutdown(wait=True)
        return self.hashes.result() if self.hashes is not None else {}

    def shutdown(self) -> None:
        self.prefetch.shutdown()
        self.hasher.shutdown(wait=True, cancel_futures=True)


# ---------------------------------------------------------------------------------------------------
# Writing


class ShardWriter:
    """Writes output shards on its own thread, so that writing tensor k overlaps reading and computing
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


class ShardedOutput:
    """A planned set of output shards filled in plan order: `slot(t)` hands out a buffer for tensor t,
    `put(t, slot)` queues it for writing (opening its shard before the shard's first tensor, closing it
    after its last). Two buffers: one being written while the next tensor
    is computed into the other; reusing them saves the page faults of fresh allocations."""

    SLOTS = 2

    def __init__(
        self,
        out_dir: Path,
        plan: Sequence[Sequence[OutTensor]],
        hashing: bool,
        metadata: dict[str, str] | None = None,
    ):
        self.out_dir = Path(out_dir)
        self.plan = plan
        self.names = shard_names(len(plan))
        self.metadata = metadata
        largest = max((t.nbytes for shard in plan for t in shard), default=0)
        self.buffers = [torch.empty(largest, dtype=torch.uint8) for _ in range(self.SLOTS)]
        self.writer = ShardWriter(self.SLOTS, hashing)
        self.where = {t.name: (s, k) for s, shard in enumerate(plan) for k, t in enumerate(shard)}
        self.closed: dict[str, concurrent.futures.Future] = {}
        self.weight_map: dict[str, str] = {}
        self.total_bytes = self.total_params = 0

    def order(self) -> list[OutTensor]:
        return [t for shard in self.plan for t in shard]

    def slot(self, tensor: OutTensor) -> tuple[int, torch.Tensor]:
        """A free buffer for `tensor`, viewed flat in its dtype."""
        slot = self.writer.take_slot()
        return slot, self.buffers[slot][: tensor.nbytes].view(tensor.dtype)

    def put(self, tensor: OutTensor, slot: int) -> None:
        s, k = self.where[tensor.name]
        if k == 0:
            self.writer.open(self.out_dir / self.names[s], shard_header(self.plan[s], self.metadata))
        self.writer.write(slot, as_bytes(self.buffers[slot][: tensor.nbytes]))
        self.weight_map[tensor.name] = self.names[s]
        self.total_bytes += tensor.nbytes
        self.total_params += tensor.numel
        if k == len(self.plan[s]) - 1:
            self.closed[self.names[s]] = self.writer.close()

    def finish(self) -> dict:
        """Wait for the writes; write the index when there are several shards. Returns the record:
        tensors, parameters, bytes, files (bytes and sha256 of each)."""
        self.writer.finish()
        files = {}
        for name, future in self.closed.items():
            size, digest = future.result()
            os.chmod(self.out_dir / name, 0o644)
            files[name] = {"bytes": size, "sha256": digest}
        if len(self.plan) > 1:
            index = {
                "metadata": {"total_parameters": self.total_params, "total_size": self.total_bytes},
                "weight_map": dict(sorted(self.weight_map.items())),
            }
            write_json(self.out_dir / INDEX_FILE, index)
        return {
            "tensors": len(self.weight_map),
            "parameters": self.total_params,
            "bytes": self.total_bytes,
            "files": files,
        }

    def shutdown(self) -> None:
        self.writer.shutdown()
