"""Merge the site models of a round into one model, streaming tensor by tensor: the CLI, the checks
that the sites line up, the weights, the server optimizer's state, and the provenance record
(aggregate.json).

Nothing here loads a whole model: fedtune.core.safetensors_stream reads and writes tensor by tensor, and each
tensor goes through a merge method of fedtune.aggregate.methods and a server optimizer of
fedtune.aggregate.server_optimizers. Private memory therefore stays near a few copies of the largest tensor in
fp32, whatever the model size, so a 7B merge fits on a login node.

Before any of that, every site must agree on tensor names, shapes and dtypes, on the model config and on
the tokenizer (fedtune.aggregate.model_compat lists every difference)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from fedtune.aggregate.methods import CHUNK, METHODS, RESCALES, weighted_mean
from fedtune.aggregate.model_compat import CONFIG_FILE, COPIED_FILES, compatibility_problems
from fedtune.aggregate.server_optimizers import ServerOptimizer, step
from fedtune.core import offline
from fedtune.core.atomic import atomic_dir, write_json
from fedtune.core.checksums import sha256_file
from fedtune.core.config import ConfigError, UserError, check_weights, torch_dtype
from fedtune.core.models import record_checksums, verify_checksums
from fedtune.core.safetensors_stream import (
    ST_DTYPES,
    FolderReader,
    OutTensor,
    ShardedOutput,
    WeightFolder,
    WeightsError,
    file_order,
    listing,
    plan_shards,
    read_weights,
)

OUTPUT_DTYPES = ("float32", "bfloat16", "float16", "auto")


class AggregateError(WeightsError):
    """Inputs that cannot be merged or bad options: the message names the site and what differs."""


SiteModel = WeightFolder


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
        bad = {s: v for s, v in spec.items() if not isinstance(v, int | float) or isinstance(v, bool)}
        if bad:
            raise AggregateError(f"--weights: weights must be numbers; got {bad}")
        try:
            check_weights(spec, sites, "--weights")
        except ConfigError as e:
            raise AggregateError(str(e)) from None
        source, raw = "explicit", {site: spec[site] for site in sites}
    negative = {site: w for site, w in raw.items() if w < 0}
    if negative:
        raise AggregateError(f"--weights ({source}): negative weights {negative}")
    if sum(raw.values()) <= 0:
        raise AggregateError(f"--weights ({source}): the weights sum to zero ({raw})")
    return source, raw


# ---------------------------------------------------------------------------------------------------
# Reading the inputs' metadata


def read_site_model(site: str, path: Path, label: str | None = None) -> SiteModel:
    path = Path(path)
    label = label or f"site {site}"
    if not path.is_dir():
        raise AggregateError(f"{label}: model folder not found: {path}")
    if not (path / CONFIG_FILE).is_file():
        raise AggregateError(f"{label}: {path} has no config.json (not a save_pretrained folder)")
    model = read_weights(site, path, label)
    files = model.files
    for name in COPIED_FILES:
        if (path / name).is_file():
            files[name] = (path / name).stat().st_size
    return model


# ---------------------------------------------------------------------------------------------------
# Planning the outputs


def plan_output(ref: SiteModel, dtype: str, max_shard_size: int) -> list[list[OutTensor]]:
    """Output tensors grouped into shards, in the first site's file order (sequential reads)."""
    tensors = []
    for name in file_order(ref):
        info = ref.tensors[name]
        in_dtype = ST_DTYPES[info.dtype]
        out_dtype = in_dtype if dtype == "auto" or not in_dtype.is_floating_point else torch_dtype(dtype)
        tensors.append(OutTensor(name, out_dtype, info.shape, info.numel))
    return plan_shards(tensors, max_shard_size)


def plan_state(
    order: Sequence[OutTensor], slots: Sequence[str], max_shard_size: int
) -> list[list[OutTensor]]:
    """The server state's tensors (`<slot>.<name>`, fp32) in the order the merge visits the model's."""
    tensors = [
        OutTensor(f"{slot}.{t.name}", torch.float32, t.shape, t.numel)
        for t in order
        if t.dtype.is_floating_point
        for slot in slots
    ]
    return plan_shards(tensors, max_shard_size) if tensors else []


STATE_RECORD = "state.json"


def read_server_state(path: Path, optimizer: ServerOptimizer, order: Sequence[OutTensor]):
    """(record, folder or None) of a previous round's server state, checked against this round."""
    path = Path(path)
    record_path = path / STATE_RECORD
    if not record_path.is_file():
        raise AggregateError(f"--server-state-in: {record_path} not found (not a server state folder)")
    record = json.loads(record_path.read_text(encoding="utf-8"))
    written_by = record.get("optimizer", {}).get("name")
    if written_by != optimizer.name:
        raise AggregateError(
            f"--server-state-in: {path} was written by server optimizer {written_by!r}, not {optimizer.name!r}"
        )
    if not optimizer.slots:
        return record, None
    folder = read_weights("server state", path, f"the server state {path}")
    problems = []
    for t in order:
        if not t.dtype.is_floating_point:
            continue
        for slot in optimizer.slots:
            info = folder.tensors.get(f"{slot}.{t.name}")
            if info is None:
                problems.append(f"{slot}.{t.name} missing")
            elif info.dtype != "F32" or info.shape != t.shape:
                problems.append(
                    f"{slot}.{t.name} {info.dtype} {list(info.shape)}, expected F32 {list(t.shape)}"
                )
    if problems:
        raise AggregateError(f"--server-state-in: {path} does not fit this model: {listing(problems)}")
    return record, folder


def check_compatible(models: Sequence[SiteModel], start: SiteModel | None = None) -> None:
    """Raise AggregateError listing every way a site (or the start model) differs from the first site."""
    problems = compatibility_problems(models, start)
    if problems:
        raise AggregateError("the site models cannot be merged:\n  " + "\n  ".join(problems))


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


# ---------------------------------------------------------------------------------------------------
# The merge


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
    start: str | Path | None = None,
    lam: float = 1.0,
    density: float = 1.0,
    seed: int = 0,
    rescale: str = "l1",
    server_optimizer: ServerOptimizer | Mapping | None = None,
    server_state_in: str | Path | None = None,
    server_state_out: str | Path | None = None,
) -> dict:
    """Merge the site models `models` (site -> model folder) into `out_dir`; returns aggregate.json.

    `start` is the model the round started from: the base of the task vectors and of the server
    optimizer's step (not read for fedavg with sgd at lr 1, which is the plain weighted mean). The
    server optimizer's state is read from `server_state_in` (none in the first round) and written to
    `server_state_out`. Every check (options, weights, compatibility) runs before the first byte is
    written."""
    started = time.perf_counter()
    if method not in METHODS:
        raise AggregateError(f"--method: {method!r} is not one of {', '.join(METHODS)}")
    if dtype not in OUTPUT_DTYPES:
        raise AggregateError(f"--dtype: {dtype!r} is not one of {', '.join(OUTPUT_DTYPES)}")
    if rescale not in RESCALES:
        raise AggregateError(f"--rescale: {rescale!r} is not one of {', '.join(RESCALES)}")
    if not 0 < density <= 1:
        raise AggregateError(f"--density: {density} is not in (0, 1]")
    try:
        optimizer = (
            server_optimizer
            if isinstance(server_optimizer, ServerOptimizer)
            else ServerOptimizer.from_dict(dict(server_optimizer or {}))
        )
        optimizer.check()
    except (TypeError, ValueError) as e:
        raise AggregateError(f"--server-optimizer: {e}") from None
    plain = method == "fedavg" and optimizer.plain
    if not plain and start is None:
        raise AggregateError(
            f"--start (the model the round started from) is needed for method {method} with server "
            f"optimizer {optimizer.name} at lr {optimizer.lr}"
        )
    if optimizer.slots and server_state_out is None:
        raise AggregateError(f"--server-state-out is needed: {optimizer.name} keeps a state between rounds")
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
    start_model = None
    if not plain:
        start_model = read_site_model("start", Path(start), f"the start model {start}")
    check_compatible(site_models, start_model)

    ref = site_models[0]
    plan = plan_output(ref, dtype, shard_limit)
    order = [t for shard in plan for t in shard]
    state_record, state_folder = (None, None)
    if server_state_in is not None:
        state_record, state_folder = read_server_state(Path(server_state_in), optimizer, order)
    round_step = (state_record or {}).get("step", 0) + 1
    state_plan = plan_state(order, optimizer.slots, shard_limit)
    n_weights = [normalised[m.site] for m in site_models]
    params = {"lambda": lam, "density": density, "seed": seed, "rescale": rescale}
    _log(
        f"{method} of {len(sites)} sites ({source} weights "
        + ", ".join(f"{s}={normalised[s]:.4f}" for s in sites)
        + f"), server optimizer {optimizer.name} (step {round_step}): "
        + f"{len(order)} tensors into {len(plan)} shard(s)"
    )
    out_dir = Path(out_dir)
    with contextlib.ExitStack() as outputs:
        tmp = outputs.enter_context(atomic_dir(out_dir))
        state_tmp = outputs.enter_context(atomic_dir(Path(server_state_out))) if server_state_out else None
        folders = [
            *site_models,
            *([start_model] if start_model else []),
            *([state_folder] if state_folder else []),
        ]
        streamed = _write_merged(
            tmp,
            state_tmp,
            plan,
            state_plan,
            folders,
            n_weights,
            method=method,
            params=params,
            optimizer=optimizer,
            sites=len(site_models),
            checksums=checksums,
        )
        output, state_output, digests = streamed
        _copy_support_files(ref, tmp, dtype)
        inputs = [_input_record(i, m, digests, checksums) for i, m in enumerate(site_models)]
        for entry, m in zip(inputs, site_models, strict=True):
            entry.update(
                {
                    "site": m.site,
                    "manifest": str(m.manifest) if m.manifest else None,
                    "tokens_kept": m.tokens,
                }
            )
        extra = [*([start_model] if start_model else []), *([state_folder] if state_folder else [])]
        extra_records = [
            _input_record(len(site_models) + k, f, digests, checksums) for k, f in enumerate(extra)
        ]
        if checksums:
            # Inputs were hashed while being read: compare with what their writers recorded, for free.
            for entry, m in zip([*inputs, *extra_records], [*site_models, *extra], strict=True):
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
        }
        if not plain:
            record["parameters"] = params
            record["start"] = extra_records[0]
            record["server_optimizer"] = {**optimizer.as_dict(), "step": round_step}
        if state_folder is not None:
            record["server_state_in"] = extra_records[-1]
        elif server_state_in is not None:
            record["server_state_in"] = {"model_dir": str(server_state_in)}
        if state_tmp is not None:
            state = {"optimizer": optimizer.as_dict(), "step": round_step, "output": state_output}
            if checksums:
                record_checksums(state_tmp, {n: f["sha256"] for n, f in state_output["files"].items()})
            write_json(state_tmp / STATE_RECORD, state)
            record["server_state_out"] = {"dir": str(server_state_out), **state}
        record["wall_time_s"] = round(time.perf_counter() - started, 3)
        write_json(tmp / "aggregate.json", record)
    _log(f"done in {record['wall_time_s']:.1f} s: {out_dir}")
    return record


def _input_record(i: int, m: WeightFolder, digests: dict, checksums: bool) -> dict:
    files = {}
    for name, size in m.files.items():
        digest = digests.get((i, name)) if name in m.weight_files else None
        if checksums and digest is None:
            digest = sha256_file(m.path / name)
        files[name] = {"bytes": size, "sha256": digest}
    return {
        "model_dir": str(m.path),
        "sharded": m.sharded,
        "bytes": sum(m.files[f] for f in m.weight_files),
        "files": files,
    }


def _identical_inputs(inputs: Sequence[dict], models: Sequence[SiteModel]) -> list[str]:
    warnings = []
    seen: dict[tuple, str] = {}
    for entry, m in zip(inputs, models, strict=True):
        key = tuple(entry["files"][f]["sha256"] for f in m.weight_files)
        if key in seen:
            warnings.append(f"sites {seen[key]} and {m.site} have identical weights")
        seen.setdefault(key, m.site)
    return warnings


def _write_merged(
    out_dir: Path,
    state_dir: Path | None,
    plan: Sequence[Sequence[OutTensor]],
    state_plan: Sequence[Sequence[OutTensor]],
    folders: Sequence[WeightFolder],
    weights: Sequence[float],
    *,
    method: str,
    params: dict,
    optimizer: ServerOptimizer,
    sites: int,
    checksums: bool,
) -> tuple[dict, dict | None, dict[tuple[int, str], str]]:
    """Stream every tensor through the merge method and the server optimizer into the output (and the
    new server state). folders: the sites, then the start model (unless the merge is the plain
    weighted mean), then the previous server state (if any). Returns the output's record, the state's
    record and the sha256 of every input file (empty without checksums)."""
    order = [t for shard in plan for t in shard]
    plain = len(folders) == sites
    start_i = sites if not plain else None
    state_i = sites + 1 if len(folders) > sites + 1 else None
    slots = optimizer.slots
    reads = []
    for i in range(len(folders)):
        if i == state_i:
            reads.append(
                [[f"{s}.{t.name}" for s in slots] if t.dtype.is_floating_point else [] for t in order]
            )
        else:
            reads.append([[t.name] for t in order])
    largest = max(t.numel for t in order)
    fedavg = method == "fedavg"
    # Elementwise work goes chunk by chunk (merge_methods.CHUNK entries), so that the dozen passes of a
    # merge and a server step run on cache-resident data and read each input once; only TIES's
    # selection needs a whole task vector, kept in `task`.
    chunk = min(largest, CHUNK)
    acc, scratch, base_f = (torch.empty(chunk) for _ in range(3))
    task = torch.empty(largest) if method == "ties" else None
    merge = METHODS[method]
    with contextlib.ExitStack() as stack:
        # One intra-op thread: the work is a long series of small kernels, each of which would otherwise
        # split over every core and wait for all of them at its end. On a shared machine a busy core
        # makes every such barrier slow (TIES's sampled bracket took 0.9 s instead of milliseconds at
        # load 7 on 2 cores), and the reader and writer threads already use a second core.
        stack.callback(torch.set_num_threads, torch.get_num_threads())
        torch.set_num_threads(1)
        reader = FolderReader(folders, reads, checksums)
        stack.callback(reader.shutdown)
        output = ShardedOutput(out_dir, plan, checksums)
        stack.callback(output.shutdown)
        state = None
        if state_dir is not None and state_plan:
            state = ShardedOutput(state_dir, state_plan, checksums, metadata={"optimizer": optimizer.name})
            stack.callback(state.shutdown)
        shard_started = time.perf_counter()
        for k, tensor in enumerate(order):
            reader.reached(k)
            sources = [reader.get(i, tensor.name) for i in range(sites)]
            slot, result = output.slot(tensor)
            n = tensor.numel
            if not sources[0].dtype.is_floating_point:
                _check_identical(tensor.name, sources, [f.site for f in folders[:sites]])
                result.copy_(sources[0])
            elif plain:
                for lo in range(0, n, CHUNK):
                    hi = min(n, lo + CHUNK)
                    part = [src[lo:hi] for src in sources]
                    result[lo:hi].copy_(weighted_mean(part, weights, acc[: hi - lo], scratch[: hi - lo]))
            else:
                base = reader.get(start_i, tensor.name)
                whole = None
                if method == "ties":
                    whole = merge(base, sources, weights, {**params, "name": tensor.name}, task[:n])
                elif not fedavg:
                    whole = merge(base, sources, weights, {**params, "name": tensor.name})
                old = {s: reader.get(state_i, f"{s}.{tensor.name}") if state_i else None for s in slots}
                taken = {s: state.slot(_state_tensor(s, tensor)) for s in slots}
                for lo in range(0, n, CHUNK):
                    hi = min(n, lo + CHUNK)
                    # fp32 + fp16 rounds the same as fp32 + fp32 of the converted value, but torch's
                    # mixed-dtype kernels are several times slower: convert once per chunk.
                    base_part = base_f[: hi - lo].copy_(base[lo:hi])
                    if fedavg:
                        part = [src[lo:hi] for src in sources]
                        delta = merge(base_part, part, weights, params, acc[: hi - lo], scratch[: hi - lo])
                    else:
                        delta = whole[lo:hi]
                    update = step(
                        optimizer,
                        delta,
                        {s: None if o is None else o[lo:hi] for s, o in old.items()},
                        {s: buf[lo:hi] for s, (_, buf) in taken.items()},
                    )
                    result[lo:hi].copy_(update.add_(base_part))
                for s, (state_slot, _) in taken.items():
                    state.put(_state_tensor(s, tensor), state_slot)
            output.put(tensor, slot)
            if output.where[tensor.name][1] == len(plan[output.where[tensor.name][0]]) - 1:
                shard = output.names[output.where[tensor.name][0]]
                _log(f"shard {shard}: merged in {time.perf_counter() - shard_started:.1f} s")
                shard_started = time.perf_counter()
        record = output.finish()
        state_record = state.finish() if state is not None else None
        if state_dir is not None and state is None:
            state_record = {"tensors": 0, "parameters": 0, "bytes": 0, "files": {}}
        digests = reader.digests()
    return record, state_record, digests


def _state_tensor(slot: str, tensor: OutTensor) -> OutTensor:
    return OutTensor(f"{slot}.{tensor.name}", torch.float32, tensor.shape, tensor.numel)


def _check_identical(name: str, sources: Sequence[torch.Tensor], sites: Sequence[str]) -> None:
    """Integer buffers (position ids, masks) cannot be averaged; they must simply agree."""
    for site, src in zip(sites[1:], sources[1:], strict=True):
        if not torch.equal(src, sources[0]):
            raise AggregateError(
                f"tensor {name} ({sources[0].dtype}) differs between site {sites[0]} and "
                f"site {site}; non-float tensors must be identical"
            )


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
    parser.add_argument("--method", default="fedavg", choices=list(METHODS))
    parser.add_argument(
        "--start",
        default=None,
        metavar="DIR",
        help="the model the round started from: base of the task vectors and of the server step"
        " (not needed for fedavg with sgd at lr 1)",
    )
    parser.add_argument(
        "--lambda", dest="lam", type=float, default=1.0, help="scale of the merged task vector"
    )
    parser.add_argument(
        "--density", type=float, default=1.0, help="share of each task vector kept (ties, dare_*)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of DARE's random masks")
    parser.add_argument(
        "--rescale",
        default="l1",
        choices=list(RESCALES),
        help="DARE's rescaling of kept entries: l1 (mergekit's) or density (1/density, the DARE paper)",
    )
    parser.add_argument(
        "--server-optimizer",
        default="{}",
        help='JSON: {"name": sgd|fedavgm|fedadam|fedyogi|fedadagrad, "lr", "momentum", "betas", "tau"}',
    )
    parser.add_argument("--server-state-in", default=None, metavar="DIR", help="the previous round's state")
    parser.add_argument(
        "--server-state-out", default=None, metavar="DIR", help="folder of this round's state"
    )
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
        try:
            server_optimizer = json.loads(args.server_optimizer)
        except json.JSONDecodeError as e:
            raise AggregateError(f"--server-optimizer: not valid JSON: {e}") from None
        if not isinstance(server_optimizer, dict):
            raise AggregateError("--server-optimizer: must be a JSON object")
        aggregate(
            parse_pairs(args.model, "--model"),
            args.out,
            method=args.method,
            weights=args.weights,
            manifests=parse_pairs(args.manifest, "--manifest"),
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            checksums=not args.no_checksums,
            start=args.start,
            lam=args.lam,
            density=args.density,
            seed=args.seed,
            rescale=args.rescale,
            server_optimizer=server_optimizer,
            server_state_in=args.server_state_in,
            server_state_out=args.server_state_out,
        )
    except UserError as e:
        print(f"aggregate: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
