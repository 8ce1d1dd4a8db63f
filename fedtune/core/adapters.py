"""LoRA adapters (peft) in the train and evaluate stages: the base model's weights stay frozen, the
adapter is what trains, what checkpoints hold and what a site exports, as a PEFT adapter folder that
`PeftModel.from_pretrained(base, folder)` loads:

    model = wrap(model, options.adapter, task)          before the backend shards it (train)
    write_adapter(model, trainable_state, folder, dtype) the site's export (train, rank 0)
    load_model(folder, base=..., task=..., dtype=...)   base + adapter, unmerged (evaluate); a full
                                                        model folder loads as it is

fedtune.aggregate.adapters combines the sites' adapters; the next round starts from the base with the
aggregate merged in and fresh adapters (FLoRA), so an adapter never grows from round to round. An
`adapter` here is the train stage's AdapterOptions (train.adapter), read by its attributes: core imports
no stage."""

from __future__ import annotations

import json
from pathlib import Path

from fedtune.core.options import CLASSIFICATION, ConfigError, UserError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class AdapterError(UserError):
    pass


def is_adapter(folder: str | Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def lora_config(adapter, task: str):
    """peft's LoraConfig of the train.adapter section (fedtune/schemas/train.schema.yaml)."""
    from peft import LoraConfig, TaskType

    return LoraConfig(
        r=adapter.r,
        lora_alpha=adapter.alpha,
        lora_dropout=adapter.dropout,
        # peft takes lists (or a str), and writes them into adapter_config.json.
        target_modules=list(adapter.target_modules)
        if isinstance(adapter.target_modules, tuple)
        else adapter.target_modules,
        modules_to_save=None if adapter.modules_to_save is None else list(adapter.modules_to_save),
        # SEQ_CLS also trains and saves the new classification head (peft adds it to modules_to_save).
        task_type=TaskType.SEQ_CLS if task == CLASSIFICATION else TaskType.CAUSAL_LM,
    )


def check_quantize(adapter, device) -> None:
    """QLoRA's 4-bit base runs on bitsandbytes' CUDA kernels only: refused before the model loads."""
    if not adapter.quantized:
        return
    if device.type != "cuda":
        raise ConfigError(
            f"train.adapter.quantize: {adapter.quantize} (QLoRA) needs a CUDA device; this job runs on "
            f"{device.type}. Use quantize: none here"
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ConfigError(
            "train.adapter.quantize: 4bit needs bitsandbytes (pip install bitsandbytes) on the compute nodes"
        ) from None


def load_quantized(model_dir, *, task: str, device, allow_pickle: bool = False):
    """QLoRA's base: the model's linear layers in 4-bit NF4 (bitsandbytes) on this rank's GPU, the
    rest in bf16, ready for peft (`prepare_model_for_kbit_training`). CUDA only (check_quantize)."""
    import torch
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    from fedtune.core.models import auto_class, check_loadable

    check_loadable(model_dir, task=task, allow_pickle=allow_pickle, verify=True)
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = auto_class(task).from_pretrained(
        model_dir, quantization_config=quantization, dtype=torch.bfloat16,
        device_map={"": device.index or 0}, use_safetensors=not allow_pickle,
    )  # fmt: skip
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def wrap(model, adapter, task: str):
    """The model with a fresh LoRA adapter: only the adapter (and modules_to_save) requires grad. The
    adapter's A matrices are drawn from torch's generator, so ranks seeded alike build the same one."""
    from peft import get_peft_model

    try:
        return get_peft_model(model, lora_config(adapter, task))
    except ValueError as error:
        # peft names what it could not find (unknown target modules, an architecture without defaults).
        raise ConfigError(f"train.adapter: {error}") from None


def write_adapter(model, state: dict, folder: Path, dtype: str) -> None:
    """The PEFT folder of `model` (the PeftModel as built, not its distributed wrapper) holding the
    gathered trainable tensors `state`, stored in `dtype` like a full model's export."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    from fedtune.core.options import torch_dtype

    saved = get_peft_model_state_dict(model, state_dict=state)
    cast = torch_dtype(dtype)
    tensors = {
        name: (t.to(cast) if t.is_floating_point() else t).detach().to("cpu").contiguous()
        for name, t in saved.items()
    }
    if not tensors:
        raise AdapterError(f"{folder}: the adapter has no tensors (nothing was trainable)")
    save_file(tensors, str(Path(folder) / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    # Readable by the group, as the full model's export: another account may aggregate or fetch it.
    (Path(folder) / ADAPTER_WEIGHTS).chmod(0o644)
    config = model.peft_config["default"]
    config.save_pretrained(str(folder))


def adapter_config(folder: str | Path) -> dict:
    path = Path(folder) / ADAPTER_CONFIG
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise AdapterError(f"{path}: not a readable adapter config: {error}") from None


def load_model(folder: str | Path, *, base: str | Path | None, task: str, dtype: str | None):
    """A model folder as it is, or an adapter folder on top of its base (`base`), unmerged: the same
    forward as the site trained, without writing merged weights."""
    from fedtune.core import models

    if not is_adapter(folder):
        return models.load_model(folder, task=task, dtype=dtype)
    if base is None:
        raise AdapterError(f"{folder}: an adapter folder; give its base model (--base)")
    from peft import PeftModel

    adapter_config(folder)  # a clear error for a broken config before the base loads
    model = models.load_model(base, task=task, dtype=dtype)
    return PeftModel.from_pretrained(model, str(folder), is_trainable=False)


def weights_folder(folder: str | Path, base: str | Path | None) -> Path:
    """Where a model's tokenizer and config.json are: the base's for an adapter folder."""
    if is_adapter(folder):
        if base is None:
            raise AdapterError(f"{folder}: an adapter folder; give its base model (--base)")
        return Path(base)
    return Path(folder)
