"""Bytes a LoRA adapter moves per site and round, and the full model's, from a HF model config alone.

The dry run states these before anything is downloaded, so this module reads only the config's numbers
(hidden size, layers, heads, key-value heads, intermediate size, vocabulary) and imports neither torch
nor transformers. One adapted linear layer of fan-in `in` and fan-out `out` holds A (r x in) and
B (out x r): r (in + out) numbers. Two layouts are known: the Llama family (llama, mistral, qwen2,
gemma, ...: q/k/v/o_proj, gate/up/down_proj) and GPT-2 (c_attn, c_proj, c_fc)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence

from fedtune.core.options import UserError, thaw

ITEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "float8": 1}
# peft's get_peft_model(autocast_adapter_dtype=True), its default, keeps LoRA weights in fp32 even on a
# bf16 base, and save_pretrained writes them as they are: fp32 is what a site usually sends.
ADAPTER_DTYPE = "float32"
# The peft shorthand for every linear layer but the output layer.
ALL_LINEAR = "all-linear"


class AdapterSizeError(UserError):
    """A model config or adapter config whose sizes cannot be worked out: names the key."""


def _need(config: Mapping, *keys: str) -> int:
    for key in keys:
        value = config.get(key)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise AdapterSizeError(f"model config: {key} = {value!r} is not a positive integer")
            return value
    raise AdapterSizeError(f"model config: {' or '.join(keys)} missing")


def _item_bytes(dtype: str, where: str) -> int:
    if dtype not in ITEM_BYTES:
        raise AdapterSizeError(f"{where}: dtype {dtype!r} is not one of {', '.join(ITEM_BYTES)}")
    return ITEM_BYTES[dtype]


def _gpt2(config: Mapping) -> bool:
    return config.get("model_type") == "gpt2"


def layer_prefix(config: Mapping, layer: int) -> str:
    """The module path of a decoder layer as the transformers model names it (peft's module keys)."""
    return f"transformer.h.{layer}" if _gpt2(config) else f"model.layers.{layer}"


def linear_layers(config: Mapping) -> list[tuple[str, int, int]]:
    """(name inside a decoder layer, fan-in, fan-out) of every linear layer of one decoder layer."""
    if _gpt2(config):
        h = _need(config, "n_embd", "hidden_size")
        inner = config.get("n_inner") or 4 * h
        return [
            ("attn.c_attn", h, 3 * h),
            ("attn.c_proj", h, h),
            ("mlp.c_fc", h, inner),
            ("mlp.c_proj", inner, h),
        ]
    h = _need(config, "hidden_size")
    heads = _need(config, "num_attention_heads")
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    inter = _need(config, "intermediate_size")
    return [
        ("self_attn.q_proj", h, heads * head_dim),
        ("self_attn.k_proj", h, kv * head_dim),
        ("self_attn.v_proj", h, kv * head_dim),
        ("self_attn.o_proj", heads * head_dim, h),
        ("mlp.gate_proj", h, inter),
        ("mlp.up_proj", h, inter),
        ("mlp.down_proj", inter, h),
    ]


def num_layers(config: Mapping) -> int:
    return (
        _need(config, "n_layer", "num_hidden_layers") if _gpt2(config) else _need(config, "num_hidden_layers")
    )


def _classifier(config: Mapping) -> bool:
    return any(a.endswith("ForSequenceClassification") for a in config.get("architectures") or ())


def _num_labels(config: Mapping) -> int:
    if config.get("id2label"):
        return len(config["id2label"])
    return config.get("num_labels") or 2


def _targeted(name: str, targets: str | Sequence[str]) -> bool:
    """peft's rule (check_target_module_exists): a list entry matches the module path or its tail after a
    dot; a string other than all-linear is a regular expression over the whole path."""
    if isinstance(targets, str):
        if targets == ALL_LINEAR:
            return True
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def pattern_value(pattern: Mapping[str, int | float], name: str, default):
    """peft's get_pattern_key: the first pattern key that matches the end of the module path."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def adapted_modules(
    config: Mapping, r: int, target_modules: str | Sequence[str] | None, **lora
) -> list[dict]:
    """Every adapted module of the model: {name, in, out, r}. `lora` may hold peft's rank_pattern and
    layers_to_transform."""
    if target_modules is None:
        # peft's default for these models (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING).
        target_modules = ["c_attn"] if _gpt2(config) else ["q_proj", "v_proj"]
    if not target_modules:
        raise AdapterSizeError("adapter config: target_modules is empty")
    rank_pattern = lora.get("rank_pattern") or {}
    layers = lora.get("layers_to_transform")
    if isinstance(layers, int):
        layers = [layers]
    modules = []
    for layer in range(num_layers(config)):
        if layers is not None and layer not in layers:
            continue
        for name, fan_in, fan_out in linear_layers(config):
            path = f"{layer_prefix(config, layer)}.{name}"
            if _targeted(path, target_modules):
                rank = pattern_value(rank_pattern, path, r)
                modules.append({"name": path, "in": fan_in, "out": fan_out, "r": rank})
    if not modules:
        raise AdapterSizeError(
            f"adapter config: target_modules {target_modules!r} match no linear layer of a "
            f"{config.get('model_type', 'llama-like')} model (layer names: "
            f"{', '.join(n for n, _, _ in linear_layers(config))})"
        )
    return modules


def _saved_module_params(config: Mapping, names: Iterable[str]) -> int:
    """Parameters of peft's modules_to_save (trained and sent whole): heads and embeddings."""
    h = _need(config, "n_embd", "hidden_size") if _gpt2(config) else _need(config, "hidden_size")
    vocab = _need(config, "vocab_size")
    sizes = {
        "lm_head": vocab * h,
        "embed_tokens": vocab * h,
        "wte": vocab * h,
        "score": _num_labels(config) * h,
        # peft adds both `classifier` and `score` for classifiers; Llama and GPT-2 have only `score`.
        "classifier": 0,
    }
    short_names = {name.rsplit(".", 1)[-1] for name in names}
    unknown = sorted(short_names - set(sizes))
    if unknown:
        raise AdapterSizeError(
            f"adapter config: modules_to_save {unknown}: size unknown (known: {', '.join(sizes)})"
        )
    return sum(sizes[name] for name in short_names)


def adapter_bytes(
    config: Mapping,
    r: int,
    target_modules: str | Sequence[str],
    dtype: str = ADAPTER_DTYPE,
    *,
    modules_to_save: Iterable[str] = (),
    **lora,
) -> int:
    """Bytes of one LoRA adapter of rank r on `target_modules` of the model `config` describes."""
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise AdapterSizeError(f"adapter config: r = {r!r} is not a positive integer")
    numbers = sum(m["r"] * (m["in"] + m["out"]) for m in adapted_modules(config, r, target_modules, **lora))
    numbers += _saved_module_params(config, set(modules_to_save))
    return numbers * _item_bytes(dtype, "adapter")


def model_parameters(config: Mapping) -> int:
    """Parameters of the full model: embeddings, decoder layers, final norm, output layer or head."""
    vocab = _need(config, "vocab_size")
    layers = num_layers(config)
    linear = linear_layers(config)
    weights = sum(fan_in * fan_out for _, fan_in, fan_out in linear)
    if _gpt2(config):
        h = _need(config, "n_embd", "hidden_size")
        # Conv1D layers have biases; two LayerNorms of weight and bias per layer, one at the end.
        per_layer = weights + sum(fan_out for _, _, fan_out in linear) + 4 * h
        total = vocab * h + config.get("n_positions", 1024) * h + layers * per_layer + 2 * h
        tied = True
    else:
        h = _need(config, "hidden_size")
        biases = 0
        if config.get("attention_bias") or config.get("model_type") == "qwen2":
            # qwen2 has q/k/v biases without saying so; llama's attention_bias adds o_proj's too.
            attention = linear[:3] if config.get("model_type") == "qwen2" else linear[:4]
            biases += sum(fan_out for _, _, fan_out in attention)
        if config.get("mlp_bias"):
            biases += sum(fan_out for _, _, fan_out in linear[4:])
        per_layer = weights + biases + 2 * h  # two RMSNorms
        total = vocab * h + layers * per_layer + h
        tied = bool(config.get("tie_word_embeddings", False))
    if _classifier(config):
        total += _num_labels(config) * h
    elif not tied:
        total += vocab * h
    return total


def config_dtype(config: Mapping) -> str:
    """The dtype a model config records (transformers 5 writes `dtype`, older versions `torch_dtype`)."""
    return config.get("dtype") or config.get("torch_dtype") or "float32"


def model_bytes(config: Mapping, dtype: str | None = None) -> int:
    """Bytes of the full model's weights, in `dtype` or the dtype its config records."""
    dtype = dtype or config_dtype(config)
    return model_parameters(config) * _item_bytes(dtype, "model")


def transfer_bytes(
    model_config: Mapping,
    adapter_config: Mapping,
    *,
    adapter_dtype: str = ADAPTER_DTYPE,
    model_dtype: str | None = None,
) -> dict:
    """What one site sends per round with LoRA (peft's adapter_config: r, target_modules, and
    rank_pattern, layers_to_transform, modules_to_save when set) against a full model:
    {adapter_bytes, model_bytes, ratio, adapted_modules, parameters}. Each round moves the adapter up
    (site -> aggregator) and, unless the sites merge it into their base, down again."""
    lora = {k: adapter_config.get(k) for k in ("rank_pattern", "layers_to_transform")}
    adapter = adapter_bytes(
        model_config,
        adapter_config.get("r", 8),
        adapter_config.get("target_modules"),
        adapter_dtype,
        modules_to_save=adapter_config.get("modules_to_save") or (),
        **lora,
    )
    full = model_bytes(model_config, model_dtype)
    modules = adapted_modules(
        model_config, adapter_config.get("r", 8), adapter_config.get("target_modules"), **lora
    )
    return {
        "adapter_bytes": adapter,
        "adapter_dtype": adapter_dtype,
        "model_bytes": full,
        "model_dtype": model_dtype or config_dtype(model_config),
        "ratio": adapter / full,
        "adapted_modules": len(modules),
        "parameters": model_parameters(model_config),
    }


def describe(sizes: Mapping) -> str:
    """One line for the dry run: adapter and model sizes and their ratio."""

    def human(n: int) -> str:
        unit = min(int(math.log(max(n, 1), 1000)), 4)
        return f"{n / 1000**unit:.1f} {['B', 'kB', 'MB', 'GB', 'TB'][unit]}"

    return (
        f"adapter {human(sizes['adapter_bytes'])} ({sizes['adapter_dtype']}) per site per round vs "
        f"full model {human(sizes['model_bytes'])} ({sizes['model_dtype']}): {100 * sizes['ratio']:.2f}%"
    )


def known_model_config(run, base_dir) -> tuple[dict | None, str]:
    """The base model's config.json values where this machine has them without a download, and where
    they came from: the run's downloaded base, the config's architecture (source init), a local folder,
    or the Hugging Face cache of an earlier download (read offline)."""
    import json
    from pathlib import Path

    model = run.model
    downloaded = Path(base_dir) / "config.json"
    if downloaded.is_file():
        return json.loads(downloaded.read_text()), str(downloaded)
    if model.source == "init":
        config = thaw(model.architecture)
        config.setdefault("vocab_size", model.tokenizer.vocab_size)
        return config, "model.architecture"
    if model.source == "gguf":
        from fedtune.core.models import gguf_model_config

        return gguf_model_config(model.path), model.path
    if model.source == "local":
        path = Path(model.path) / "config.json"
        return (json.loads(path.read_text()), str(path)) if path.is_file() else (None, str(path))
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model.name, "config.json", revision=model.revision)
    except Exception:  # an unreadable cache is only a missing line in the dry run
        cached = None
    if isinstance(cached, str):
        return json.loads(Path(cached).read_text()), f"the Hugging Face cache ({model.name})"
    return None, model.name


def transfer_lines(run, base_dir) -> list[str]:
    """What each site's adapter moves per round, for the dry run; one line per site."""
    model_config, origin = known_model_config(run, base_dir)
    if model_config is None:
        return [
            f"adapters: the bytes each round moves follow from {origin}'s config.json, not on this machine "
            f"yet; the dry run prints them after the download (or `hf download {origin} config.json`)"
        ]
    dtype = run.model.dtype
    lines = []
    for name, site in run.sites.items():
        adapter = site.train.adapter
        targets = adapter.target_modules
        lora = {"r": adapter.r, "target_modules": list(targets) if isinstance(targets, tuple) else targets}
        if adapter.modules_to_save:
            lora["modules_to_save"] = list(adapter.modules_to_save)
        sizes = transfer_bytes(model_config, lora, adapter_dtype=dtype, model_dtype=dtype)
        lines.append(f"adapters: site {name}: {describe(sizes)} (shapes from {origin})")
    return lines


# Host memory of a job that loads one model (the evaluations): its weights in the dtype they are loaded in,
# a quarter more (the checkpoint's pages while they are read, allocator slack), and a fixed part for
# Python, torch, the CUDA context, the tokenizer and the test texts.
LOAD_FACTOR = 1.25
FIXED_MB = 4096
MB = 2**20


def load_mem_mb(weights_bytes: int) -> int:
    """Slurm --mem (MB = MiB) for a job that loads a model of `weights_bytes` bytes."""
    return math.ceil(weights_bytes * LOAD_FACTOR / MB) + FIXED_MB


def evaluation_mem_mb(config: Mapping, dtype: str | None = None) -> int:
    """--mem of an evaluation job of the model `config` describes, loaded in `dtype` (else its own)."""
    return load_mem_mb(model_bytes(config, dtype))


def weights_mem_mb(model_dir, dtype: str | None, config: Mapping | None) -> int | None:
    """The same from the safetensors files of a downloaded model (for a layout the config formula does not
    know): their bytes, scaled from the dtype they are stored in to `dtype`. None without such files."""
    from pathlib import Path

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    stored = config_dtype(config or {})
    size = sum(f.stat().st_size for f in files)
    if dtype and stored in ITEM_BYTES and dtype in ITEM_BYTES:
        size = size * ITEM_BYTES[dtype] // ITEM_BYTES[stored]
    return load_mem_mb(size)


# The exchange's compress and decode stream one tensor at a time but hold several fp32 copies of it (the
# site's, the start's, the update, the residual, the rebuilt tensor and the encoded parts). Measured on
# Llama-2-7B's shape (largest tensor 131M parameters), 2026-11-28, one H200 machine: compress 4,824 MB
# private, decode 1,047 MB; the flat 4,000 MB the rules asked for until then would have stopped compress.
TENSOR_COPIES = 10
EXCHANGE_FIXED_MB = 1024
EXCHANGE_MIN_MB = 4000


def largest_tensor_parameters(config: Mapping) -> int:
    """Parameters of the model's largest tensor: the embedding (or output) matrix or a linear layer."""
    vocab = _need(config, "vocab_size")
    hidden = _need(config, "n_embd", "hidden_size") if _gpt2(config) else _need(config, "hidden_size")
    return max(vocab * hidden, *(fan_in * fan_out for _, fan_in, fan_out in linear_layers(config)))


def exchange_mem_mb(config: Mapping | None) -> int:
    """--mem of a compress or decode job of the model `config` describes (EXCHANGE_MIN_MB without one)."""
    if config is None:
        return EXCHANGE_MIN_MB
    copies = TENSOR_COPIES * largest_tensor_parameters(config) * ITEM_BYTES["float32"]
    return max(EXCHANGE_MIN_MB, math.ceil(copies / MB) + EXCHANGE_FIXED_MB)
