"""Aggregate the sites' LoRA adapters (PEFT folders: adapter_config.json, adapter_model.safetensors) into
one adapter, and optionally into the base model's weights. Two modes, named by what they do:

- `exact`: the weighted mean of the sites' updates, sum_i w_i s_i B_i A_i (s_i = lora_alpha / r, or
  lora_alpha / sqrt(r) with use_rslora), kept as one adapter of rank sum_i r_i by stacking the factors:
  B = [w_1 s_1 B_1 ... w_k s_k B_k], A = [A_1; ...; A_k], with lora_alpha = r so that peft's scaling is 1.
  Sites may use different ranks and alphas.
- `average_factors`: B = sum_i w_i B_i, A = sum_i w_i A_i, what FlowerTune and OpenFedLLM do. It stays at
  rank r, but mean(B) mean(A) is not the mean of the updates (cross terms B_i A_j); it needs every site at
  the same rank and scaling.

Tensors the sites train whole (peft's modules_to_save, such as a classification head, and trained biases)
are averaged in both modes. `--merge-into BASE` also writes a full HF model: the base's tensors streamed
through, base + the aggregate's update for each adapted weight (transposed for fan_in_fan_out layers such
as GPT-2's Conv1D), the averaged whole tensors in place of the base's, every other tensor copied.

Adapters are small (tens of MB for a 7B model), so they are read whole; only the base model is
streamed, with fedtune.core.safetensors_stream. Every check runs before the first byte is written, and each
output folder appears by one rename (fedtune.core.atomic)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fedtune.aggregate.adapter_size import pattern_value
from fedtune.aggregate.merge import (
    STATE_RECORD,
    _finite,
    _round_label,
    check_same_base,
    normalised,
    parse_pairs,
    parse_size,
    read_state_record,
    resolve_weights,
)
from fedtune.aggregate.model_compat import CONFIG_FILE, COPIED_FILES
from fedtune.aggregate.options import AggregateOptions, ServerOptimizerOptions
from fedtune.core import cli
from fedtune.core.atomic import atomic_dir, write_json
from fedtune.core.checksums import sha256_file
from fedtune.core.models import record_checksums, verify_checksums, weight_files
from fedtune.core.options import torch_dtype
from fedtune.core.safetensors_stream import (
    ST_DTYPES,
    FolderReader,
    OutTensor,
    ShardedOutput,
    TensorInfo,
    WeightsError,
    file_order,
    listing,
    plan_shards,
    read_header,
    read_weights,
)
from fedtune.tokenize.blocks import manifest_tokens

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
RECORD = "aggregate.json"
# peft's saved keys: base_model.model.<module path>.lora_A.weight; no adapter name in the file.
PREFIX = "base_model.model."
LORA_A = ".lora_A.weight"
LORA_B = ".lora_B.weight"
# Config switches that make an adapter more than B A on top of the base; averaging would silently drop
# what they add, so such adapters are refused.
UNSUPPORTED = {
    "use_dora": "DoRA's magnitude vector is not linear in the sites' updates",
    "lora_bias": "lora_B biases are not aggregated",
    "trainable_token_indices": "trainable tokens are not aggregated",
    "layer_replication": "replicated layers share weights the merge would write twice",
    "target_parameters": "LoRA on bare parameters (MoE experts) is not aggregated",
    "alora_invocation_tokens": "activated LoRA applies only after its invocation tokens",
    "use_qalora": "QA-LoRA pools its inputs",
    "use_bdlora": "block-diagonal LoRA is not aggregated",
}
# These initialisations rewrite the base weights as well (residuals of an SVD or a quantisation), so the
# update B A is relative to a base that no site folder holds.
BASE_REWRITING_INITS = ("pissa", "corda", "olora", "loftq")


class AdapterAggregateError(WeightsError):
    """Adapters that cannot be aggregated, or bad options: the message names the folder, key and value."""


@dataclass
class LoraModule:
    """One adapted linear layer of one site: A (r x in), B (out x r), scaling s."""

    a_key: str
    b_key: str
    r: int
    fan_in: int
    fan_out: int
    alpha: float
    scaling: float


@dataclass
class Adapter:
    """One site's PEFT LoRA folder, read and checked (no tensor data loaded)."""

    site: str
    path: Path
    config: dict
    tensors: dict[str, TensorInfo]  # every tensor of adapter_model.safetensors
    modules: dict[str, LoraModule]  # module path (base_model.model. removed) -> factors
    whole: list[str]  # keys of tensors trained whole (modules_to_save, biases)
    files: dict[str, int] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"adapter {self.site} ({self.path})" if str(self.path) != self.site else f"adapter {self.path}"


# ---------------------------------------------------------------------------------------------------
# Reading and checking the adapters


def scaling(alpha: float, r: int, rslora: bool) -> float:
    """peft's LoRA scaling: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
    return alpha / math.sqrt(r) if rslora else alpha / r


def read_adapter(site: str, path: str | Path) -> Adapter:
    """The config and tensor table of one PEFT LoRA folder, checked against each other."""
    path = Path(path)
    config_path, weights_path = _adapter_files(path)
    config = _read_lora_config(config_path)
    tensors = _read_tensor_table(weights_path)
    factors, whole = _split_keys(tensors, weights_path)
    modules = _lora_modules(factors, tensors, config, config_path, weights_path)
    files = {ADAPTER_CONFIG: config_path.stat().st_size, ADAPTER_WEIGHTS: weights_path.stat().st_size}
    return Adapter(site, path, config, tensors, modules, sorted(whole), files)


def _adapter_files(path: Path) -> tuple[Path, Path]:
    who = f"adapter {path}"
    if not path.is_dir():
        raise AdapterAggregateError(f"{who}: folder not found")
    config_path, weights_path = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    for needed in (config_path, weights_path):
        if not needed.is_file():
            hint = (
                " (adapter_model.bin is not read: save with safe_serialization)"
                if needed == weights_path
                else ""
            )
            raise AdapterAggregateError(f"{who}: {needed.name} missing{hint}")
    return config_path, weights_path


def _read_lora_config(config_path: Path) -> dict:
    """adapter_config.json, refused unless it describes a plain LoRA this module can average."""
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise AdapterAggregateError(f"{config_path}: not valid JSON: {e}") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        peft_type = config.get("peft_type") if isinstance(config, dict) else None
        raise AdapterAggregateError(
            f"{config_path}: peft_type {peft_type!r}, only LORA adapters are aggregated"
        )
    for key, why in UNSUPPORTED.items():
        if config.get(key):
            raise AdapterAggregateError(f"{config_path}: {key} = {config[key]!r} is not supported: {why}")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(BASE_REWRITING_INITS):
        raise AdapterAggregateError(
            f"{config_path}: init_lora_weights = {init!r} changes the base weights too; convert the adapter "
            "to a plain LoRA first (peft's path_initial_model_for_weight_conversion)"
        )
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise AdapterAggregateError(f"{config_path}: r = {r!r} is not a positive integer")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterAggregateError(f"{config_path}: lora_alpha = {alpha!r} is not a number")
    return config


def _read_tensor_table(weights_path: Path) -> dict[str, TensorInfo]:
    """The safetensors header of adapter_model.safetensors: every tensor's dtype, shape and bytes."""
    try:
        header = read_header(weights_path)
        start = header.pop("_data_start")
        tensors: dict[str, TensorInfo] = {}
        for key, meta in header.items():
            begin, end = meta["data_offsets"]
            tensors[key] = TensorInfo(
                meta["dtype"], tuple(meta["shape"]), ADAPTER_WEIGHTS, start + begin, end - begin
            )
    except (ValueError, KeyError, TypeError) as e:
        # JSON errors are ValueErrors; a header of the wrong shape fails on its keys.
        raise AdapterAggregateError(
            f"{weights_path}: not a safetensors file ({type(e).__name__}: {e})"
        ) from None
    for key, info in tensors.items():
        if info.dtype not in ST_DTYPES or not ST_DTYPES[info.dtype].is_floating_point:
            raise AdapterAggregateError(f"{weights_path}: tensor {key} has dtype {info.dtype}, not a float")
    if not tensors:
        raise AdapterAggregateError(f"{weights_path}: holds no tensors")
    return tensors


def _split_keys(tensors: Mapping[str, TensorInfo], weights_path: Path) -> tuple[dict, list[str]]:
    """(module -> {"A": key, "B": key}, keys of tensors trained whole)."""
    factors: dict[str, dict[str, str]] = {}
    whole = []
    for key in tensors:
        if not key.startswith(PREFIX):
            raise AdapterAggregateError(
                f"{weights_path}: tensor {key} does not start with {PREFIX} (not a LoRA adapter of a transformers model)"
            )
        for suffix, which in ((LORA_A, "A"), (LORA_B, "B")):
            if key.endswith(suffix):
                factors.setdefault(key[len(PREFIX) : -len(suffix)], {})[which] = key
                break
        else:
            if ".lora_" in key:
                raise AdapterAggregateError(
                    f"{weights_path}: tensor {key} is not supported (only lora_A/lora_B of linear layers are "
                    "aggregated: no embedding, convolution or DoRA adapters)"
                )
            whole.append(key)
    return factors, whole


def _lora_modules(
    factors, tensors, config: dict, config_path: Path, weights_path: Path
) -> dict[str, LoraModule]:
    """Each module's factors, checked: A r x in and B out x r, r as the config says (rank_pattern)."""
    r, alpha = config["r"], config["lora_alpha"]
    rslora = bool(config.get("use_rslora", False))
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    modules: dict[str, LoraModule] = {}
    for module, pair in sorted(factors.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise AdapterAggregateError(f"{weights_path}: module {module} has no {missing} weight")
        a, b = tensors[pair["A"]].shape, tensors[pair["B"]].shape
        if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            raise AdapterAggregateError(
                f"{weights_path}: module {module}: lora_A {list(a)} and lora_B {list(b)} are not r x in and out x r"
            )
        rank = a[0]
        expected = pattern_value(rank_pattern, module, r)
        if rank != expected:
            raise AdapterAggregateError(
                f"{config_path}: module {module} has rank {rank} in {ADAPTER_WEIGHTS}, but the config says "
                f"r = {expected}" + (" (rank_pattern)" if expected != r else "")
            )
        module_alpha = pattern_value(alpha_pattern, module, alpha)
        modules[module] = LoraModule(
            pair["A"], pair["B"], rank, a[1], b[0], module_alpha, scaling(module_alpha, rank, rslora)
        )
    if not modules:
        raise AdapterAggregateError(f"{weights_path}: no lora_A/lora_B weights")
    return modules


def _ranks(adapter: Adapter) -> str:
    """The ranks of an adapter in a message: one number, or each distinct one with its module count."""
    counts: dict[int, int] = {}
    for m in adapter.modules.values():
        counts[m.r] = counts.get(m.r, 0) + 1
    if len(counts) == 1:
        return f"r={next(iter(counts))}"
    return "r=" + "/".join(f"{r} ({n} modules)" for r, n in sorted(counts.items()))


def check_adapters(adapters: Sequence[Adapter], mode: str) -> list[str]:
    """Raise AdapterAggregateError listing every way the adapters cannot be aggregated in `mode`;
    returns warnings (differences that do not change the result)."""
    ref = adapters[0]
    problems, warnings = [], []
    for key in ("fan_in_fan_out", "task_type"):
        values = {a.label: a.config.get(key) for a in adapters}
        if len(set(map(json.dumps, values.values()))) > 1:
            problems.append(f"{key} differs: " + ", ".join(f"{w}: {v!r}" for w, v in values.items()))
    for a in adapters[1:]:
        missing = sorted(set(ref.modules) - set(a.modules))
        extra = sorted(set(a.modules) - set(ref.modules))
        if missing or extra:
            problems.append(
                f"target modules differ: {a.label} lacks {listing(missing) or 'none'} and adds "
                f"{listing(extra) or 'none'} compared with {ref.label} "
                f"(target_modules {a.config.get('target_modules')!r} vs {ref.config.get('target_modules')!r})"
            )
        for name in sorted(set(ref.modules) & set(a.modules)):
            m, n = ref.modules[name], a.modules[name]
            if (m.fan_in, m.fan_out) != (n.fan_in, n.fan_out):
                problems.append(
                    f"module {name}: {ref.label} is {m.fan_in} -> {m.fan_out}, {a.label} is {n.fan_in} -> {n.fan_out}"
                )
        if a.whole != ref.whole:
            problems.append(
                f"tensors trained whole (modules_to_save) differ: {a.label} has {listing(a.whole) or 'none'}, "
                f"{ref.label} has {listing(ref.whole) or 'none'}"
            )
        else:
            for key in a.whole:
                if a.tensors[key].shape != ref.tensors[key].shape:
                    problems.append(
                        f"tensor {key}: {list(a.tensors[key].shape)} in {a.label}, "
                        f"{list(ref.tensors[key].shape)} in {ref.label}"
                    )
    if mode == "average_factors" and not problems:
        unequal = [
            name
            for name in ref.modules
            if len({(a.modules[name].r, a.modules[name].scaling) for a in adapters}) > 1
        ]
        if unequal:
            problems.append(
                f"average_factors needs every site at the same rank and scaling (lora_alpha, use_rslora); "
                f"{len(unequal)} module(s) differ, e.g. {unequal[0]}: "
                + ", ".join(
                    f"{a.path}: r={a.modules[unequal[0]].r} lora_alpha={a.modules[unequal[0]].alpha}"
                    f" use_rslora={bool(a.config.get('use_rslora'))} ({_ranks(a)})"
                    for a in adapters
                )
                + "; use --mode exact, which takes any ranks"
            )
    if problems:
        raise AdapterAggregateError("the adapters cannot be aggregated:\n  " + "\n  ".join(problems))
    bases = {a.config.get("base_model_name_or_path") for a in adapters}
    if len(bases) > 1:
        warnings.append(f"the adapters name different base models: {sorted(map(str, bases))}")
    return warnings


# ---------------------------------------------------------------------------------------------------
# The aggregate adapter


def _load(adapter: Adapter) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(adapter.path / ADAPTER_WEIGHTS)


def aggregate_factors(
    adapters: Sequence[Adapter],
    tensors: Sequence[Mapping[str, torch.Tensor]],
    weights: Sequence[float],
    mode: str,
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor], int, float]:
    """The aggregate in fp32: (module -> (B, A), whole tensor key -> mean, rank, scaling), so that each
    module's update is scaling * B @ A. In exact mode modules whose summed rank is below the largest are
    padded with zeros (their rows add nothing), so that one r describes the adapter without rank_pattern."""
    ref = adapters[0]
    factors = {}
    for name in ref.modules:
        if mode == "exact":
            bs = [
                w * a.modules[name].scaling * t[a.modules[name].b_key].float()
                for a, t, w in zip(adapters, tensors, weights, strict=True)
            ]
            as_ = [t[a.modules[name].a_key].float() for a, t in zip(adapters, tensors, strict=True)]
            factors[name] = (torch.cat(bs, dim=1), torch.cat(as_, dim=0))
        else:
            b = sum(
                w * t[a.modules[name].b_key].float()
                for a, t, w in zip(adapters, tensors, weights, strict=True)
            )
            a_ = sum(
                w * t[a.modules[name].a_key].float()
                for a, t, w in zip(adapters, tensors, weights, strict=True)
            )
            factors[name] = (b, a_)
    if mode == "exact":
        rank = max(b.shape[1] for b, _ in factors.values())
        for name, (b, a) in factors.items():
            if b.shape[1] < rank:
                pad = rank - b.shape[1]
                factors[name] = (
                    torch.nn.functional.pad(b, (0, pad)),
                    torch.nn.functional.pad(a, (0, 0, 0, pad)),
                )
        scale = 1.0
    else:
        rank = ref.config["r"]
        scale = None  # each module keeps the sites' (equal) scaling
    whole = {key: sum(w * t[key].float() for t, w in zip(tensors, weights, strict=True)) for key in ref.whole}
    return factors, whole, rank, scale


def adapter_config(ref: Adapter, mode: str, rank: int) -> dict:
    """The output's adapter_config.json: the first site's, with the rank and scaling of the aggregate."""
    config = dict(ref.config)
    if mode == "exact":
        # lora_alpha = r and no rsLoRA make peft's scaling exactly 1: the site scalings are in B already.
        config.update(
            {"r": rank, "lora_alpha": rank, "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {}}
        )
    # Loading must not initialise anything from data or the base (eva): the weights are given.
    config["init_lora_weights"] = True
    config["inference_mode"] = True
    return config


def _out_dtype(dtype: str, stored: str) -> torch.dtype:
    return ST_DTYPES[stored] if dtype == "auto" else torch_dtype(dtype)


def _write_adapter(
    out: Path, ref: Adapter, config: dict, factors: Mapping, whole: Mapping, dtype: str
) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    tensors = {}
    for name, (b, a) in factors.items():
        m = ref.modules[name]
        tensors[m.a_key] = a.to(_out_dtype(dtype, ref.tensors[m.a_key].dtype)).contiguous()
        tensors[m.b_key] = b.to(_out_dtype(dtype, ref.tensors[m.b_key].dtype)).contiguous()
    for key, value in whole.items():
        tensors[key] = value.to(_out_dtype(dtype, ref.tensors[key].dtype)).contiguous()
    save_file(tensors, out / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    os.chmod(out / ADAPTER_WEIGHTS, 0o644)
    write_json(out / ADAPTER_CONFIG, config)
    return tensors


# ---------------------------------------------------------------------------------------------------
# The server optimizer on the merged low-rank update

MOMENTUM_FILE = "momentum.safetensors"


def server_factors(
    factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    optimizer: ServerOptimizerOptions,
    state_in: Path | None,
    whole: Mapping[str, torch.Tensor] | None = None,
    start_whole: Mapping[str, torch.Tensor] | None = None,
) -> tuple[dict, dict, dict | None]:
    """(update factors, whole tensors, momentum) of the round, the factors at scaling 1, from the
    round's exact aggregate `factors` (the merged pseudo-gradient Delta = B A per module) and the
    sites' mean of the tensors they train whole (`whole`, against their values in the round's start
    model, `start_whole`).

    The linear server optimizers stay exact on adapters: sgd's update lr * Delta is (lr B) A, and
    fedavgm's momentum m = momentum * m_prev + Delta is m_prev's factors (B scaled by momentum) stacked
    with Delta's, so m's rank grows by the round's rank each round (8 rounds of 2 sites at r 8: 128)
    while the update lr * m stays exactly what fedavgm does on whole models. nesterov keeps the same m
    and steps lr * (Delta + momentum * m): Delta's factors stacked with m's (B scaled by lr, and by lr *
    momentum), so its update has the round's rank plus m's. Whole tensors (peft's modules_to_save) take
    the same rule on their dense delta, mean - start."""
    whole = dict(whole or {})
    if optimizer.plain:
        return dict(factors), whole, None
    problem = optimizer.adapter_problem("exact")
    if problem:
        raise AdapterAggregateError(problem)
    if whole and start_whole is None:
        raise AdapterAggregateError(
            f"--start is needed: server optimizer {optimizer.name} steps the tensors the adapters train whole "
            f"({sorted(whole)[:2]}) from their values in the round's start model"
        )
    deltas = {key: value - start_whole[key] for key, value in whole.items()}
    momentum = {name: (b, a) for name, (b, a) in factors.items()}
    momentum.update({f"whole:{key}": (delta, None) for key, delta in deltas.items()})
    # A low-rank optimizer's kept state is its momentum m (the registry's ServerOptimizerEntry.low_rank).
    if optimizer.slots and state_in is not None:
        previous = _read_momentum(state_in, momentum)
        for name, (b, a) in list(momentum.items()):
            pb, pa = previous[name]
            if a is None:  # a dense whole tensor
                momentum[name] = (optimizer.momentum * pb + b, None)
            else:
                momentum[name] = (torch.cat([optimizer.momentum * pb, b], dim=1), torch.cat([pa, a], dim=0))
    if optimizer.entry.step == "nesterov":  # lr * (Delta + momentum * m), exactly, as stacked factors
        lr, mu = optimizer.lr, optimizer.momentum
        update = {
            name: (
                torch.cat([lr * factors[name][0], lr * mu * b], dim=1),
                torch.cat([factors[name][1], a], dim=0),
            )
            for name, (b, a) in momentum.items()
            if a is not None
        }
        stepped = {
            key: start_whole[key] + lr * (deltas[key] + mu * momentum[f"whole:{key}"][0]) for key in whole
        }
        return update, stepped, momentum
    update = {name: (optimizer.lr * b, a) for name, (b, a) in momentum.items() if a is not None}
    stepped = {key: start_whole[key] + optimizer.lr * momentum[f"whole:{key}"][0] for key in whole}
    return update, stepped, momentum if optimizer.slots else None


def _read_momentum(state_in: Path, momentum: Mapping) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """The previous round's momentum, entry by entry as `momentum` holds them: (B, A) factors of a
    module, or (dense tensor, None) of a whole tensor."""
    from safetensors.torch import load_file

    path = Path(state_in) / MOMENTUM_FILE
    if not path.is_file():
        raise AdapterAggregateError(f"--server-state-in: {path} not found (not an adapter server state)")
    tensors = load_file(path)
    result = {}
    for name, (b, a) in momentum.items():
        if a is None:
            dense = tensors.get(name)
            if dense is None or dense.shape != b.shape:
                raise AdapterAggregateError(
                    f"--server-state-in: {path} has no momentum of {name} {list(b.shape)}"
                )
            result[name] = (dense, None)
            continue
        pb, pa = tensors.get(f"{name}.B"), tensors.get(f"{name}.A")
        if pb is None or pa is None or pb.shape[0] != b.shape[0] or pa.shape[1] != a.shape[1]:
            raise AdapterAggregateError(
                f"--server-state-in: {path} has no momentum of {name} that fits this adapter "
                f"({b.shape[0]} x {a.shape[1]})"
            )
        result[name] = (pb, pa)
    known = {f"{n}.{part}" for n, (_, a) in momentum.items() if a is not None for part in "AB"}
    known |= {n for n, (_, a) in momentum.items() if a is None}
    unknown = sorted(set(tensors) - known)
    if unknown:
        raise AdapterAggregateError(
            f"--server-state-in: {path} holds entries this adapter lacks: {unknown[:3]}"
        )
    return result


def _start_whole(start: Path | None, whole: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The round's start model's values of the tensors the adapters train whole, in fp32."""
    from safetensors import safe_open

    if start is None or not whole:
        return None
    wanted = {_base_key(key): key for key in whole}
    found = {}
    for path in weight_files(start):
        with safe_open(str(path), "pt") as handle:
            for name in set(handle.keys()) & set(wanted):
                found[wanted[name]] = handle.get_tensor(name).float()
    missing = sorted(set(whole) - set(found))
    if missing:
        raise AdapterAggregateError(f"--start {start}: no tensor for {[_base_key(k) for k in missing]}")
    return found


def _write_server_state(out: Path, optimizer: ServerOptimizerOptions, momentum) -> dict:
    from safetensors.torch import save_file

    record = {"optimizer": optimizer.to_dict(), "rank": None}
    if momentum is not None:
        tensors = {}
        for name, (b, a) in momentum.items():
            if a is None:
                tensors[name] = b.contiguous()
            else:
                tensors[f"{name}.B"], tensors[f"{name}.A"] = b.contiguous(), a.contiguous()
        save_file(tensors, out / MOMENTUM_FILE, metadata={"format": "pt"})
        record["rank"] = max(b.shape[1] for b, a in momentum.values() if a is not None)
    write_json(out / STATE_RECORD, record)
    return record


# ---------------------------------------------------------------------------------------------------
# Merged into the base model


def _base_key(adapter_key: str) -> str:
    return adapter_key[len(PREFIX) :]


def plan_merge(base, ref: Adapter) -> dict[str, str]:
    """Base tensor name -> what replaces it ("lora:<module>" or "whole:<adapter key>"), checked against
    the base's names and shapes."""
    fan_in_fan_out = bool(ref.config.get("fan_in_fan_out"))
    plan, problems = {}, []
    for name, m in ref.modules.items():
        key = f"{name}.weight"
        info = base.tensors.get(key)
        expected = (m.fan_in, m.fan_out) if fan_in_fan_out else (m.fan_out, m.fan_in)
        if info is None:
            problems.append(f"{m.a_key}: the base has no tensor {key}")
        elif info.shape != expected:
            problems.append(
                f"{key}: {list(info.shape)} in the base, the adapter's update is {list(expected)}"
                + (" (fan_in_fan_out)" if fan_in_fan_out else "")
            )
        else:
            plan[key] = f"lora:{name}"
    for adapter_key in ref.whole:
        key = _base_key(adapter_key)
        info = base.tensors.get(key)
        if info is None:
            problems.append(f"{adapter_key}: the base has no tensor {key} (tied to the embeddings?)")
        elif info.shape != ref.tensors[adapter_key].shape:
            problems.append(
                f"{key}: {list(info.shape)} in the base, {list(ref.tensors[adapter_key].shape)} in the adapters"
            )
        else:
            plan[key] = f"whole:{adapter_key}"
    if problems:
        raise AdapterAggregateError(
            f"the adapters do not fit the base model {base.path}:\n  " + "\n  ".join(problems)
        )
    return plan


def read_base(path: str | Path):
    path = Path(path)
    who = f"--merge-into {path}"
    if not path.is_dir():
        raise AdapterAggregateError(f"{who}: model folder not found")
    if not (path / CONFIG_FILE).is_file():
        raise AdapterAggregateError(f"{who}: no config.json (not a save_pretrained folder)")
    base = read_weights("base", path, who)
    for name in COPIED_FILES:
        if (path / name).is_file():
            base.files[name] = (path / name).stat().st_size
    return base


def write_merged(
    out: Path,
    base,
    plan: Mapping[str, str],
    factors: Mapping,
    whole: Mapping,
    scale: float | None,
    ref: Adapter,
    max_shard_size: int,
) -> tuple[dict, dict]:
    """Stream the base through: adapted weights get scaling * B @ A (fp32, then the base's dtype), whole
    tensors are replaced, the rest copied. Returns the output's record and the base's record."""
    fan_in_fan_out = bool(ref.config.get("fan_in_fan_out"))
    tensors = [
        OutTensor(n, ST_DTYPES[base.tensors[n].dtype], base.tensors[n].shape, base.tensors[n].numel)
        for n in file_order(base)
    ]
    shards = plan_shards(tensors, max_shard_size)
    order = [t for shard in shards for t in shard]
    with contextlib.ExitStack() as stack:
        reader = FolderReader([base], [[[t.name] for t in order]], True)
        stack.callback(reader.shutdown)
        output = ShardedOutput(out, shards, True)
        stack.callback(output.shutdown)
        for k, t in enumerate(order):
            reader.reached(k)
            src = reader.get(0, t.name)
            slot, result = output.slot(t)
            what = plan.get(t.name, "")
            if what.startswith("lora:"):
                name = what[len("lora:") :]
                b, a = factors[name]
                s = ref.modules[name].scaling if scale is None else scale
                update = (b @ a).mul_(s)
                if fan_in_fan_out:
                    update = update.T
                # Not in place: src is the (copy-on-write) map of the base, whose bytes are being hashed.
                result.copy_(src.float() + update.reshape(-1))
            elif what.startswith("whole:"):
                result.copy_(whole[what[len("whole:") :]].reshape(-1))
            else:
                result.copy_(src)
            output.put(t, slot)
        record = output.finish()
        digests = reader.digests()
    base_digests = {name: d for (_, name), d in digests.items()}
    # The base was hashed while being read: compare with what its writer recorded, for free.
    verify_checksums(base.path, base_digests)
    record_checksums(out, {name: f["sha256"] for name, f in record["files"].items()})
    for name in COPIED_FILES:
        if (base.path / name).is_file():
            shutil.copyfile(base.path / name, out / name)
            os.chmod(out / name, 0o644)
    base_record = {
        "model_dir": str(base.path),
        "bytes": sum(base.files[f] for f in base.weight_files),
        "files": {f: {"bytes": base.files[f], "sha256": base_digests.get(f)} for f in base.weight_files},
    }
    return record, base_record


# ---------------------------------------------------------------------------------------------------
# The whole run


@dataclass(frozen=True)
class AdapterAggregateJob:
    """The folders of one adapter aggregate (the CLI's paths), apart from the options: the sites'
    adapters (a list, each site named by its folder, or site -> folder), the adapter folder `out_dir`,
    the sites' manifests (for weights by tokens), the base model to merge into and where the merged
    model goes, the server state read and written, and the round's start model."""

    adapters: Sequence[str | Path] | Mapping[str, str | Path]
    out_dir: str | Path
    manifests: Mapping[str, str | Path] | None = None
    merge_into: str | Path | None = None
    merged_out: str | Path | None = None
    server_state_in: str | Path | None = None
    server_state_out: str | Path | None = None
    start: str | Path | None = None


def aggregate_adapters(job: AdapterAggregateJob, options: AggregateOptions) -> dict:
    """Aggregate the PEFT LoRA folders `job.adapters` into the adapter folder `out_dir` as `options` (the
    aggregate section) say: adapter_merge (the mode), weights (tokens from `manifests`, uniform, or site
    -> number; normalised here), the server optimizer, dtype (of the adapter's tensors; auto: as the
    first site's) and max_shard_size. With `merge_into` (a base model folder) also into a full model at
    `merged_out` (default out_dir/merged). A server optimizer other than plain FedAvg (sgd, fedavgm or
    nesterov, exact mode) turns the merged update into the round's step (`server_factors`), its momentum
    read from `server_state_in` (none in the first round) and written to `server_state_out`; tensors the
    sites train whole step from their values in `start`, the round's start model (each a field of
    `job`). Returns aggregate.json."""
    started = time.perf_counter()
    adapters, out_dir, manifests, start = job.adapters, job.out_dir, job.manifests, job.start
    merge_into, merged_out = job.merge_into, job.merged_out
    server_state_in, server_state_out = job.server_state_in, job.server_state_out
    mode, dtype, optimizer = options.adapter_merge, options.dtype, options.server_optimizer
    _check_arguments(out_dir, merge_into, merged_out)
    problem = optimizer.adapter_problem(mode)
    if problem:
        raise AdapterAggregateError(problem)
    state_path = Path(server_state_in) if server_state_in else None
    if state_path is not None:
        read_state_record(state_path, optimizer, AdapterAggregateError)
    pairs = _site_folders(adapters)
    check_same_base(dict(pairs), start if start is not None else merge_into)
    shard_limit = parse_size(options.max_shard_size)
    loaded = [read_adapter(site, path) for site, path in pairs]
    input_digests = [_verified_digests(a) for a in loaded]
    tensors = [_load(a) for a in loaded]
    # Every value of every site's adapter, before any is used (aggregate.non_finite, as for whole models).
    left_out = _non_finite(loaded, tensors, options, _round_label(loaded, out_dir))
    if left_out:
        kept = [i for i, a in enumerate(loaded) if a.site not in {e["site"] for e in left_out}]
        loaded, tensors, input_digests = ([x[i] for i in kept] for x in (loaded, tensors, input_digests))
        manifests = {
            site: path
            for site, path in (manifests or {}).items()
            if site not in {e["site"] for e in left_out}
        }
        if isinstance(options.weights, Mapping):
            options = dataclasses.replace(
                options, weights={s: w for s, w in options.weights.items() if s in {a.site for a in loaded}}
            )
    source, raw = _weights(options.weights, [a.site for a in loaded], manifests)
    weighting = {"source": source, "raw": raw, "normalised": normalised(raw)}
    warnings = check_adapters(loaded, mode)
    ref = loaded[0]
    base = plan = None
    if merge_into is not None:
        base = read_base(merge_into)
        plan = plan_merge(base, ref)

    n_weights = [weighting["normalised"][a.site] for a in loaded]
    factors, whole, rank, scale = aggregate_factors(loaded, tensors, n_weights, mode)
    start_whole = None if optimizer.plain else _start_whole(Path(start) if start else None, whole)
    factors, whole, momentum = server_factors(factors, optimizer, state_path, whole, start_whole)
    rank = max(b.shape[1] for b, _ in factors.values()) if mode == "exact" else rank
    config = adapter_config(ref, mode, rank)
    out_dir = Path(out_dir)
    merged_dir = Path(merged_out) if merged_out is not None else out_dir / "merged"
    with contextlib.ExitStack() as stack:
        tmp, merged_tmp = _output_folders(stack, out_dir, merged_dir if base is not None else None)
        state_tmp = stack.enter_context(atomic_dir(Path(server_state_out))) if server_state_out else None
        _write_adapter(tmp, ref, config, factors, whole, dtype)
        digests = {ADAPTER_WEIGHTS: sha256_file(tmp / ADAPTER_WEIGHTS)}
        record_checksums(tmp, digests)
        record = {
            "method": f"lora_{mode}",
            "mode": mode,
            "weights": weighting,
            "dtype": dtype,
            "inputs": [_input_record(a, d) for a, d in zip(loaded, input_digests, strict=True)],
            "output": _output_record(tmp, out_dir, config, loaded, mode, rank, digests),
            "merged": None,
            "warnings": warnings,
            "server_optimizer": optimizer.to_dict(),
        }
        if left_out:
            record["left_out"] = left_out
        if state_tmp is not None:
            record["server_state_out"] = {
                "dir": str(server_state_out),
                **_write_server_state(state_tmp, optimizer, momentum),
            }
        if base is not None:
            merged, base_record = write_merged(
                merged_tmp, base, plan, factors, whole, scale, ref, shard_limit
            )
            record["merged"] = {"model_dir": str(merged_dir), **_merge_record(plan, base_record, merged)}
        # Bytes moved: the adapters (and the base) read, the adapter (and the merged model) written.
        into = record["merged"] or {"base": {"bytes": 0}, "bytes": 0}
        record["bytes_read"] = sum(a.files[ADAPTER_WEIGHTS] for a in loaded) + into["base"]["bytes"]
        record["bytes_written"] = record["output"]["bytes"] + into["bytes"]
        record["wall_time_s"] = round(time.perf_counter() - started, 3)
        for folder in (tmp, merged_tmp):
            if folder is not None:
                write_json(folder / RECORD, record)
    for warning in warnings:
        _log(f"warning: {warning}")
    _log(
        f"{mode} of {len(loaded)} adapters ({', '.join(_ranks(a) for a in loaded)}) -> r={rank}: {out_dir}"
        + (f"; merged into {merge_into}: {merged_dir}" if base is not None else "")
        + f" in {record['wall_time_s']:.1f} s"
    )
    return record


def _non_finite(
    loaded: Sequence[Adapter], tensors, options: AggregateOptions, round_label: str
) -> list[dict]:
    """The sites whose adapter holds NaN or an infinity: an error naming the first (site, tensor, round),
    or with aggregate.non_finite leave_out their record (at least one site must stay)."""
    left_out = []
    for adapter, values in zip(loaded, tensors, strict=True):
        name = next((n for n, t in values.items() if t.is_floating_point() and not _finite(t)), None)
        if name is None:
            continue
        problem = (
            f"{round_label}: site {adapter.site}: tensor {name} of its adapter holds NaN or infinite values"
        )
        if options.non_finite != "leave_out":
            raise AdapterAggregateError(
                f"{problem}; the site's training diverged or its adapter was damaged, and nothing was merged. "
                "Retrain it, or set aggregate.non_finite: leave_out to merge the round without it"
            )
        _log(f"warning: {problem}: merging the round without site {adapter.site}")
        left_out.append({"site": adapter.site, "tensor": name, "reason": "non-finite values"})
    if len(left_out) == len(loaded):
        raise AdapterAggregateError(
            f"{round_label}: every site's adapter holds NaN or infinite values "
            f"({', '.join(e['site'] for e in left_out)}): nothing is left to merge"
        )
    return left_out


def _output_folders(stack: contextlib.ExitStack, out_dir: Path, merged_dir: Path | None):
    """(adapter folder, merged model folder or None), each to appear by one rename when `stack` closes;
    a merged model inside out_dir shares its rename."""
    tmp = stack.enter_context(atomic_dir(out_dir))
    if merged_dir is None:
        return tmp, None
    inside = merged_dir.resolve().parent == out_dir.resolve()
    merged_tmp = tmp / merged_dir.name if inside else stack.enter_context(atomic_dir(merged_dir))
    merged_tmp.mkdir(exist_ok=True)
    return tmp, merged_tmp


def _verified_digests(adapter: Adapter) -> dict[str, str]:
    """The sha256 of an adapter's files; adapters written by fedtune's train carry
    fedtune-checksums.json and must match it, others (peft's own) pass."""
    digests = {name: sha256_file(adapter.path / name) for name in adapter.files}
    verify_checksums(adapter.path, {ADAPTER_WEIGHTS: digests[ADAPTER_WEIGHTS]})
    return digests


def _check_arguments(out_dir, merge_into, merged_out) -> None:
    """What the paths need of each other (the options were checked when they were made)."""
    if merged_out is not None and merge_into is None:
        raise AdapterAggregateError("--merged-output needs --merge-into (the base model to merge into)")
    if merged_out is not None and Path(merged_out).resolve() == Path(out_dir).resolve():
        raise AdapterAggregateError(f"--merged-output {merged_out} is the adapter's --out folder")


def _site_folders(adapters: Sequence[str | Path] | Mapping[str, str | Path]) -> list[tuple[str, Path]]:
    """(site, folder) pairs; a plain list names each site by its folder. The same folder twice is a
    copy-paste slip that would count one site twice."""
    pairs = list(adapters.items()) if isinstance(adapters, Mapping) else [(str(p), p) for p in adapters]
    if not pairs:
        raise AdapterAggregateError("no adapters given (--adapters DIR ...)")
    seen: dict[Path, str] = {}
    for site, path in pairs:
        real = Path(path).resolve()
        if real in seen:
            raise AdapterAggregateError(f"{seen[real]} and {site} are the same adapter folder {path}")
        seen[real] = site
    return pairs


def _weights(spec, sites: Sequence[str], manifests: Mapping[str, str | Path] | None):
    """(source, raw weight per site), read as the merge of whole models reads aggregate.weights."""
    manifests = {site: Path(p) for site, p in (manifests or {}).items()}
    unknown = sorted(set(manifests) - set(sites))
    if unknown:
        raise AdapterAggregateError(f"--manifest: sites {unknown} have no adapter")
    tokens = {
        site: manifest_tokens(site, path, error=AdapterAggregateError) for site, path in manifests.items()
    }
    return resolve_weights(spec, sites, tokens, error=AdapterAggregateError)


def _input_record(adapter: Adapter, digests: Mapping[str, str]) -> dict:
    return {
        "site": adapter.site,
        "adapter_dir": str(adapter.path),
        "r": sorted({m.r for m in adapter.modules.values()}),
        "lora_alpha": adapter.config.get("lora_alpha"),
        "use_rslora": bool(adapter.config.get("use_rslora")),
        "scaling": sorted({m.scaling for m in adapter.modules.values()}),
        "bytes": adapter.files[ADAPTER_WEIGHTS],
        "files": {name: {"bytes": size, "sha256": digests[name]} for name, size in adapter.files.items()},
    }


def _output_record(tmp: Path, out_dir: Path, config: dict, loaded, mode: str, rank: int, digests) -> dict:
    ref = loaded[0]
    # Exact mode pads the modules whose summed rank is below the adapter's r (aggregate_factors).
    padded = (
        sum(1 for name in ref.modules if sum(a.modules[name].r for a in loaded) < rank)
        if mode == "exact"
        else 0
    )
    size = (tmp / ADAPTER_WEIGHTS).stat().st_size
    return {
        "adapter_dir": str(out_dir),
        "r": rank,
        "lora_alpha": config["lora_alpha"],
        "use_rslora": bool(config.get("use_rslora")),
        "modules": len(ref.modules),
        "padded_modules": padded,
        "whole_tensors": ref.whole,
        "bytes": size,
        "files": {ADAPTER_WEIGHTS: {"bytes": size, "sha256": digests[ADAPTER_WEIGHTS]}},
    }


def _merge_record(plan: Mapping[str, str], base_record: dict, merged: dict) -> dict:
    """What a merge into the base wrote: the base read, the tensors it changed, the output's files."""
    return {
        "base": base_record,
        "adapted_tensors": sum(v.startswith("lora:") for v in plan.values()),
        "replaced_tensors": sum(v.startswith("whole:") for v in plan.values()),
        **merged,
    }


def merge_adapter(
    adapter_dir: str | Path, base_dir: str | Path, out_dir: str | Path, *, max_shard_size: str | int = "5GB"
) -> dict:
    """The full model base + the update of one adapter (the round's aggregate): what every cluster makes
    for itself from the adapter that crossed, so that all start the next round from the same weights."""
    started = time.perf_counter()
    adapter = read_adapter("aggregate", adapter_dir)
    check_adapters([adapter], "exact")
    base = read_base(base_dir)
    plan = plan_merge(base, adapter)
    verify_checksums(adapter.path, {ADAPTER_WEIGHTS: sha256_file(adapter.path / ADAPTER_WEIGHTS)})
    # As written, at weight 1: the aggregate's scaling stays in its config (1 for an exact aggregate).
    tensors = _load(adapter)
    factors = {
        name: (tensors[m.b_key].float(), tensors[m.a_key].float()) for name, m in adapter.modules.items()
    }
    whole = {key: tensors[key].float() for key in adapter.whole}
    with atomic_dir(Path(out_dir)) as tmp:
        merged, base_record = write_merged(
            tmp, base, plan, factors, whole, None, adapter, parse_size(max_shard_size)
        )
        record = {
            "method": "lora_merge",
            "adapter_dir": str(adapter_dir),
            **_merge_record(plan, base_record, merged),
            "wall_time_s": round(time.perf_counter() - started, 3),
        }
        write_json(tmp / RECORD, record)
    _log(f"merged {adapter_dir} into {base_dir}: {out_dir} in {record['wall_time_s']:.1f} s")
    return record


def _log(message: str) -> None:
    print(f"[adapter_aggregate] {message}", file=sys.stderr, flush=True)


def _adapter_arg(item: str) -> tuple[str, str]:
    """SITE=DIR, or DIR (then the folder names the site in the record)."""
    site, sep, path = item.partition("=")
    if sep and site and path and "/" not in site:
        return site, path
    return item, item


@cli.entry("fedtune.aggregate.adapters", offline=True)
def main(argv: Sequence[str] | None = None) -> None:
    parser = cli.parser(
        "fedtune.aggregate.adapters",
        "Aggregate the sites' PEFT LoRA adapters into one adapter (and optionally a full model).",
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--adapters", nargs="+", metavar="[SITE=]DIR", help="PEFT adapter folders to aggregate")
    what.add_argument(
        "--merge",
        metavar="ADAPTER_DIR",
        help="merge this one adapter into --base, writing a full model to --out",
    )
    parser.add_argument("--base", metavar="MODEL_DIR", help="the model --merge adds the adapter's update to")
    cli.add_out(parser, "folder of the aggregate adapter, or of the --merge model (atomic)")
    cli.add_options(
        parser, "the aggregate section (adapter_merge, weights, server_optimizer, max_shard_size, dtype)"
    )
    parser.add_argument(
        "--manifest", nargs="+", default=[], metavar="SITE=PATH", help="site manifests, for weights tokens"
    )
    parser.add_argument(
        "--merge-into", default=None, metavar="BASE_MODEL_DIR", help="also write base + aggregate update"
    )
    parser.add_argument(
        "--merged-output",
        default=None,
        metavar="DIR",
        help="folder of the merged model (default: OUT/merged)",
    )
    parser.add_argument(
        "--server-state-in",
        default=None,
        metavar="DIR",
        help="the previous round's server state (fedavgm, nesterov)",
    )
    parser.add_argument(
        "--start", default=None, metavar="MODEL_DIR", help="the round's start model (for whole tensors' step)"
    )
    parser.add_argument(
        "--server-state-out", default=None, metavar="DIR", help="where this round's server state goes"
    )
    args = parser.parse_args(argv)
    options = AggregateOptions.from_json(args.options)
    if args.merge:
        if not args.base:
            raise AdapterAggregateError("--merge needs --base (the model to add the adapter's update to)")
        merge_adapter(args.merge, args.base, args.out, max_shard_size=options.max_shard_size)
        return
    job = AdapterAggregateJob(
        _adapter_pairs(args.adapters),
        args.out,
        manifests=parse_pairs(args.manifest, "--manifest"),
        merge_into=args.merge_into,
        merged_out=args.merged_output,
        server_state_in=args.server_state_in,
        server_state_out=args.server_state_out,
        start=args.start,
    )
    aggregate_adapters(job, options)


def _adapter_pairs(items: Sequence[str]) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for item in items:
        site, path = _adapter_arg(item)
        if site in pairs:
            raise AdapterAggregateError(f"--adapters: {site} given twice")
        pairs[site] = path
    return pairs


if __name__ == "__main__":
    sys.exit(main())
