"""FSDP2 and DeepSpeed behind one small interface, so that the training loop in fedtune.train.loop reads the
same for both:

    backend.forward_backward(input_ids, labels, weight, last, attention_mask)
                                                               one micro batch; returns its mean loss
    backend.step(lr)                                           one optimizer step; returns the grad norm
                                                               (a device tensor: read when the loop syncs)
    backend.save(folder) / backend.load(folder)                sharded checkpoint (collective)
    backend.full_state_dict()                                  gathered weights, on rank 0 (collective)

(the `Backend` protocol below).
A backend is built from the whole model (every rank loads it, as with DeepSpeed and DDP) or, for
FSDP, from a model on the meta device that fedtune.train.loading fills after sharding; `weights_loaded` then
makes the optimizer again. Master weights and optimizer state stay in fp32 whatever the precision."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Protocol

import torch

from fedtune.core.options import ConfigError, deep_merge, torch_dtype
from fedtune.tokenize.blocks import trained_tokens
from fedtune.train import speed
from fedtune.train.distributed import Job
from fedtune.train.options import TrainOptions
from fedtune.train.speed import adamw_implementation, decoder_layer_classes, pin_batch

ADAM_EPS = 1e-8


class Backend(Protocol):
    """What the training loop asks of a backend; every method but the first two is collective."""

    def forward_backward(
        self, input_ids, labels, weight: float, last: bool, attention_mask=None
    ) -> torch.Tensor: ...

    def step(self, lr: float) -> float | torch.Tensor | None: ...

    def save(self, folder: Path) -> None: ...

    def load(self, folder: Path) -> None: ...

    def extra_state(self) -> dict: ...

    def load_extra_state(self, state: dict) -> None: ...

    def full_state_dict(self) -> dict | None: ...

    def save_optimizer(self, folder: Path) -> None: ...

    def load_optimizer(self, folder: Path) -> None: ...


class Proximal:
    """FedProx's term mu/2 ||w - w0||^2, added to the gradients as mu (w - w0) just before the step, on
    the tensors this rank holds. `local_tensors()` yields, per parameter, its local gradient, its local
    fp32 weights and a function that stores a changed gradient back (None where the gradient is the
    stored one). w0 is the local weights when the backend is built: the round's start model, also when
    a run resumes (the checkpoint is loaded after)."""

    def __init__(self, mu: float, local_tensors):
        self.mu, self.local_tensors = mu, local_tensors
        self.start = [weights.detach().clone() for _, weights, _ in local_tensors(grads=False)]

    def apply(self) -> None:
        for (grad, weights, store), start in zip(self.local_tensors(grads=True), self.start, strict=True):
            if grad is None:
                continue
            grad.add_(weights.detach() - start, alpha=self.mu)
            if store is not None:
                store(grad)


def model_inputs(device, input_ids, labels=None, attention_mask=None) -> dict:
    """Keyword arguments of a forward pass, on `device`. A classifier's rows come with their attention
    mask (its padding must not be attended to); a language model runs without a KV cache, which training
    never reuses."""
    # On CUDA the copies start from pinned memory without waiting; `.to(device)` is then a no-op.
    input_ids, labels, attention_mask = pin_batch(device, input_ids, labels, attention_mask)
    inputs = {"input_ids": input_ids.to(device)}
    if labels is not None:
        inputs["labels"] = labels.to(device)
    if attention_mask is not None:
        inputs["attention_mask"] = attention_mask.to(device)
    else:
        inputs["use_cache"] = False
    return inputs


def _micro_loss(model, inputs: dict, trained: int):
    output = model(**inputs)
    if trained == 0:
        # A micro batch with no target token has a 0/0 loss; it still has to run backward so that
        # the collectives of every rank line up.
        return output.logits.sum() * 0.0
    return output.loss


def trainable(model) -> list[torch.nn.Parameter]:
    """The parameters training changes: all of them, or an adapter's (train.adapter)."""
    return [p for p in model.parameters() if p.requires_grad]


def vocab_parameters(model) -> list[torch.nn.Parameter]:
    """The input embeddings and the LM head: the parameters with a row per token id. A tied head is the
    embeddings' own parameter, so it is listed once; a classifier has no output embeddings."""
    module = getattr(model, "module", model)  # DDP's wrapper
    found: dict[int, torch.nn.Parameter] = {}
    for get in ("get_input_embeddings", "get_output_embeddings"):
        layer = getattr(module, get, lambda: None)()
        weight = getattr(layer, "weight", None)
        if isinstance(weight, torch.nn.Parameter) and weight.requires_grad:
            found.setdefault(id(weight), weight)
    return list(found.values())


def parameter_groups(model, options: TrainOptions) -> list[dict]:
    """AdamW's parameter groups: with train.embedding_lr_factor other than 1, the embeddings and the
    head in a group of their own whose `lr_factor` each step multiplies the scheduled lr by."""
    params = trainable(model)
    if options.embedding_lr_factor == 1:
        return [{"params": params, "lr_factor": 1.0}]
    vocab = {id(p) for p in vocab_parameters(model)}
    groups = [
        {"params": [p for p in params if id(p) not in vocab], "lr_factor": 1.0},
        {"params": [p for p in params if id(p) in vocab], "lr_factor": options.embedding_lr_factor},
    ]
    return [group for group in groups if group["params"]]


def set_lr(param_groups, lr: float) -> None:
    """The step's lr into every group, times the group's factor (train.embedding_lr_factor)."""
    for group in param_groups:
        group["lr"] = lr * group.get("lr_factor", 1.0)


def adamw(model, options: TrainOptions, device: torch.device) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        parameter_groups(model, options),
        lr=options.lr,
        betas=options.betas,
        weight_decay=options.weight_decay,
        eps=ADAM_EPS,
        **adamw_implementation(device),
    )


class LossScaler:
    """Dynamic loss scaling for fp16: the scale halves when the gradients overflow (the step is skipped)
    and doubles after `growth_interval` good steps. Decided on the global gradient norm, so every rank
    skips the same steps."""

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 1000):
        self.scale = scale
        self.growth_interval = growth_interval
        self.good_steps = 0

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale = max(self.scale / 2, 1.0)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = state["scale"], state["good_steps"]


class _TorchBackend:
    """What FSDP2 and DDP share: a torch AdamW over the wrapped model, the step with clipping and fp16
    loss scaling, and checkpoints and exports through torch.distributed.checkpoint's state dicts."""

    def __init__(
        self, model: torch.nn.Module, options: TrainOptions, job: Job, accumulation: int, module=None
    ):
        self.model = model
        self.module = model if module is None else module  # as built, without DDP's wrapper
        # With an adapter, checkpoints and exports hold the trainable tensors only: the frozen base is
        # the round's start model, already on disk.
        self.frozen_base = options.adapter is not None
        self.job, self.accumulation = job, accumulation
        self.grad_clip = options.grad_clip
        self.scaler = LossScaler() if options.precision == "fp16" else None
        self.weights_loaded(options)

    def weights_loaded(self, options: TrainOptions) -> None:
        """Make what depends on the weights' storage: the optimizer and FedProx's start weights. Again
        after fedtune.train.loading has filled a model that was built on the meta device."""
        self.optimizer = adamw(self.model, options, self.job.device)
        self.proximal = Proximal(options.fedprox_mu, self._local_tensors) if options.fedprox_mu else None

    def _local_tensors(self, grads: bool):
        """Gradient and weights as this rank holds them (an FSDP2 DTensor's local shard), for Proximal."""
        for p in trainable(self.model):
            local = p.to_local() if hasattr(p, "to_local") else p
            grad = (
                p.grad.to_local() if grads and p.grad is not None and hasattr(p.grad, "to_local") else p.grad
            )
            yield grad, local, None

    def _scaled(self, weight: float) -> float:
        return weight / self.accumulation * (self.scaler.scale if self.scaler else 1.0)

    def step(self, lr: float) -> float | torch.Tensor:
        set_lr(self.optimizer.param_groups, lr)
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.scaler:
            for p in params:
                p.grad.div_(self.scaler.scale)
        if self.proximal:
            self.proximal.apply()
        max_norm = self.grad_clip if self.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        # A NaN or infinite norm is never stepped on (issue 47): fp16's loss scaler skips the step and
        # halves its scale; bf16 and fp32 skip it and the train loop stops. Decided on the host (the loop
        # reads the norm right after anyway).
        finite = math.isfinite(float(norm))
        if self.scaler:
            self.scaler.update(finite)
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # A tensor, not a float: the loop reads it with the loss, in the step's one host sync.
        return norm

    def _state_options(self, **kwargs):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=self.frozen_base, strict=not self.frozen_base, **kwargs)

    def save(self, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=self._state_options())
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder / "fsdp"))

    def save_async(self, folder: Path, process_group):
        """As `save`, with the writing in the background on `process_group`: returns the writer's
        future (fedtune.train.checkpoint keeps at most one in flight)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=self._state_options())
        state = {"model": model_state, "optim": optim_state}
        return dcp.async_save(state, checkpoint_id=str(folder / "fsdp"), process_group=process_group)

    def load(self, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=self._state_options())
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(folder / "fsdp"))
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
            options=self._state_options(),
        )  # fmt: skip

    def extra_state(self) -> dict:
        return {"loss_scaler": self.scaler.state_dict()} if self.scaler else {}

    def load_extra_state(self, state: dict) -> None:
        if self.scaler and "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])

    def full_state_dict(self) -> dict | None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        options = self._state_options(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)
        return state if self.job.is_main else None

    def save_optimizer(self, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        dcp.save({"optim": get_optimizer_state_dict(self.model, self.optimizer)}, checkpoint_id=str(folder))

    def load_optimizer(self, folder: Path) -> None:
        """The optimizer state (Adam's moments and step count) of another run over the same parameters;
        the weights stay as they are."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        state = {"optim": get_optimizer_state_dict(self.model, self.optimizer)}
        dcp.load(state, checkpoint_id=str(folder))
        set_optimizer_state_dict(self.model, self.optimizer, state["optim"])


def _low_precision(options: TrainOptions):
    return torch_dtype(options.low_precision) if options.low_precision else None


class FSDPBackend(_TorchBackend):
    """FSDP2 (fully_shard) per decoder layer and over the whole model: full or hybrid sharding."""

    def __init__(self, model, options: TrainOptions, job: Job, accumulation: int):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        sharding = options.sharding
        if sharding == "full":
            mesh = init_device_mesh(job.device.type, (job.world_size,), mesh_dim_names=("shard",))
        else:
            # HSDP: parameters sharded over the second dimension, replicated (all-reduced) over the first.
            shape = (job.nodes, job.local_world_size)
            mesh = init_device_mesh(job.device.type, shape, mesh_dim_names=("replicate", "shard"))
        low = _low_precision(options)
        kwargs = {"mesh": mesh, "reshard_after_forward": sharding in ("full", "hybrid")}
        if low is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
        layer_classes = decoder_layer_classes(model)
        for module in model.modules():
            if type(module).__name__ in layer_classes:
                fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)
        super().__init__(model, options, job, accumulation)

    def forward_backward(
        self, input_ids, labels, weight: float, last: bool, attention_mask=None
    ) -> torch.Tensor:
        # Gradients are reduced across ranks only once per optimizer step, after the last micro batch.
        self.model.set_requires_gradient_sync(last)
        trained = trained_tokens(labels)
        inputs = model_inputs(self.job.device, input_ids, labels, attention_mask)
        loss = _micro_loss(self.model, inputs, trained)
        (loss * self._scaled(weight)).backward()
        return loss.detach().float()


class DDPBackend(_TorchBackend):
    """sharding none: plain data parallelism with torch DDP. FSDP2 over groups of one would work too,
    but it all-reduces each layer's gradients with a blocking call, which on CPU (no streams) stalls
    backward at every layer; DDP's bucketed all-reduce overlaps it
    (benchmarks/results/training/2026-11-26.md)."""

    def __init__(self, model, options: TrainOptions, job: Job, accumulation: int):
        from torch.nn.parallel import DistributedDataParallel

        if not getattr(model, "is_loaded_in_4bit", False):  # a QLoRA base is placed on its GPU already
            model.to(job.device)
        device_ids = [job.device.index] if job.device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
        # FSDP casts parameters for mixed precision; DDP keeps fp32 parameters, so autocast does it.
        self.low = _low_precision(options)
        super().__init__(wrapped, options, job, accumulation, module=model)

    def forward_backward(
        self, input_ids, labels, weight: float, last: bool, attention_mask=None
    ) -> torch.Tensor:
        import contextlib

        # Gradients are reduced across ranks only once per optimizer step, after the last micro batch.
        sync = contextlib.nullcontext() if last else self.model.no_sync()
        trained = trained_tokens(labels)
        inputs = model_inputs(self.job.device, input_ids, labels, attention_mask)
        with sync:
            with torch.autocast(
                self.job.device.type, dtype=self.low or torch.float32, enabled=bool(self.low)
            ):
                loss = _micro_loss(self.model, inputs, trained)
            (loss.float() * self._scaled(weight)).backward()
        return loss.detach().float()


def deepspeed_config(options: TrainOptions, accumulation: int, device: torch.device) -> dict:
    """The DeepSpeed JSON generated from the train options, with deepspeed_extra merged over it."""

    zero = {"stage": options.zero_stage}
    pin = device.type == "cuda"
    if options.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if options.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    config = {
        "train_batch_size": options.global_batch,
        "train_micro_batch_size_per_gpu": options.micro_batch,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": options.grad_clip,
        "zero_optimization": zero,
        # fedtune prints its own progress; DeepSpeed's per-step lines would drown it.
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if options.precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif options.precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    if options.offload_optimizer:
        # Offloaded optimizer states need DeepSpeed's CPU Adam, which it builds from this block.
        config["optimizer"] = {
            "type": "AdamW",
            "params": {
                "lr": options.lr,
                "betas": list(options.betas),
                "eps": ADAM_EPS,
                "weight_decay": options.weight_decay,
            },
        }
    merged = deep_merge(config, options.deepspeed_extra)
    # DeepSpeed's ZeRO optimizers skip a step whose gradient norm is NaN or infinite only with these on
    # (their default): fedtune never steps on such a gradient (issue 47), so it keeps them.
    for section, key in (("zero_optimization", "compute_grad_norm"), ("bf16", "check_grad_overflow")):
        block = merged.get(section)
        if isinstance(block, dict) and block.get(key, True) is False:
            raise ConfigError(
                f"deepspeed_extra: {section}.{key}: false would let DeepSpeed step on a NaN or infinite "
                "gradient, which fedtune never does; leave the key out"
            )
    return merged


class DeepSpeedBackend:
    TAG = "deepspeed"

    def __init__(self, model, options: TrainOptions, job: Job, accumulation: int):
        import deepspeed

        self.job = job
        self.module = model
        self.frozen_base = options.adapter is not None
        self.config = deepspeed_config(options, accumulation, job.device)
        optimizer = None
        if "optimizer" not in self.config:
            # torch's AdamW, the optimizer of the FSDP backend: both backends then compute the same steps.
            optimizer = adamw(model, options, job.device)
        # DeepSpeed's own optimizer (offload) builds its groups from model_parameters: the embedding/head
        # group (train.embedding_lr_factor) goes there; torch's AdamW above has it already.
        grouped = optimizer is None and options.embedding_lr_factor != 1
        self.engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            model_parameters=parameter_groups(model, options) if grouped else trainable(model),
            config=self.config,
        )
        self.proximal = Proximal(options.fedprox_mu, self._local_tensors) if options.fedprox_mu else None
        # DeepSpeed's own optimizers (ZeRO-1/2/3, and ZeRO-0's fp16/bf16 wrapper) compute the global
        # gradient norm in their step, before any update, and skip the step when it is NaN or infinite
        # (reported as inf; tests/test_deepspeed_nan.py holds DeepSpeed to it). ZeRO-0 in fp32 hands the
        # gradients to torch's AdamW as they are and computes no norm: the backend computes it then.
        self.own_norm = not hasattr(self.engine.optimizer, "_global_grad_norm")

    def _local_tensors(self, grads: bool):
        """ZeRO-3's partitions of each parameter on this rank (TrainOptions allows FedProx on stage 3 only)."""
        from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_grad, safe_set_local_grad

        for p in trainable(self.engine.module):
            grad = safe_get_local_grad(p) if grads else None
            yield grad, safe_get_local_fp32_param(p), lambda value, p=p: safe_set_local_grad(p, value)

    def forward_backward(
        self, input_ids, labels, weight: float, last: bool, attention_mask=None
    ) -> torch.Tensor:
        trained = trained_tokens(labels)
        inputs = model_inputs(self.job.device, input_ids, labels, attention_mask)
        loss = _micro_loss(self.engine, inputs, trained)
        # The engine divides by the accumulation steps and applies the fp16 loss scale itself.
        self.engine.backward(loss * weight)
        if not last:
            # DeepSpeed counts micro steps in step(); off the accumulation boundary it only counts.
            self.engine.step()
        return loss.detach().float()

    def _grad_norm(self) -> float:
        """The gradient norm of ZeRO-0 (fp32): its gradients are whole on every rank, all-reduced by the
        engine's backward at the accumulation boundary, so each rank computes the same global norm (as
        DDP's replicas do), without a collective. Before DeepSpeed's own clipping, which reads it again."""
        grads = [
            p.grad
            for g in self.engine.basic_optimizer.param_groups
            for p in g["params"]
            if p.grad is not None
        ]
        return float(torch.nn.utils.get_total_norm(grads, foreach=True)) if grads else 0.0

    def step(self, lr: float) -> float | None:
        set_lr(self.engine.basic_optimizer.param_groups, lr)
        if self.proximal:
            self.proximal.apply()
        if self.own_norm:
            norm = self._grad_norm()
            if not math.isfinite(norm):
                # Not stepped on (issue 47): the loop stops on this norm, as on FSDP's. The engine's
                # gradients are left as they are; the training ends here.
                return norm
            self.engine.step()
            return norm
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        # A step that DeepSpeed skipped for a NaN or infinite norm reports inf. None: a configuration that
        # computes no norm (deepspeed_config refuses deepspeed_extra that turns DeepSpeed's check off).
        return None if norm is None else float(norm)

    def save(self, folder: Path) -> None:
        self.engine.save_checkpoint(
            str(folder), tag=self.TAG, save_latest=False, exclude_frozen_parameters=self.frozen_base
        )

    def load(self, folder: Path) -> None:
        path, _ = self.engine.load_checkpoint(
            str(folder), tag=self.TAG, load_optimizer_states=True, load_lr_scheduler_states=False,
            load_module_strict=not self.frozen_base,
        )  # fmt: skip
        if path is None:
            raise RuntimeError(f"{folder}: DeepSpeed could not load the checkpoint")

    def extra_state(self) -> dict:
        return {}

    def load_extra_state(self, state: dict) -> None:
        pass

    def save_optimizer(self, folder: Path) -> None:
        raise ConfigError(
            "federation.site_optimizer: keep needs backend fsdp; DeepSpeed's optimizer holds the weights"
        )

    load_optimizer = save_optimizer

    def full_state_dict(self) -> dict | None:
        if self.engine.zero_optimization_partition_weights():
            state = self.engine._zero3_consolidated_16bit_state_dict(
                exclude_frozen_parameters=self.frozen_base
            )
        else:
            state = self.engine.module_state_dict(exclude_frozen_parameters=self.frozen_base)
        if not self.job.is_main:
            return None
        return {name: tensor.detach().cpu() for name, tensor in state.items()}


def prepare_layers(model, options: TrainOptions, job: Job) -> None:
    """Activation checkpointing and compilation of the decoder layers (fedtune.train.speed), on the layers
    themselves, before the backend shards or wraps them (dynamo leaves FSDP2's hooks out of the graphs:
    torch._dynamo.config.skip_fsdp_hooks). On a meta-device model both only mark the layers."""
    every = options.checkpoint_layers_every
    layers = speed.selective_checkpointing(model, every=every) if every else []
    compiled = speed.compile_layers(model) if options.compile else 0
    if job.is_main and (layers or compiled):
        # The test of each option reads this line: what was applied, not what was asked for.
        print(f"layers: activation checkpointing of {layers}, {compiled} compiled", flush=True)


def build(model, options: TrainOptions, job: Job, accumulation: int) -> Backend:
    prepare_layers(model, options, job)
    if options.backend == "fsdp":
        cls = DDPBackend if options.sharding == "none" else FSDPBackend
        return cls(model, options, job, accumulation)
    return DeepSpeedBackend(model, options, job, accumulation)
