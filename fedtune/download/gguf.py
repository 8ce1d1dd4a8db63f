"""A base model from a local GGUF file (model.source: gguf): converted once, at download, into a Hugging
Face folder (safetensors + tokenizer) that every later stage loads like any other.

transformers (with the `gguf` package) dequantizes a GGUF checkpoint into a float model, but refuses to
save it ("quantized with gguf and is not serializable"). So the weights move into a plain model built
from the same config without its `quantization_config`, which saves normally. The fresh model is built
on the meta device and takes the dequantized tensors by assignment, so the conversion holds one float
copy of the weights, not two (peak for SmolLM2-135M: docs/design.md, "GGUF base models").

Before anything heavy, the file's header is read (it is memory-mapped, not loaded): an architecture
transformers cannot map, or a quantization type the gguf package cannot dequantize, is a GGUFError
naming the file and what is unsupported."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from fedtune.core.checksums import sha256_file
from fedtune.core.options import UserError, torch_dtype


class GGUFError(UserError):
    """A GGUF file that cannot become a base model: the message names the file and what is unsupported."""


RENAMED = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2",
           "t5encoder": "t5"}  # fmt: skip
INSTALL_HINT = "install it with `pip install -e '.[gguf]'` (scripts/setup-env --gguf)"


def _versions() -> dict[str, str]:
    found = {}
    for package in ("gguf", "transformers"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "missing"
    return found


def _reader(path: Path):
    try:
        from gguf import GGUFReader
    except ImportError:
        raise GGUFError(f"{path}: reading a GGUF file needs the gguf package; {INSTALL_HINT}") from None
    if not path.is_file():
        raise GGUFError(f"model.path: GGUF file not found: {path}")
    try:
        return GGUFReader(path)
    except (ValueError, OSError) as error:
        raise GGUFError(f"{path}: not a readable GGUF file: {error}") from None


def _field(reader, key: str):
    from transformers.modeling_gguf_pytorch_utils import read_field

    values = read_field(reader, key)
    return values[0] if len(values) == 1 else (values or None)


def _dequantizable() -> set:
    """The tensor types the installed gguf package can turn back into floats (gguf.dequantize's own
    cases: F32 and F16, and every type with a quantizer class)."""
    from gguf import GGMLQuantizationType, quants

    return {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *quants._type_traits}


def read_header(path: str | Path) -> dict:
    """What the GGUF file holds and whether it converts: architecture, name, file type and the count of
    tensors per quantization type. Raises GGUFError for what cannot be converted."""
    path = Path(path)
    reader = _reader(path)
    from gguf import LlamaFileType
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    architecture = _field(reader, "general.architecture")
    # The mapping's keys are architectures plus the sections every file has; a few llama.cpp names
    # differ from transformers' (load_gguf_checkpoint renames them the same way).
    readable = set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}
    if RENAMED.get(architecture, architecture) not in readable:
        raise GGUFError(
            f"{path}: GGUF architecture {architecture!r} cannot be converted: transformers "
            f"{_versions()['transformers']} reads only {', '.join(sorted(readable))}"
        )
    types: dict[str, int] = {}
    unsupported: dict[str, list[str]] = {}
    dequantizable = _dequantizable()
    for tensor in reader.tensors:
        name = tensor.tensor_type.name
        types[name] = types.get(name, 0) + 1
        if tensor.tensor_type not in dequantizable:
            unsupported.setdefault(name, []).append(tensor.name)
    if unsupported:
        listed = "; ".join(
            f"{qtype} ({len(names)} tensor{'s' if len(names) > 1 else ''}, e.g. {names[0]})"
            for qtype, names in sorted(unsupported.items())
        )
        raise GGUFError(
            f"{path}: quantization type(s) that gguf {_versions()['gguf']} cannot dequantize: {listed}; "
            f"it dequantizes {', '.join(sorted(t.name for t in dequantizable))}"
        )
    file_type = _field(reader, "general.file_type")
    try:
        file_type_name = LlamaFileType(file_type).name if file_type is not None else None
    except ValueError:
        file_type_name = str(file_type)
    return {
        "architecture": architecture,
        "name": _field(reader, "general.name"),
        "file_type": file_type_name,
        "tensor_types": dict(sorted(types.items())),
        "tensors": len(reader.tensors),
    }


def convert(path: str | Path, out_dir: str | Path, *, dtype: str = "float32") -> dict:
    """Convert the GGUF file at `path` into a save_pretrained folder at `out_dir` (which the caller
    makes atomic) in `dtype`. Returns the provenance record: where the weights came from."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from fedtune.core import models

    path = Path(path).resolve()
    header = read_header(path)
    folder, name = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tokenizer.is_fast:
        raise GGUFError(f"{path}: its tokenizer converts to a slow tokenizer only; fedtune needs a fast one")
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = loaded.state_dict()
    del loaded
    config = AutoConfig.for_model(**config.to_dict())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # assign=True takes the dequantized tensors themselves: no second float copy of the weights.
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    del state
    model.tie_weights()
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta or unexpected:
        raise GGUFError(
            f"{path}: the converted weights do not fit {type(model).__name__}: "
            f"missing {still_meta[:5] or missing[:5]}, unexpected {unexpected[:5]}"
        )
    model = model.to(torch_dtype(dtype))
    models.save_model(model, tokenizer, out_dir)
    return {
        "path": str(path),
        "bytes": path.stat().st_size,
        "sha256": sha256_file(path),
        "gguf": header,
        "converted_by": _versions(),
        "model_class": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": dtype,
    }
