"""Merge the site models of a round into one model, streaming tensor by tensor: the CLI, the checks
that the sites line up, the weights, the server optimizer's state, and the provenance record
(aggregate.json).

Nothing here loads a whole model: fedtune.core.safetensors_stream reads and writes tensor by tensor, and each
tensor goes through a merge method of fedtune.aggregate.methods and a server optimizer of
fedtune.aggregate.server_optimizers. Private memory therefore stays near a few copies of the largest tensor in
fp32, whatever the model size, so a 7B merge fits on a login node.

Before any of that, every site must agree on tensor names, shapes and dtypes, on the model config and on
the tokenizer (fedtune.aggregate.model_compat lists every difference). The settings arrive as one
AggregateOptions (`--options`), checked when it was made (fedtune.run.config); this module checks only
what the options need of the other arguments (a start model, a state folder, the sites' weights)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fedtune.aggregate.methods import CHUNK, MergeMethod, chunks, fedavg_rows, merge_method, weighted_mean
from fedtune.aggregate.model_compat import CONFIG_FILE, COPIED_FILES, compatibility_problems
from fedtune.aggregate.options import AggregateOptions, ServerOptimizerOptions
from fedtune.aggregate.server_optimizers import fedexp_scale, slots, step
from fedtune.core import cli, exchange, token_counts
from fedtune.core.atomic import atomic_dir, write_json
from fedtune.core.checksums import SOURCE_RECORD, sha256_file
from fedtune.core.models import record_checksums, verify_checksums
from fedtune.core.options import ConfigError, UserError, check_weights, torch_dtype
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
from fedtune.tokenize.blocks import manifest_tokens


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


def resolve_weights(
    spec: str | Mapping[str, float],
    sites: Sequence[str],
    tokens: Mapping[str, int | None],
    *,
    error: type[UserError] = AggregateError,
) -> tuple[str, dict[str, float]]:
    """(source, raw weight per site) from aggregate.weights: tokens (the sites' manifests), uniform, or
    a mapping site -> number. Raises `error` (the calling stage's) naming what is wrong."""
    if spec == "uniform":
        return "uniform", {site: 1.0 for site in sites}
    if spec == "tokens":
        missing = [site for site in sites if tokens.get(site) is None]
        if missing:
            raise error(f"weights tokens needs --manifest SITE=PATH for every site; missing: {missing}")
        return "tokens", _positive({site: tokens[site] for site in sites}, "tokens", error)
    if isinstance(spec, str):
        raise error(f"weights: {spec!r} is neither tokens, uniform nor a mapping site -> number")
    bad = {s: v for s, v in spec.items() if not _finite_non_negative(v)}
    if bad:
        raise error(f"weights: {bad} are not finite non-negative numbers")
    try:
        check_weights(spec, sites, "weights")
    except ConfigError as e:
        raise error(str(e)) from None
    return "explicit", {site: spec[site] for site in sites}


def _finite_non_negative(value) -> bool:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and math.isfinite(value) and value >= 0


def _positive(raw: dict[str, float], source: str, error: type[UserError]) -> dict[str, float]:
    if sum(raw.values()) <= 0:
        raise error(f"weights ({source}): the weights sum to zero ({raw})")
    return raw


def normalised(raw: Mapping[str, float]) -> dict[str, float]:
    total = float(sum(raw.values()))
    return {site: w / total for site, w in raw.items()}


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


def read_site_update(site: str, path: Path, start: str | Path) -> SiteModel:
    """A site's compressed update (federation.exchange) as the merge sees a site model: the model's
    tensor table from the update's header, over the update's own files (whose parts the stream reads and
    hashes); refused, before a byte is decoded, when it was taken against another start model."""
    label = f"site {site}"
    header = exchange.read_header(path, label)
    exchange.check_start(header, start, label, path)
    parts = read_site_model(site, path, label)
    exchange.check_parts(header, parts.tensors, label, path)
    view = {
        name: dataclasses.replace(parts.tensors[name], dtype=entry.dtype, shape=entry.shape)
        for name, entry in header.tensors.items()
    }
    return dataclasses.replace(parts, tensors=view, update=(header, parts))


def _suffixes(entry: exchange.TensorEntry) -> list[str]:
    return ["", exchange.SCALE] if entry.encoding.kind in exchange.INT_MAX else [""]


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


def read_state_record(path: Path, optimizer: ServerOptimizerOptions, error: type[UserError]) -> dict:
    """The record of a previous round's server state folder (whole models' or adapters'), which the
    same server optimizer must have written."""
    record_path = path / STATE_RECORD
    if not record_path.is_file():
        raise error(f"--server-state-in: {record_path} not found (not a server state folder)")
    record = json.loads(record_path.read_text(encoding="utf-8"))
    written_by = record.get("optimizer", {}).get("name")
    if written_by != optimizer.name:
        raise error(
            f"--server-state-in: {path} was written by server optimizer {written_by!r}, not {optimizer.name!r}"
        )
    return record


def read_server_state(path: Path, optimizer: ServerOptimizerOptions, order: Sequence[OutTensor]):
    """(record, folder or None) of a previous round's server state, checked against this round."""
    path = Path(path)
    record = read_state_record(path, optimizer, AggregateError)
    if not slots(optimizer):
        return record, None
    folder = read_weights("server state", path, f"the server state {path}")
    problems = []
    for t in order:
        if not t.dtype.is_floating_point:
            continue
        for slot in slots(optimizer):
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


def _base_record(path: Path, key: str | None) -> dict | None:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    record = record.get(key) if key else record
    return record if isinstance(record, dict) and record.get("identity") else None


def check_same_base(models: Mapping[str, str | Path], start: str | Path | None = None) -> None:
    """Refuse sites that trained from different downloads of the base model: each cluster downloads it
    separately, and a branch (model.revision main) may move between two downloads. A site model of round 1
    names the base it started from (training.json's `base`), the start model of round 1 (the downloaded
    base) its own (fedtune-source.json's `identity`, one sha256 of its files). A folder without the record
    (a later round's, or a model trained elsewhere) is not compared."""
    seen: dict[str, dict] = {}
    if start is not None and (record := _base_record(Path(start) / SOURCE_RECORD, None)):
        seen[f"the start model {start}"] = record
    for site, folder in models.items():
        # training.json: the train stage's summary beside the weights (fedtune.train.loop).
        if record := _base_record(Path(folder) / "training.json", "base"):
            seen[f"site {site} ({folder})"] = record
    if len({record["identity"] for record in seen.values()}) < 2:
        return
    (ref, ref_record), *others = seen.items()

    def named(who, record):
        return f"{who}: base {record['identity']} (hub commit {record.get('commit') or 'none recorded'})"

    differing = [named(who, r) for who, r in others if r["identity"] != ref_record["identity"]]
    raise AggregateError(
        "the sites trained from different base models (each cluster downloads it; a branch such as "
        f"`main` may have moved between the downloads): {'; '.join(differing)}; against "
        f"{named(ref, ref_record)}. Pin model.revision to one commit, delete model/base where the base "
        "differs, and run again there"
    )


def _round_label(site_models: Sequence[SiteModel], out_dir: str | Path) -> str:
    """The round in messages: from the output's folder (round-<r>/aggregate/model in a run), else from
    the sites' training.json when they agree, else "this round"."""
    for part in reversed(Path(out_dir).parts):
        if match := re.fullmatch(r"round-(\d+)", part):
            return f"round {int(match.group(1))}"
    rounds = {(_json_file(m.path / "training.json") or {}).get("round") for m in site_models}
    if len(rounds) == 1 and isinstance(next(iter(rounds)), int):
        return f"round {next(iter(rounds))}"
    return "this round"


def _json_file(path: Path) -> dict | None:
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def site_start(folder: str | Path) -> str | None:
    """The identity of the start model a site model trained from, as its training recorded it
    (training.json's `start`, fedtune.train.loop.export); None where the folder records none."""
    record = (_json_file(Path(folder) / "training.json") or {}).get("start")
    identity = record.get("identity") if isinstance(record, dict) else None
    return identity if isinstance(identity, str) else None


def check_same_start(site_models: Sequence[SiteModel], start: str | Path | None, round_label: str) -> None:
    """Refuse a site model trained from another start model than this round's: a stale copy of an
    earlier round or attempt, taken for the current one. Each site model names the start it trained from
    (training.json `start`: fedtune.core.exchange.start_identity of its --init); the round's start is
    the merge's --start. Without --start the sites must agree among themselves. A folder that records
    no start (written by an older fedtune, or trained elsewhere) is not compared."""
    recorded = {m.site: identity for m in site_models if (identity := site_start(m.path)) is not None}
    if not recorded:
        return
    if start is not None:
        expected, what = exchange.start_identity(start)["identity"], f"the round's start model {start}"
    else:
        first, expected = next(iter(recorded.items()))
        what = f"site {first}'s start"
    for site, identity in recorded.items():
        if identity != expected:
            raise AggregateError(
                f"{round_label}: site {site} trained from start model {identity}, but {what} is {expected}: "
                "a stale or foreign copy of the site's model (another round's or attempt's); fetch the "
                "site's model of this round again, or retrain the site from this start"
            )


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


class NonFiniteError(AggregateError):
    """A site's tensor holds NaN or an infinity (found in the merge's pass, before its values are used)."""

    def __init__(self, site: str, tensor: str, round_label: str):
        self.site, self.tensor, self.round_label = site, tensor, round_label
        self.problem = f"{round_label}: site {site}: tensor {tensor} holds NaN or infinite values"
        super().__init__(
            f"{self.problem}; the site's model diverged or was damaged, and nothing was merged. Look at its "
            "training (loss.csv), retrain it, or set aggregate.non_finite: leave_out to merge the round "
            "without it"
        )


@dataclass(frozen=True)
class AggregateJob:
    """The folders of one merge (the CLI's paths), apart from the options: the site models (site ->
    model folder), the output folder, the sites' manifests (for weights by tokens), the round's start
    model, the server state read and written; `checksums`: verify and record the files' sha256."""

    models: Mapping[str, str | Path]
    out_dir: str | Path
    manifests: Mapping[str, str | Path] | None = None
    start: str | Path | None = None
    server_state_in: str | Path | None = None
    server_state_out: str | Path | None = None
    checksums: bool = True


def aggregate(job: AggregateJob, options: AggregateOptions | None = None) -> dict:
    """Merge the site models `job.models` into `job.out_dir` (see `_aggregate`). A site found
    non-finite stops the merge with an error, or (aggregate.non_finite: leave_out) the round is merged
    again without it and aggregate.json's `left_out` says so."""
    options = options or AggregateOptions.from_mapping({})
    models = dict(job.models)
    manifests = dict(job.manifests or {})
    left_out: list[dict] = []
    while True:
        try:
            return _aggregate(dataclasses.replace(job, models=models, manifests=manifests), options, left_out)
        except NonFiniteError as error:
            if options.non_finite != "leave_out":
                raise
            if len(models) == 1:
                earlier = ", ".join(e["site"] for e in left_out)
                raise AggregateError(
                    f"{error.problem}; with aggregate.non_finite: leave_out no other site is left to merge"
                    + (f" (left out already: {earlier})" if earlier else "")
                ) from None
            _log(f"warning: {error.problem}: merging the round again without site {error.site}")
            left_out.append({"site": error.site, "tensor": error.tensor, "reason": "non-finite values"})
            models.pop(error.site)
            manifests.pop(error.site, None)
            if isinstance(options.weights, Mapping):
                weights = {site: w for site, w in options.weights.items() if site != error.site}
                options = dataclasses.replace(options, weights=weights)


def _aggregate(job: AggregateJob, options: AggregateOptions, left_out: Sequence[dict]) -> dict:
    """Merge the site models `models` (site -> model folder) into `out_dir` as `options` say (the
    aggregate section; its defaults when None); returns aggregate.json. The folders are `job`'s fields.

    `start` is the model the round started from: the base of the task vectors and of the server
    optimizer's step (not read when the method's weighted mean is the result: fedavg with sgd at lr 1
    and the vocab rows unstepped). With neither state folder, fedavgm at lr 1 (the default) takes its
    first step, which is sgd at lr 1, and the vocab rows no step: a one-shot merge is the sites' mean and
    needs no state. The server optimizer's state is read from `server_state_in` (none
    in the first round) and written to `server_state_out`. Every check (arguments, weights,
    compatibility) runs before the first byte is written; the options were checked when they were
    made."""
    started = time.perf_counter()
    models, out_dir, manifests, start = job.models, job.out_dir, job.manifests or {}, job.start
    server_state_in, server_state_out, checksums = job.server_state_in, job.server_state_out, job.checksums
    method = merge_method(options.method)
    optimizer = options.server_optimizer
    if server_state_in is None and server_state_out is None and optimizer.plain_first_step:
        # A one-shot merge: fedavgm's first step (m = delta) at lr 1 is plain sgd, and no state is kept;
        # the vocab rows' step is a round's of a federation (aggregate.vocab_step), so it is the mean too.
        if not optimizer.plain or options.vocab_step != 1:
            _log(f"one merge with {optimizer.name} at lr 1 and no server state: the sites' mean")
        options = dataclasses.replace(
            options, server_optimizer=ServerOptimizerOptions.plain_step(), vocab_step=1
        )
    plain = (
        method.entry.mean
        and options.server_optimizer.plain
        and not (options.rows_by_counts and options.vocab_factor(len(models)) != 1)
    )
    # Compressed updates (federation.exchange) are rebuilt against the start model inside the stream.
    updates = {site: exchange.is_update(path) for site, path in models.items()}
    if any(updates.values()) and start is None:
        compressed = ", ".join(site for site, is_update in updates.items() if is_update)
        raise AggregateError(f"--start is needed: sites {compressed} sent compressed updates of it")
    _check_arguments(options, models, start, server_state_out, plain)
    check_same_base(models, start)
    manifests = {site: Path(p) for site, p in (manifests or {}).items()}
    sites = list(models)
    tokens = _manifest_tokens(manifests, sites)
    source, raw = resolve_weights(options.weights, sites, tokens)
    weights = normalised(raw)
    shard_limit = parse_size(options.max_shard_size)

    needs_start = not plain or any(updates.values())
    # The start model's tensor table is read whenever it is given, for the checks: the sites must hold its
    # tensors. Its values are read only where the merge needs them.
    site_models, start_model = _read_models(models, manifests, tokens, start)
    round_label = _round_label(site_models, out_dir)
    check_same_start(site_models, start, round_label)
    if not needs_start:
        start_model = None
    ref = site_models[0]
    plan = plan_output(ref, options.dtype, shard_limit)
    order = [t for shard in plan for t in shard]
    state_record, state_folder = (None, None)
    if server_state_in is not None:
        state_record, state_folder = read_server_state(Path(server_state_in), options.server_optimizer, order)
    round_step = (state_record or {}).get("step", 0) + 1
    state_plan = plan_state(order, slots(options.server_optimizer), shard_limit)
    rows, rows_record = _vocab_rows(options, site_models, weights, order)
    _log(
        f"{options.method} of {len(sites)} sites ({source} weights "
        + ", ".join(f"{s}={weights[s]:.4f}" for s in sites)
        + f"), server optimizer {options.server_optimizer.name} (step {round_step}): "
        + f"{len(order)} tensors into {len(plan)} shard(s)"
    )
    out_dir = Path(out_dir)
    with contextlib.ExitStack() as outputs:
        tmp = outputs.enter_context(atomic_dir(out_dir))
        state_tmp = outputs.enter_context(atomic_dir(Path(server_state_out))) if server_state_out else None
        extra = [m for m in (start_model, state_folder) if m is not None]
        decoders = {
            i: (*m.update, exchange.Rebuilder()) for i, m in enumerate(site_models) if m.update is not None
        }
        merge = _Merge(
            method,
            options.parameters,
            options.server_optimizer,
            plain,
            rows=rows,
            updates=decoders,
            round_label=round_label,
        )
        output, state_output, digests = _write_merged(
            tmp,
            state_tmp,
            plan,
            state_plan,
            [*site_models, *extra],
            [weights[s] for s in sites],
            merge=merge,
            sites=len(site_models),
            checksums=checksums,
        )
        _copy_support_files(ref, tmp, options.dtype)
        inputs = _site_records(site_models, digests, checksums)
        extra_records = [
            _input_record(len(site_models) + k, f, digests, checksums) for k, f in enumerate(extra)
        ]
        if checksums:
            _verify_inputs([*inputs, *extra_records], [*site_models, *extra])
            record_checksums(tmp, {name: f["sha256"] for name, f in output["files"].items()})
        warnings = _identical_inputs(inputs, site_models) if checksums else []
        for warning in warnings:
            _log(f"warning: {warning}")
        record = {
            "method": options.method,
            "weights": {"source": source, "raw": raw, "normalised": weights},
            "vocab_rows": rows_record,
            "dtype": options.dtype,
            "max_shard_size": options.max_shard_size,
            "inputs": inputs,
            "output": output,
            "warnings": warnings,
        }
        if left_out:
            # aggregate.non_finite: leave_out: the sites this round was merged without, for the report.
            record["left_out"] = list(left_out)
        # What crosses with the merged model: the identity of the start it was merged from (as training.json
        # of a site model carries its own) and this attempt.
        if start is not None and (Path(start) / exchange.CHECKSUMS).is_file():
            # From the start's checksum record (no read of its weights; a start without one is not named).
            record["start_identity"] = exchange.start_identity(start)["identity"]
        record["attempt"] = exchange.attempt()
        optimizer = options.server_optimizer.to_dict()
        if needs_start:
            record["start"] = extra_records[0]
        if not plain:
            record["parameters"] = options.parameters
            record["server_optimizer"] = {**optimizer, "step": round_step}
            if merge.scales:
                summary = _scale_summary(merge.scales)
                record["server_optimizer"]["extrapolation"] = summary
                _log(
                    f"{options.server_optimizer.name}'s step over the tensors: {summary['min']:g} to "
                    f"{summary['max']:g} times the merged update (median {summary['median']:g})"
                )
        if state_folder is not None:
            record["server_state_in"] = extra_records[-1]
        elif server_state_in is not None:
            record["server_state_in"] = {"model_dir": str(server_state_in)}
        if state_tmp is not None:
            state = {"optimizer": optimizer, "step": round_step, "output": state_output}
            _write_state_record(state_tmp, state, checksums)
            record["server_state_out"] = {"dir": str(server_state_out), **state}
        record["wall_time_s"] = round(time.perf_counter() - started, 3)
        write_json(tmp / "aggregate.json", record)
    _log(f"done in {record['wall_time_s']:.1f} s: {out_dir}")
    return record


def _scale_summary(scales: Mapping[str, float]) -> dict:
    """fedexp's factors over the tensors: their range, median and the largest few by name."""
    values = sorted(scales.values())
    largest = sorted(scales.items(), key=lambda item: -item[1])[:5]
    return {
        "min": round(values[0], 4),
        "median": round(values[len(values) // 2], 4),
        "max": round(values[-1], 4),
        "largest": {name: round(value, 4) for name, value in largest},
    }


def _read_models(
    models: Mapping[str, str | Path], manifests: Mapping[str, Path], tokens: Mapping[str, int], start
) -> tuple[list[SiteModel], SiteModel | None]:
    """The sites' folders (with their manifests' tokens) and the start model (None: not needed), after
    checking that they line up."""
    site_models = [
        read_site_update(site, Path(path), start)
        if exchange.is_update(path)
        else read_site_model(site, Path(path))
        for site, path in models.items()
    ]
    for m in site_models:
        m.tokens = tokens.get(m.site)
        m.manifest = manifests.get(m.site)
    start_model = None if start is None else read_site_model("start", Path(start), f"the start model {start}")
    check_compatible(site_models, start_model)
    return site_models, start_model


def _vocab_rows(
    options: AggregateOptions, site_models: Sequence[SiteModel], weights: Mapping[str, float], order
) -> tuple[dict[str, torch.Tensor], dict]:
    """aggregate.vocab_rows: the row weights of each tensor with a row per token id (name -> (sites,
    vocab)), from the sites' token counts, and aggregate.json's record of what was done. Falls back to
    the sites' weights, saying why, where the method is not fedavg or a site has no counts."""
    record = {"mode": options.vocab_rows, "tensors": []}
    if options.vocab_rows == "weights":
        return {}, record
    if not options.entry.mean:
        why = f"method {options.method} merges every tensor with the sites' weights"
    else:
        counts = {m.site: token_counts.read(m.path) for m in site_models}
        table, why = token_counts.site_row_weights(counts, weights)
        shapes = {t.name: t.shape for t in order}
        factor = options.vocab_factor(len(site_models))
        rows = {
            name: t * factor for name, t in table.items() if name in shapes and shapes[name][0] == t.shape[1]
        }
        if rows:
            record.update(tensors=sorted(rows), step=factor)
            _log(
                f"vocab rows: {', '.join(sorted(rows))} merged with the sites' token counts, their update "
                f"times {factor:g} (aggregate.vocab_step)"
            )
            return rows, record
        why = why or f"no tensor of the model is listed in the sites' {token_counts.FILE}"
    _log(f"vocab rows: with the sites' weights ({why})")
    return {}, {**record, "fallback": why}


def _verify_inputs(records: Sequence[dict], folders: Sequence[WeightFolder]) -> None:
    """Inputs were hashed while being read: compare with what their writers recorded, for free."""
    for entry, m in zip(records, folders, strict=True):
        verify_checksums(m.path, {name: f["sha256"] for name, f in entry["files"].items()})


def _write_state_record(state_dir: Path, state: dict, checksums: bool) -> None:
    if checksums:
        record_checksums(state_dir, {n: f["sha256"] for n, f in state["output"]["files"].items()})
    write_json(state_dir / STATE_RECORD, state)


def _check_arguments(options: AggregateOptions, models, start, server_state_out, plain: bool) -> None:
    """What the options need of the other arguments: a start model unless the result is the plain mean,
    a state folder for an optimizer that keeps one, distinct site folders."""
    optimizer = options.server_optimizer
    if not plain and start is None:
        raise AggregateError(
            f"--start (the model the round started from) is needed for method {options.method} with server "
            f"optimizer {optimizer.name} at lr {optimizer.lr}"
        )
    if slots(optimizer) and server_state_out is None:
        raise AggregateError(f"--server-state-out is needed: {optimizer.name} keeps a state between rounds")
    if not models:
        raise AggregateError("no site models given (--model SITE=DIR)")
    resolved: dict[Path, str] = {}
    for site, path in models.items():
        real = Path(path).resolve()
        if real in resolved:
            # The published run once averaged a model with itself; a copy-paste slip must not pass.
            raise AggregateError(f"sites {resolved[real]} and {site} point at the same model folder {path}")
        resolved[real] = site


def _manifest_tokens(manifests: Mapping[str, Path], sites: Sequence[str]) -> dict[str, int]:
    unknown = sorted(set(manifests) - set(sites))
    if unknown:
        raise AggregateError(f"--manifest given for sites without --model: {unknown}")
    return {site: manifest_tokens(site, path, error=AggregateError) for site, path in manifests.items()}


def _site_records(site_models: Sequence[SiteModel], digests: dict, checksums: bool) -> list[dict]:
    """aggregate.json's inputs: each site's files (sha256 from the merge's reads) and its manifest."""
    inputs = []
    for i, m in enumerate(site_models):
        entry = _input_record(i, m, digests, checksums)
        entry.update(
            {"site": m.site, "manifest": str(m.manifest) if m.manifest else None, "tokens_kept": m.tokens}
        )
        inputs.append(entry)
    return inputs


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


@dataclass(frozen=True)
class _Merge:
    """What the writer does to each floating tensor: the merge method with its parameters, then the
    server optimizer's step; `plain`: the result is the sites' weighted mean (no start, no step)."""

    method: MergeMethod
    parameters: dict
    optimizer: ServerOptimizerOptions
    plain: bool
    rows: Mapping[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # name -> (sites, vocab)
    # Site index -> (header, parts folder, its Rebuilder) of the sites that sent compressed updates.
    updates: Mapping[int, tuple] = dataclasses.field(default_factory=dict)
    # Tensor name -> the server step's extrapolation factor (fedexp), filled in as tensors are merged.
    scales: dict[str, float] = dataclasses.field(default_factory=dict)
    round_label: str = "this round"  # the round in messages: "round 3"


def _write_merged(
    out_dir: Path,
    state_dir: Path | None,
    plan: Sequence[Sequence[OutTensor]],
    state_plan: Sequence[Sequence[OutTensor]],
    folders: Sequence[WeightFolder],
    weights: Sequence[float],
    *,
    merge: _Merge,
    sites: int,
    checksums: bool,
) -> tuple[dict, dict | None, dict[tuple[int, str], str]]:
    """Stream every tensor through the merge method and the server optimizer into the output (and the
    new server state). folders: the sites, then the start model (unless the merge is the plain
    weighted mean), then the previous server state (if any). Returns the output's record, the state's
    record and the sha256 of every input file (empty without checksums)."""
    order = [t for shard in plan for t in shard]
    start_i = None if merge.plain and not merge.updates else sites
    state_i = sites + 1 if len(folders) > sites + 1 else None
    state_slots = slots(merge.optimizer)
    reads = []
    for i in range(len(folders)):
        if i == state_i:
            reads.append(
                [[f"{s}.{t.name}" for s in state_slots] if t.dtype.is_floating_point else [] for t in order]
            )
        elif i in merge.updates:
            header = merge.updates[i][0]
            reads.append([[t.name + s for s in _suffixes(header.tensors[t.name])] for t in order])
        else:
            reads.append([[t.name] for t in order])
    # The reader reads an update's parts from its own files.
    folders = [merge.updates[i][1] if i in merge.updates else f for i, f in enumerate(folders)]
    # Elementwise work goes chunk by chunk (methods.CHUNK entries), so that the dozen passes of a merge
    # and a server step run on cache-resident data and read each input once.
    chunk = min(max(t.numel for t in order), CHUNK)
    buffers = [torch.empty(chunk) for _ in range(3)]
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
            metadata = {"optimizer": merge.optimizer.name}
            state = ShardedOutput(state_dir, state_plan, checksums, metadata=metadata)
            stack.callback(state.shutdown)
        shard_started = time.perf_counter()
        for k, tensor in enumerate(order):
            reader.reached(k)
            base = reader.get(start_i, tensor.name) if start_i is not None else None
            sources = [_site_tensor(reader, i, tensor.name, base, merge) for i in range(sites)]
            if sources[0].dtype.is_floating_point:
                # Every value of every site, before it is used: two reductions over the tensor the merge
                # has just read (no read of its own), which NaN and infinities cannot pass unseen.
                for i, src in enumerate(sources):
                    if not _finite(src):
                        raise NonFiniteError(folders[i].site, tensor.name, merge.round_label)
            slot, result = output.slot(tensor)
            if not sources[0].dtype.is_floating_point:
                _check_identical(tensor.name, sources, [f.site for f in folders[:sites]])
                result.copy_(sources[0])
            elif merge.plain and tensor.name in merge.rows:
                _row_mean_into(result, sources, merge.rows[tensor.name], tensor.shape, buffers)
            elif merge.plain:
                _mean_into(result, sources, weights, buffers)
            else:
                old = {s: reader.get(state_i, f"{s}.{tensor.name}") if state_i else None for s in state_slots}
                taken = {s: state.slot(_state_tensor(s, tensor)) for s in state_slots}
                new = {s: buf for s, (_, buf) in taken.items()}
                _step_into(result, merge, tensor, base, sources, weights, old, new, buffers)
                for s, (state_slot, _) in taken.items():
                    state.put(_state_tensor(s, tensor), state_slot)
            output.put(tensor, slot)
            shard, index = output.where[tensor.name]
            if index == len(plan[shard]) - 1:
                _log(f"shard {output.names[shard]}: merged in {time.perf_counter() - shard_started:.1f} s")
                shard_started = time.perf_counter()
        record = output.finish()
        state_record = state.finish() if state is not None else None
        if state_dir is not None and state is None:
            state_record = {"tensors": 0, "parameters": 0, "bytes": 0, "files": {}}
        digests = reader.digests()
    return record, state_record, digests


def _finite(values: torch.Tensor) -> bool:
    """Whether a float tensor holds no NaN and no infinity: its max and min propagate a NaN and are
    infinite where an entry is, and the two vectorised reductions cost a fraction of a copy."""
    if values.numel() == 0:
        return True
    if values.element_size() == 1:
        # float8 (no max kernel on the CPU): chunk by chunk in fp32.
        return all(_finite(values[lo:hi].float()) for lo, hi in chunks(values.numel()))
    return math.isfinite(float(values.amax())) and math.isfinite(float(values.amin()))


def _site_tensor(reader: FolderReader, i: int, name: str, base, merge: _Merge) -> torch.Tensor:
    """Site i's tensor `name`, flat: as stored, or rebuilt from its compressed update and the start."""
    if i not in merge.updates:
        return reader.get(i, name)
    header, _, rebuilder = merge.updates[i]
    entry = header.tensors[name]
    parts = {s: reader.get(i, name + s) for s in _suffixes(entry)}
    return rebuilder.rebuild(base, parts, entry.encoding, entry.shape)


def _mean_into(result: torch.Tensor, sources, weights, buffers) -> None:
    """The sites' weighted mean, chunk by chunk: the inputs' values bit for bit when they agree."""
    acc, scratch = buffers[1], buffers[2]
    for lo, hi in chunks(result.numel()):
        part = [src[lo:hi] for src in sources]
        result[lo:hi].copy_(weighted_mean(part, weights, acc[: hi - lo], scratch[: hi - lo]))


def _row_mean_into(result: torch.Tensor, sources, table: torch.Tensor, shape, buffers) -> None:
    """The sites' mean with a weight per site and row (aggregate.vocab_rows), chunk by chunk."""
    acc, scratch = buffers[1], buffers[2]
    row_length = math.prod(shape[1:])
    for lo, hi in chunks(result.numel()):
        weights = token_counts.rows_of_chunk(table, lo, hi, row_length)
        mean = acc[: hi - lo].zero_()
        for i, src in enumerate(sources):
            mean.addcmul_(scratch[: hi - lo].copy_(src[lo:hi]), weights[i])
        result[lo:hi].copy_(mean)


def _step_into(result, merge: _Merge, tensor: OutTensor, base, sources, weights, old, new, buffers) -> None:
    """start + the server optimizer's update from the merged task vector, chunk by chunk: any method's
    chunks (methods.chunks) go through the same step. `old`: the previous state's slices by slot (None
    in the first round); `new`: the buffers the new state is written into."""
    if tensor.name in merge.rows:
        parts = fedavg_rows(base, sources, merge.rows[tensor.name], math.prod(tensor.shape[1:]))
    else:
        parts = merge.method.merge(base, sources, weights, {**merge.parameters, "name": tensor.name})
    base_buffer = buffers[0]
    scale = 1.0
    if merge.optimizer.entry.extrapolates:
        parts, scale = _extrapolation(parts, base, sources, weights, result.numel(), buffers[1])
        merge.scales[tensor.name] = scale
    for (lo, hi), delta in zip(chunks(result.numel()), parts, strict=True):
        # fp32 + fp16 rounds the same as fp32 + fp32 of the converted value, but torch's mixed-dtype
        # kernels are several times slower: convert once per chunk.
        base_part = base_buffer[: hi - lo].copy_(base[lo:hi])
        update = step(
            merge.optimizer,
            delta,
            {s: None if o is None else o[lo:hi] for s, o in old.items()},
            {s: buf[lo:hi] for s, buf in new.items()},
        )
        if scale != 1.0:
            update.mul_(scale)
        result[lo:hi].copy_(update.add_(base_part))


def _extrapolation(parts, base, sources, weights, numel: int, scratch: torch.Tensor):
    """The merged update of one tensor held whole (fp32), and FedExP's factor for it
    (server_optimizers.fedexp_scale): the step needs the whole tensor's norms before its first chunk
    is written, so this tensor's update is the one extra copy the merge holds."""
    merged = torch.empty(numel, dtype=torch.float32)
    merged_sq, spread = 0.0, 0.0
    for (lo, hi), delta in zip(chunks(numel), parts, strict=True):
        merged[lo:hi].copy_(delta)
        merged_sq += float(torch.dot(merged[lo:hi], merged[lo:hi]))
        for weight, src in zip(weights, sources, strict=True):
            site = scratch[: hi - lo].copy_(src[lo:hi]).sub_(base[lo:hi])
            spread += weight * float(torch.dot(site, site))
    scale = fedexp_scale(spread, merged_sq, len(sources))
    return [merged[lo:hi] for lo, hi in chunks(numel)], scale


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


@cli.entry("fedtune.aggregate.merge", offline=True)
def main(argv: Sequence[str] | None = None) -> None:
    parser = cli.parser("fedtune.aggregate.merge", __doc__.split("\n\n")[0])
    cli.add_out(parser, "folder of the merged model (replaced atomically)")
    cli.add_options(parser, "the aggregate section (with the merged model's dtype)")
    cli.add_list(parser, "--model", "SITE=DIR", "site model folders", required=True)
    cli.add_list(
        parser,
        "--manifest",
        "SITE=PATH",
        "site manifests (data/<site>/manifest.json); needed for weights tokens",
    )
    parser.add_argument(
        "--start",
        default=None,
        metavar="DIR",
        help="the model the round started from: base of the task vectors and of the server step"
        " (not needed for fedavg with sgd at lr 1)",
    )
    parser.add_argument("--server-state-in", default=None, metavar="DIR", help="the previous round's state")
    parser.add_argument(
        "--server-state-out", default=None, metavar="DIR", help="folder of this round's state"
    )
    parser.add_argument("--no-checksums", action="store_true", help="skip the sha256 of inputs and outputs")
    args = parser.parse_args(argv)
    job = AggregateJob(
        parse_pairs(args.model, "--model"),
        args.out,
        manifests=parse_pairs(args.manifest, "--manifest"),
        start=args.start,
        server_state_in=args.server_state_in,
        server_state_out=args.server_state_out,
        checksums=not args.no_checksums,
    )
    aggregate(job, AggregateOptions.from_json(args.options))


if __name__ == "__main__":
    sys.exit(main())
