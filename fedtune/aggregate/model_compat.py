"""Whether site models can be merged: the same tensor names, shapes and dtypes, the same architecture in
config.json, the same tokenizer. Averaging models that do not line up gives a model that loads and is
garbage, so every difference is listed before anything is read."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from fedtune.core.safetensors_stream import WeightFolder, listing

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


def _tokenizer_differences(ref: WeightFolder, other: WeightFolder) -> list[str]:
    diffs = []
    for name in TOKENIZER_FILES:
        a, b = ref.path / name, other.path / name
        if not a.is_file() and not b.is_file():
            continue
        if a.is_file() != b.is_file():
            where = ref.label if a.is_file() else other.label
            diffs.append(f"{name} exists only at {where}")
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


def _config_differences(ref: WeightFolder, other: WeightFolder) -> list[str]:
    a = json.loads((ref.path / CONFIG_FILE).read_text(encoding="utf-8"))
    b = json.loads((other.path / CONFIG_FILE).read_text(encoding="utf-8"))
    keys = sorted(k for k in (set(a) | set(b)) - CONFIG_IGNORED if a.get(k) != b.get(k))
    return [f"{k}={b.get(k, '(absent)')!r} vs {a.get(k, '(absent)')!r}" for k in keys]


FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}


def compatibility_problems(models: Sequence[WeightFolder], start: WeightFolder | None = None) -> list[str]:
    """Every way a site differs from the first one, one line each. The start model must hold the same
    tensors (its config and tokenizer files may have been saved by other code)."""
    ref = models[0]
    problems = []
    for other in [*models[1:], *([start] if start is not None else [])]:
        who = f"{other.label} vs {ref.label}"
        only_ref = sorted(set(ref.tensors) - set(other.tensors))
        only_other = sorted(set(other.tensors) - set(ref.tensors))
        if only_ref:
            problems.append(f"{who}: tensor names differ: missing at {other.site}: {listing(only_ref)}")
        if only_other:
            problems.append(f"{who}: tensor names differ: only at {other.site}: {listing(only_other)}")
        common = sorted(set(ref.tensors) & set(other.tensors))
        shapes = [
            f"{n} {list(other.tensors[n].shape)} vs {list(ref.tensors[n].shape)}"
            for n in common
            if other.tensors[n].shape != ref.tensors[n].shape
        ]
        if shapes:
            problems.append(f"{who}: tensor shapes differ: {listing(shapes)}")
        # The start model may hold another float dtype (a hub model in fp16, sites exporting bf16): task
        # vectors are taken in fp32, so only a site must match the first site exactly.
        dtypes = [
            f"{n} {other.tensors[n].dtype} vs {ref.tensors[n].dtype}"
            for n in common
            if other.tensors[n].dtype != ref.tensors[n].dtype
            and not (other is start and {other.tensors[n].dtype, ref.tensors[n].dtype} <= FLOAT_DTYPES)
        ]
        if dtypes:
            problems.append(f"{who}: tensor dtypes differ: {listing(dtypes)}")
        if other is start:
            continue
        config = _config_differences(ref, other)
        if config:
            problems.append(f"{who}: config architecture differs (config.json): {listing(config)}")
        tokenizer = _tokenizer_differences(ref, other)
        if tokenizer:
            problems.append(f"{who}: tokenizer differs: {'; '.join(tokenizer)}")
    return problems
