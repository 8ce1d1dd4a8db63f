"""GPU speed options of the training loop, each a small function the backends and the loop call:

    compile_layers(model)                  torch.compile each decoder layer in place
    selective_checkpointing(model, every)  recompute the activations of every N-th decoder layer only
    adamw_implementation(device)           fused AdamW on CUDA, foreach elsewhere
    pin_batch(device, *tensors)            page-locked host copies sent with non_blocking=True

None of them changes a parameter name, so checkpoints, the exported state dict and the aggregate stage
see the same model whichever are on. fedtune.train.backends applies them (`prepare_layers` for the train
options `compile` and `gradient_checkpointing: N`, `adamw`, `model_inputs`); benchmarks/gpu_training.py
measures what they gain. A leaf: it imports nothing from fedtune, so that backends can import it."""

from __future__ import annotations

import torch

from fedtune.core.options import ConfigError


def decoder_layer_classes(model) -> set[str]:
    # Transformers names the blocks it never splits across devices: exactly the per-layer wrapping unit.
    names = set(getattr(model, "_no_split_modules", None) or [])
    if not names:
        # Some models (DistilBERT) name none; their layers are the members of the model's ModuleLists.
        names = {
            type(layer).__name__
            for module in model.modules()
            if isinstance(module, torch.nn.ModuleList) and len(module) > 1
            for layer in module
        }
    if not names:
        raise ConfigError(
            f"{type(model).__name__} does not name its layers (_no_split_modules, ModuleList): train.compile "
            "and train.gradient_checkpointing need them; set both to false for this model"
        )
    return names


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated decoder blocks: the unit of FSDP wrapping, of compilation and of checkpointing."""
    classes = decoder_layer_classes(model)
    # By the class's ancestry, not its name: FSDP2 turns LlamaDecoderLayer into FSDPLlamaDecoderLayer.
    return [m for m in model.modules() if any(c.__name__ in classes for c in type(m).__mro__)]


def compile_layers(model, **compile_kwargs) -> int:
    """Compile each decoder layer in place (`Module.compile`, as torchtune does) and return how many.
    Per layer rather than whole-model: every layer has the same graph, so it compiles once and is
    reused, and graph breaks in the model's glue (masks, loss) stay outside. In place, not
    `torch.compile(layer)`: a wrapper would rename every parameter (`_orig_mod.`). Call it before the
    backend shards the model; FSDP2's hooks stay outside the compiled graphs (dynamo skips them)."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(**compile_kwargs)
    return len(layers)


def compiled_layers(model) -> int:
    """How many decoder layers `compile_layers` has compiled (0 before it ran)."""
    return sum(getattr(layer, "_compiled_call_impl", None) is not None for layer in decoder_layers(model))


def selective_checkpointing(model, every: int = 2) -> list[int]:
    """Recompute in backward the activations of every `every`-th decoder layer (0, every, 2*every, ...)
    and keep the others': `every=1` is full activation checkpointing (~33% more compute), larger values
    trade memory back for speed. Non-reentrant, the variant that works under FSDP2 and ZeRO-3.
    Returns the indices of the checkpointed layers."""
    if every < 1:
        raise ValueError(f"selective_checkpointing: every={every}; needs 1 or more")
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every)
    else:
        # transformers before 5.2x (5.17 on the GPU image of issue 41, where this raised AttributeError):
        # what activation_checkpointing_enable does, on the chosen layers. A decoder layer
        # (GradientCheckpointingLayer) recomputes while its own `gradient_checkpointing` is set, through
        # its `_gradient_checkpointing_func`.
        import functools

        from torch.utils.checkpoint import checkpoint

        for i, layer in enumerate(decoder_layers(model)):
            if i % every == 0:
                layer.gradient_checkpointing = True
                layer._gradient_checkpointing_func = functools.partial(checkpoint, **kwargs)
    return [i for i, layer in enumerate(decoder_layers(model)) if layer.gradient_checkpointing]


def adamw_implementation(device: torch.device) -> dict:
    """AdamW's implementation keyword: fused (one kernel for all parameters) on CUDA; foreach elsewhere,
    since torch leaves it off on CPU and one dispatch per (DTensor) parameter and op is slow."""
    return {"fused": True} if device.type == "cuda" else {"foreach": True}


def pin_batch(device: torch.device, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The batch on `device`. To a GPU: copied from page-locked host memory with non_blocking=True,
    so the copy overlaps the previous step's kernels instead of stalling the host; the tensors the
    model reads are then already on the device and `.to(device)` in the backend is free. On a CPU
    device the tensors come back as they are."""
    if device.type != "cuda":
        return tensors
    return tuple(
        None if t is None else (t if t.is_cuda else t.pin_memory().to(device, non_blocking=True))
        for t in tensors
    )
