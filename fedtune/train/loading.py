"""Starting weights loaded once, not once per rank: the model is built on the meta device (no memory),
sharded by the backend, materialised shard by shard on its device, and filled from the safetensors files,
which only rank 0 reads, a few rows at a time, broadcasting them to every rank, which keeps the rows of
its shard (what `set_model_state_dict(..., broadcast_from_rank0=True)` does for torchtune, but through
one reused buffer instead of a whole tensor per rank).

    backend = load_backend(init, options, job, accumulation, task=..., allow_pickle=...)

Host memory of a node while loading: each rank's shards (one fp32 copy of the model over the node's
ranks on CPU; nothing on the host with GPUs) plus a 16 MiB buffer per rank, instead of every rank's
whole fp32 model. Reading on global rank 0 rather than on each node's local rank 0 is what
broadcast_from_rank0 offers, and it is less host memory still (ranks on other nodes receive their parts
over the network).

DeepSpeed ZeRO-3 loads under `deepspeed.zero.Init` instead (Hugging Face's integration: an
`HfDeepSpeedConfig` alive during `from_pretrained`): each parameter is partitioned as it is created, and
the weights are copied in one module at a time, gathered and filled from rank 0's read of the files.

Modes that keep a whole replica per rank anyway (sharding none, DeepSpeed ZeRO-0/1/2) and folders with
only pickle weights take the per-rank path (`load_model` + `backends.build`), as do adapters (peft wraps
the loaded model). benchmarks/loading_memory.py measures both paths (benchmarks/old_paths brings back
the per-rank one for every mode)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fedtune.core.safetensors_stream import ST_DTYPES, read_header
from fedtune.train.options import TrainOptions

if TYPE_CHECKING:  # backends imports torch.distributed's modules; loaded when a backend is built
    from fedtune.train.backends import Backend

META_SHARDINGS = ("full", "hybrid", "hybrid_zero2")


def loads_once(options: TrainOptions, model_dir: Path, allow_pickle: bool) -> bool:
    """Whether `load_backend` takes the meta-device path for these options and this folder."""
    from fedtune.core.models import weight_files

    if options.adapter:
        return False  # peft swaps the adapted layers of a loaded model; the meta path builds none
    if not weight_files(model_dir):
        return False  # pickle weights only (allow_pickle): from_pretrained reads them
    if ties_embeddings(model_dir):
        # A tied output layer (GPT-2) is one tensor under two names; materialised from the meta device
        # they come apart, and the head would keep uninitialised memory.
        return False
    return options.fsdp and options.sharding in META_SHARDINGS


def zero_init(options: TrainOptions) -> bool:
    """Whether `load_backend` creates the model partitioned (DeepSpeed ZeRO-3's zero.Init)."""
    return (
        options.backend == "deepspeed"
        and options.zero_stage == 3
        and not options.adapter  # peft wraps a loaded model: the per-rank path (not tried under zero.Init)
    )


def ties_embeddings(model_dir: Path) -> bool:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return bool(getattr(config.get_text_config(), "tie_word_embeddings", False))


def load_backend(
    model_dir, options: TrainOptions, job, accumulation: int, *, task: str, allow_pickle: bool = False
) -> Backend:
    """The backend of fedtune.train.backends, holding the starting weights of `model_dir` in fp32."""
    model_dir = Path(model_dir)
    # Both paths leave the random generators as they found them: the first steps (dropout) then do not
    # depend on how the weights were loaded.
    rng = torch.get_rng_state()
    try:
        return _load_backend(model_dir, options, job, accumulation, task=task, allow_pickle=allow_pickle)
    finally:
        torch.set_rng_state(rng)


def _load_backend(
    model_dir: Path, options: TrainOptions, job, accumulation: int, *, task: str, allow_pickle: bool
):
    from fedtune.core.models import load_model
    from fedtune.train import backends

    if zero_init(options):
        return _load_zero3(model_dir, options, job, accumulation, task=task, allow_pickle=allow_pickle)
    if not loads_once(options, model_dir, allow_pickle):
        if options.adapter and options.adapter.quantized:
            from fedtune.core import adapters

            model = adapters.load_quantized(
                model_dir, task=task, device=job.device, allow_pickle=allow_pickle
            )
            return backends.build(adapters.wrap(model, options.adapter, task), options, job, accumulation)
        # One process per node hashes the starting weights; the others would only read them again.
        model = load_model(
            model_dir, task=task, dtype="float32", allow_pickle=allow_pickle, verify=job.local_rank == 0
        )
        model.config.use_cache = False
        if options.adapter:
            from fedtune.core import adapters

            model = adapters.wrap(model, options.adapter, task)
        return backends.build(model, options, job, accumulation)

    model = empty_model(model_dir, task=task, verify=job.local_rank == 0)
    buffers = {name: value.clone() for name, value in model.named_buffers()}
    backend = backends.build(model, options, job, accumulation)
    backend.model.to_empty(device=job.device)
    # Buffers are not in the checkpoint when they are computed (rotary frequencies): restore them.
    for name, value in buffers.items():
        backend.model.get_buffer(name).copy_(value)
    fill_from_rank0(backend.model, model_dir, job)
    # The optimizer (and FedProx's start weights) were made from the meta parameters: make them again.
    backend.weights_loaded(options)
    return backend


def _load_zero3(
    model_dir: Path, options: TrainOptions, job, accumulation: int, *, task: str, allow_pickle: bool
):
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from fedtune.core.models import load_model
    from fedtune.train import backends

    # from_pretrained finds the config through a weak reference: it must stay referenced until the
    # model is loaded, and must be gone after, or later loads (the export's) would be partitioned too.
    # Without train_batch_size: DeepSpeed checks it against its own process group, not started yet
    # (deepspeed.initialize starts it); it derives the same batch from the micro batch and accumulation.
    ds_config = backends.deepspeed_config(options, accumulation, job.device)
    config = HfDeepSpeedConfig({k: v for k, v in ds_config.items() if k != "train_batch_size"})
    try:
        model = load_model(
            model_dir, task=task, dtype="float32", allow_pickle=allow_pickle, verify=job.local_rank == 0
        )
    finally:
        unset_hf_deepspeed_config()
        del config
    model.config.use_cache = False
    if job.is_main:
        # What this rank holds of the model: its partitions (ds_tensor), not the whole (ds_numel).
        held = sum(p.ds_tensor.numel() for p in model.parameters()) / sum(
            p.ds_numel for p in model.parameters()
        )
        print(
            f"loading: partitioned while created (deepspeed.zero.Init), {held:.3f} of it on rank 0",
            flush=True,
        )
    return backends.build(model, options, job, accumulation)


def empty_model(model_dir: Path, *, task: str, verify: bool):
    """The model of `model_dir` with its parameters on the meta device and its buffers on the CPU."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    from fedtune.core.models import auto_class, check_loadable

    check_loadable(model_dir, task=task, verify=verify)
    config = AutoConfig.from_pretrained(model_dir)
    config.use_cache = False
    with init_empty_weights(include_buffers=False):
        model = auto_class(task).from_config(config, dtype=torch.float32)
    return model


def tensor_index(model_dir: Path) -> dict[str, tuple[Path, int, str, list[int], int]]:
    """Every tensor of the folder's safetensors files: name -> (file, byte offset, dtype, shape, bytes)."""
    from fedtune.core.models import weight_files

    index = {}
    for path in weight_files(model_dir):
        header = read_header(path)
        start = header.pop("_data_start")
        for name, info in header.items():
            begin, end = info["data_offsets"]
            index[name] = (path, start + begin, info["dtype"], info["shape"], end - begin)
    return index


def read_tensor(entry) -> torch.Tensor:
    """One tensor read with plain file reads: private memory for this tensor only, no memory map
    whose pages would stay resident in this process."""
    path, offset, dtype, shape, nbytes = entry
    with open(path, "rb") as stream:
        return _read_bytes(stream, path, offset, nbytes).view(ST_DTYPES[dtype]).reshape(shape)


def _read_bytes(stream, path: Path, offset: int, nbytes: int) -> torch.Tensor:
    data = torch.empty(nbytes, dtype=torch.uint8)
    stream.seek(offset)
    if stream.readinto(memoryview(data.numpy())) != nbytes:
        raise OSError(f"{path}: truncated tensor data")
    return data


# Bytes broadcast at a time while filling the shards. Each rank holds one buffer of this size for the
# whole load, whatever the model: receiving whole tensors (the embedding is a third of a small model)
# put one transient copy per rank on the node, and glibc kept those freed buffers in its heap.
FILL_CHUNK_BYTES = 16 << 20


def fill_from_rank0(model, model_dir: Path, job) -> None:
    """Copy the folder's weights into the sharded, materialised `model`: rank 0 reads each tensor a
    few rows at a time (FILL_CHUNK_BYTES) and broadcasts them into one reused buffer; every rank copies
    the rows of its own shard (collective). Parameters sharded other than along their first dimension
    go through `set_model_state_dict(..., broadcast_from_rank0=True)` whole."""
    import torch.distributed as dist

    from fedtune.core.models import ModelError

    state = model.state_dict()  # sharded DTensors and plain tensors, sharing the parameters' storage
    plan, index = None, {}
    if job.rank == 0:
        index = tensor_index(model_dir)
        tied = _tied_names(model)
        missing = sorted(set(state) - set(index) - tied)
        names = [name for name in index if name in state]
        wrong = [
            f"{name} {list(index[name][3])} (the model has {list(state[name].shape)})"
            for name in names
            if list(index[name][3]) != list(state[name].shape)
        ]
        plan = {"missing": missing, "wrong": wrong, "names": names}
    shared = [plan]
    dist.broadcast_object_list(shared, src=0)
    plan = shared[0]
    if plan["missing"]:
        raise ModelError(f"{model_dir}: the weights lack {', '.join(plan['missing'][:5])}")
    if plan["wrong"]:
        raise ModelError(f"{model_dir}: tensors of the wrong shape: {'; '.join(plan['wrong'][:5])}")
    buffer = torch.empty(FILL_CHUNK_BYTES, dtype=torch.uint8, device=job.device)
    with torch.no_grad():
        for name in plan["names"]:
            target = state[name]
            rows = _row_part(target)
            if rows is None:
                _fill_whole(model, name, index[name] if job.rank == 0 else None)
                continue
            buffer = _fill_rows(target, rows, buffer, index[name] if job.rank == 0 else None)


def _row_part(target):
    """(this rank's local tensor, its first row in the whole tensor) when the tensor is whole or split
    along its first dimension only; None otherwise."""
    from torch.distributed.tensor import DTensor

    if not isinstance(target, DTensor):
        return target, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    if list(shape[1:]) != list(target.shape[1:]) or any(offset[1:]):
        return None
    return target.to_local(), offset[0] if offset else 0


def _fill_rows(target, rows, buffer, entry):
    """Broadcast `target`'s rows from rank 0's file in chunks; keep the rows of this rank's part."""
    import torch.distributed as dist

    local, first = rows
    whole = target.shape
    count = whole[0] if len(whole) else 1
    row_numel = target.numel() // count if count else 0
    if row_numel == 0:
        return buffer
    itemsize = target.element_size()
    per_chunk = max(1, FILL_CHUNK_BYTES // (row_numel * itemsize))
    if per_chunk * row_numel * itemsize > buffer.numel():  # one row above the chunk size
        buffer = torch.empty(per_chunk * row_numel * itemsize, dtype=torch.uint8, device=buffer.device)
    held = local.reshape(1, *local.shape) if local.dim() == 0 else local
    stream = open(entry[0], "rb") if entry is not None else None
    try:
        for start in range(0, count, per_chunk):
            stop = min(count, start + per_chunk)
            chunk = buffer[: (stop - start) * row_numel * itemsize].view(target.dtype)
            if stream is not None:
                chunk.copy_(_read_rows(stream, entry, start, stop, row_numel))  # cast to the model's dtype
            dist.broadcast(chunk, src=0)
            low, high = max(start, first), min(stop, first + held.shape[0])
            if low < high:
                part = chunk.view(stop - start, *held.shape[1:])[low - start : high - start]
                held[low - first : high - first].copy_(part)
    finally:
        if stream is not None:
            stream.close()
    return buffer


def _read_rows(stream, entry, start: int, stop: int, row_numel: int) -> torch.Tensor:
    path, offset, dtype, _, _ = entry
    kind = ST_DTYPES[dtype]
    row_bytes = row_numel * kind.itemsize
    return _read_bytes(stream, path, offset + start * row_bytes, (stop - start) * row_bytes).view(kind)


def _fill_whole(model, name: str, entry) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    # Cast on rank 0 before the broadcast: the receivers allocate what rank 0 announces.
    part = {name: _as_fp32(read_tensor(entry))} if entry is not None else {}
    set_model_state_dict(model, part, options=options)


def _as_fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.float32) if tensor.is_floating_point() else tensor


def _tied_names(model) -> set[str]:
    """Names of parameters that share storage with an earlier one (a tied head), absent from files."""
    keys = getattr(model, "_tied_weights_keys", None) or {}
    return set(keys) if isinstance(keys, dict) else set(keys)
