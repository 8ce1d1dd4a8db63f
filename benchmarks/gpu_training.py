"""Benchmark: training throughput (tokens/s), model FLOPs utilisation and peak memory of fedtune's backends
beside the Hugging Face Trainer, on one GPU, with the largest Llama that fits it built from a config; a
QLoRA run; and docs/scaling.md's memory formula beside each FSDP2 run's measured peak.

    python benchmarks/gpu_training.py                 # on a GPU machine: 2.7B Llama, seq 2048, bf16
    python benchmarks/gpu_training.py --arch 1b       # TinyLlama-1.1B's shape instead
    python benchmarks/gpu_training.py --smoke         # a tiny Llama on CPU, a few steps (tests run it)

The model is Sheared-LLaMA-2.7B's architecture (hidden 2560, intermediate 6912, 32 layers, 20 heads,
32000-token vocabulary, untied head; ARCHITECTURES) with random weights from a seed: nothing is
downloaded. The data are random token ids from a seed, the same rows in the same order for every run.
Every run has the same micro batch, accumulation, sequence length, steps, precision, AdamW (0.9/0.95, eps
1e-8) at a constant learning rate and clipping at 1.0; each runs in a fresh process (so its peak memory is
its own), and so does building the starting weights (the driver holds no CUDA context):

- fsdp:            fedtune's train stage with its default speed options: fedtune.train.backends.build from
                   TrainOptions (backend fsdp, sharding full), whose AdamW is fused on CUDA and whose batches
                   are copied from pinned memory with non_blocking, and fedtune.train.loop.train_step per step
                   (micro batches with accumulation, the optimizer step, the loss all-reduce: one host sync);
- fsdp_fast:       the same with the train options `compile: true` (torch.compile per decoder layer) and,
                   with --checkpoint-every N, `gradient_checkpointing: N` (every N-th layer);
- qlora:           the base in NF4 (adapter.quantize 4bit, bitsandbytes), a LoRA adapter on every linear
                   layer, sharding none, its own learning rate (--adapter-lr); on CPU, an unquantized base;
- fsdp_fast_mb2:   fsdp_fast at twice the micro batch and half the accumulation (the same tokens per step);
- deepspeed_zero2, deepspeed_zero3: the same loop, TrainOptions backend deepspeed, zero_stage 2 / 3;
- hf_trainer:      transformers.Trainer on the same model and rows in the same order, bf16 autocast, fused
                   AdamW on CUDA, its defaults otherwise.

Tokens/s is over the steps after --measure-after (compilation and first allocations left out); every step
ends in a host sync in both loops (fedtune's loss all-reduce, the Trainer's callback synchronises).

Runs go in the order of RUNS (the goal's pair first) while the --budget-s allows (default 480 s, for a GPU
session of 10 minutes); a run that fails or runs out of time is reported as such and the others go on. All
files (caches of inductor, triton and torch extensions, the Trainer's output, temporary files) go to a
temporary folder removed at the end, or to --workdir; --logs keeps each run's log.

MFU (model FLOPs utilisation) = tokens/s x FLOPs per token / the GPU's dense bf16 peak (PEAK_TFLOPS), with

    FLOPs per token = 6 N + 12 L s d

- N: the parameters that take part in a matrix multiply: all of them but the input embedding (a lookup);
  the untied LM head counts. Forward: 2 FLOPs (multiply + add) per parameter and token; backward twice
  the forward (gradients of the inputs and of the weights): 6 N.
- 12 L s d, attention: per layer and token, the scores Q K^T cost 2 s d (s keys, d = heads x head_dim
  query width; grouped key/value heads do not shrink it) and the weighted sum of V another 2 s d: 4 s d
  forward, x3 with backward. This is the convention of PaLM, nanoGPT and torchtitan: it counts the whole
  s x s score matrix although causal masking needs only the s (s + 1) / 2 lower triangle, whose exact
  count is 12 L d (s + 1) / 2 ~ 6 L s d (reported as mfu_causal). Recomputation (activation
  checkpointing, flash attention's backward) is not counted: MFU counts the model's FLOPs, not the work done.

Prints one JSON object and a Markdown table. Goals (issue 15): fsdp_fast MFU >= 45% on an H100/H200 and
its tokens/s >= 1.2 x the Trainer's."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # fedtune, from the checkout: the GPU machine has it uninstalled

# Dense (no sparsity) bf16 tensor-core peak, TFLOPS, by a piece of torch.cuda.get_device_name(); the first
# match wins, so the more specific names come first. V100 has no bf16: its fp16 peak.
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM
    ("GH200", 989.0),
    ("H200", 989.0),
    ("A100", 312.0),
    ("V100", 125.0),
)

ARCHITECTURES = {
    # Sheared-LLaMA-2.7B's shape (a pruned Llama-2, 32000-token vocabulary): the largest Llama shape whose
    # fedtune run (FSDP2, one GPU, bf16, micro batch 1 x 2048, no recomputation) docs/scaling.md's plan
    # fits in an 80 GB H100; a 3.4B one (OpenLLaMA-3B) needs activation checkpointing there.
    "2.7b": {
        "hidden_size": 2560,
        "intermediate_size": 6912,
        "num_hidden_layers": 32,
        "num_attention_heads": 20,
        "num_key_value_heads": 20,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    },
    # TinyLlama-1.1B's shape: a Llama-2 architecture at ~1B parameters.
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    },
    "smoke": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "tie_word_embeddings": False,
    },
}

# The train options of each fedtune run (hf_trainer: None); the goal's pair first, for a short session.
RUNS = {
    "fsdp_fast": {"backend": "fsdp", "sharding": "full", "compile": True},
    "hf_trainer": None,
    # QLoRA: the base in NF4 (bitsandbytes), a LoRA adapter on every linear layer trained in bf16; its
    # own learning rate (--adapter-lr). On CPU (--smoke) the same adapter over an unquantized base.
    "qlora": {
        "backend": "fsdp",
        "sharding": "none",
        "adapter": {"r": 16, "alpha": 32, "target_modules": "all-linear", "quantize": "4bit"},
    },
    # fsdp_fast with twice the micro batch and half the accumulation (the same tokens per step): larger
    # matrix products against more activation memory.
    "fsdp_fast_mb2": {"backend": "fsdp", "sharding": "full", "compile": True},
    "fsdp": {"backend": "fsdp", "sharding": "full"},
    "deepspeed_zero2": {"backend": "deepspeed", "zero_stage": 2},
    "deepspeed_zero3": {"backend": "deepspeed", "zero_stage": 3},
    "deepspeed_zero3_offload": {"backend": "deepspeed", "zero_stage": 3, "offload_optimizer": True},
    # Issue 41's levers towards 45% MFU, each at micro batch 4 (4x the base, a quarter of the accumulation):
    "fsdp_fast_mb4": {"backend": "fsdp", "sharding": "full", "compile": True},
    # FSDP2 reshard_after_forward=False (the sharding mode hybrid_zero2; on one GPU its mesh is 1 x 1): the
    # backward reuses the forward's gathered bf16 weights instead of gathering them again.
    "fsdp_fast_mb4_noreshard": {"backend": "fsdp", "sharding": "hybrid_zero2", "compile": True},
    # Selective (every 4th layer) activation checkpointing: what lets micro batch 4 fit an 80 GB H100.
    "fsdp_fast_mb4_ac": {"backend": "fsdp", "sharding": "full", "compile": True},
    # torch.compile of the whole model (embedding, every layer, the head and the loss) instead of per layer.
    "fsdp_compile_model_mb4": {"backend": "fsdp", "sharding": "full", "compile": False},
    "hf_trainer_mb2": None,
    "hf_trainer_mb4": None,
}

# Each run's micro batch as a multiple of the shared one (the accumulation divided alike: the same tokens
# per step), and what it changes in the speed options beside its train options.
MICRO_FACTOR = {
    "fsdp_fast_mb2": 2, "fsdp_fast_mb4": 4, "fsdp_fast_mb4_noreshard": 4, "fsdp_fast_mb4_ac": 4,
    "fsdp_compile_model_mb4": 4, "hf_trainer_mb2": 2, "hf_trainer_mb4": 4,
}  # fmt: skip
RUN_EXTRA = {"fsdp_fast_mb4_ac": {"gradient_checkpointing": 4}}
COMPILE_MODEL = ("fsdp_compile_model_mb4",)


def is_trainer(name: str) -> bool:
    return name.startswith("hf_trainer")


def peak_tflops(device_name: str) -> float | None:
    for piece, tflops in PEAK_TFLOPS:
        if piece in device_name:
            return tflops
    return None


def flops_per_token(architecture: dict, seq: int) -> dict:
    """The terms of 6 N + 12 L s d (module docstring), from the architecture alone."""
    h, layers = architecture["hidden_size"], architecture["num_hidden_layers"]
    heads = architecture["num_attention_heads"]
    kv = architecture.get("num_key_value_heads", heads)
    head_dim = architecture.get("head_dim") or h // heads
    ffn, vocab = architecture["intermediate_size"], architecture["vocab_size"]
    per_layer = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h + 3 * h * ffn
    matmul_params = layers * per_layer + vocab * h  # the LM head; the input embedding is a lookup
    attention = 12 * layers * seq * heads * head_dim
    return {
        "matmul_params": matmul_params,
        "dense": 6 * matmul_params,
        "attention": attention,
        "total": 6 * matmul_params + attention,
        "total_causal": 6 * matmul_params + 12 * layers * heads * head_dim * (seq + 1) // 2,
    }


# -- one run, in its own process -------------------------------------------------------------------


def build_model(spec: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec["seed"])
    config = LlamaConfig(**spec["architecture"], max_position_embeddings=spec["seq"], use_cache=False)
    return LlamaForCausalLM(config)  # fp32 on the host, as fedtune.train.loop loads it


class RandomBlocks:
    """Random token blocks with the interface fedtune.train.loop reads from fedtune.tokenize.blocks.Blocks: the
    training data of every run, the same rows from the same seed."""

    classification = False

    def __init__(self, spec: dict):
        import torch

        self.block_size = spec["seq"]
        generator = torch.Generator().manual_seed(spec["seed"] + 1)
        # One global batch of rows, seen every step (in a new order each time): random tokens can only
        # be memorised, so the loss falls in a few steps only on rows seen before.
        shape = (spec["micro_batch"] * spec["accumulation"], spec["seq"])
        self.rows = torch.randint(spec["architecture"]["vocab_size"], shape, generator=generator)

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, indices):
        ids = self.rows[list(indices)]
        return ids, ids.clone()

    def attention_mask(self, indices):
        return None


def data_order(spec: dict):
    """fedtune.tokenize.blocks.BlockOrder over RandomBlocks (one process) and the micro batches it gives, in
    training order: the Trainer gets the same rows in the same order."""
    from fedtune.tokenize.blocks import BlockOrder

    blocks = RandomBlocks(spec)
    global_batch = spec["micro_batch"] * spec["accumulation"]
    order = BlockOrder(len(blocks), global_batch, spec["micro_batch"], 1, spec["seed"])
    micro = [indices for step in range(spec["steps"]) for indices in order.micro_batches(step, 0)]
    return blocks, order, micro


def peak_memory(device) -> dict:
    """The peak of live tensors (what docs/scaling.md's formula counts) and, on CUDA, of the caching
    allocator's reserve (what the GPU must hold: live tensors plus fragmentation)."""
    import torch

    if device.type == "cuda":
        return {
            "peak_mem_mb": torch.cuda.max_memory_allocated(device) / 2**20,
            "peak_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20,
        }
    return {"peak_mem_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fedtune_worker(spec: dict) -> dict:
    from types import SimpleNamespace

    from fedtune.train import distributed, loading, speed
    from fedtune.train import loop as train
    from fedtune.train.options import TrainOptions

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    options = TrainOptions.from_mapping(
        {
            **run_options(spec),
            "nodes": 1,
            "processes_per_node": 1,
            "precision": spec["precision"],
            "device": spec["device"],
            "micro_batch": spec["micro_batch"],
            "global_batch": spec["micro_batch"] * spec["accumulation"],
            "lr": lr_of(spec),
            "betas": [0.9, 0.95],
            "weight_decay": 0.0,
            "grad_clip": 1.0,
            **options_of(spec),
        },
        source=f"gpu_training {spec['name']}",
    )
    job = distributed.start(options.device)
    model_dir = Path(spec["model_dir"])
    # As fedtune.train.loop loads its starting weights (meta device for FSDP, zero.Init for ZeRO-3).
    backend = loading.load_backend(model_dir, options, job, spec["accumulation"], task="causal-lm")
    if spec["name"] in COMPILE_MODEL and spec["compile"]:
        backend.model.compile()  # the FSDP2 root: dynamo leaves its hooks out (skip_fsdp_hooks)
    blocks, order, _ = data_order(spec)
    run = SimpleNamespace(blocks=blocks, order=order, job=job, backend=backend, options=options, first_step=0)
    stop = SimpleNamespace(signal=None)
    durations, losses = [], []
    synchronize(job.device)
    for step in range(spec["steps"]):
        t0 = time.perf_counter()
        loss, _, _, _ = train.train_step(run, step, lr_of(spec), stop)
        losses.append(loss)
        durations.append(time.perf_counter() - t0)
    out = {"durations": durations, "losses": losses, **peak_memory(job.device)}
    if options.adapter:
        out["trainable_params"] = sum(p.numel() for p in backend.model.parameters() if p.requires_grad)
    out["compiled_layers"] = speed.compiled_layers(backend.model if options.fsdp else backend.engine.module)
    out["options"] = options.to_dict()
    distributed.stop()
    return out


COLUMNS = ("tokens_per_s", "mfu", "mfu_causal", "peak_mem_mb", "first_loss", "final_loss", "wall_s")


def run_spec(name: str, spec: dict) -> dict:
    """What a run changes in the shared settings: its micro batch (MICRO_FACTOR)."""
    factor = MICRO_FACTOR.get(name, 1)
    return {
        "micro_batch": factor * spec["micro_batch"],
        "accumulation": max(1, spec["accumulation"] // factor),
    }


def run_options(spec: dict) -> dict:
    """RUNS[name], with QLoRA's 4-bit base left out on CPU (bitsandbytes needs CUDA): the smoke run then
    rehearses the same adapter over an unquantized base."""
    options = dict(RUNS[spec["name"]])
    if "adapter" in options and spec["device"] == "cpu":
        options["adapter"] = {**options["adapter"], "quantize": "none"}
    return options


def lr_of(spec: dict) -> float:
    return spec["adapter_lr"] if "adapter" in RUNS[spec["name"]] else spec["lr"]


def options_of(spec: dict) -> dict:
    """The speed options of a fedtune run: fsdp_fast compiles (unless --no-compile) and checkpoints every
    N-th layer; the others checkpoint every layer when --checkpoint-every is given."""
    fast = spec["name"].startswith("fsdp_fast")
    every = spec["checkpoint_every"]
    if spec["name"] == "qlora":  # the adapter's run: no compilation, recomputation as the others'
        return {"compile": False, "gradient_checkpointing": bool(every)}
    return {
        "compile": fast and spec["compile"],
        "gradient_checkpointing": (every if fast else True) if every else False,
        **RUN_EXTRA.get(spec["name"], {}),
    }


def save_model(spec: dict) -> int:
    """The starting weights, written once by the driver for every run (fedtune loads from a folder, and
    checks it as the download stage leaves it); returns the parameter count. In bf16 for a bf16 run, as
    Llama checkpoints come, which halves the writing and hashing; every run converts them to fp32."""
    import torch

    from fedtune.core.models import record_checksums

    # Drawn on the GPU where there is one: a few seconds there, minutes for 2.7B on the host.
    with torch.device(spec["device"]):
        model = build_model(spec)
    if spec["precision"] == "bf16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(spec["model_dir"])
    record_checksums(spec["model_dir"])
    return sum(p.numel() for p in model.parameters())


def trainer_worker(spec: dict) -> dict:
    import torch
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    device = torch.device(spec["device"])
    model = LlamaForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    blocks, _, micro = data_order(spec)
    # A plain list of rows: the Trainer takes any sized dataset (no `datasets` needed on the GPU machine).
    data = [{"input_ids": row, "labels": row.clone()} for indices in micro for row in blocks.get(indices)[0]]

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_step_begin(self, args, state, control, **kwargs):
            if not self.ends:
                synchronize(device)
                self.ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            synchronize(device)
            self.ends.append(time.perf_counter())

    class Sequential(Trainer):
        """The rows in the order the fedtune runs see them (the Trainer shuffles by default)."""

        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    times = StepTimes()
    cuda = device.type == "cuda"
    args = TrainingArguments(
        output_dir=spec["scratch"],
        use_cpu=not cuda,
        bf16=spec["precision"] == "bf16",
        per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=spec["accumulation"],
        gradient_checkpointing=bool(spec["checkpoint_every"]),
        gradient_checkpointing_kwargs={"use_reentrant": False},
        max_steps=spec["steps"],
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch_fused" if cuda else "adamw_torch",
        dataloader_pin_memory=cuda,
        seed=spec["seed"],
        save_strategy="no",
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
    )
    trainer = Sequential(model=model, args=args, train_dataset=data, callbacks=[times])
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    durations = [b - a for a, b in zip(times.ends[:-1], times.ends[1:], strict=True)]
    return {"durations": durations, "losses": losses, **peak_memory(device)}


def build_worker(spec: dict) -> dict:
    import torch

    name = torch.cuda.get_device_name(0) if spec["device"] == "cuda" else "CPU (smoke)"
    return {"parameters": save_model(spec), "device_name": name}


def worker(spec: dict) -> None:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    if spec["name"] == "build":  # in its own process too: the driver holds no CUDA context or memory
        out = build_worker(spec)
    elif is_trainer(spec["name"]):
        out = trainer_worker(spec)
    else:
        out = fedtune_worker(spec)
    Path(spec["result"]).write_text(json.dumps(out))


# -- the driver ------------------------------------------------------------------------------------


def contained_env(work: Path) -> dict:
    """The workers' environment: every cache and temporary file of the stack inside `work`, unless the
    caller chose a folder (the tests share compiled DeepSpeed ops between runs that way)."""
    folders = {
        "TMPDIR": "tmp",
        "TORCHINDUCTOR_CACHE_DIR": "inductor",
        "TRITON_CACHE_DIR": "triton",
        "TORCH_EXTENSIONS_DIR": "torch-extensions",
        "HF_HOME": "hf-home",
        "XDG_CACHE_HOME": "cache",
    }
    env = {name: os.environ.get(name) or str(work / folder) for name, folder in folders.items()}
    for folder in env.values():
        Path(folder).mkdir(parents=True, exist_ok=True)
    pythonpath = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, **env, "PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1"}


def run_one(spec: dict, work: Path, timeout: float, logs: Path | None) -> dict:
    """One run in its own process; {"error": ...} instead of its figures when it fails or times out."""
    name = spec["name"]
    spec = {**spec, "result": str(work / f"{name}.json"), "scratch": str(work / name)}
    log = (logs or work) / f"{name}.log"
    start = time.perf_counter()
    with open(log, "w") as stream:
        try:
            code = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
                cwd=ROOT, env=contained_env(work), stdout=stream, stderr=subprocess.STDOUT, timeout=timeout,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"error": f"stopped after {timeout:.0f} s (--budget-s)"}
    wall = time.perf_counter() - start
    if code != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        print(f"[gpu benchmark] {name} exited {code}; the end of its log:\n{tail}", file=sys.stderr)
        # The exception's own line, not the warnings that a dying process prints after it.
        lines = tail.strip().splitlines() or [""]
        errors = [line for line in lines if re.search(r"\w+(Error|Exception): ", line)]
        return {"error": f"exited {code}: " + (errors or lines)[-1][:300]}
    out = json.loads(Path(spec["result"]).read_text())
    out["wall_s"] = wall
    return out


def summarise(spec: dict, raw: dict, flops: dict, peak: float | None) -> dict:
    if "error" in raw:
        return {"error": raw["error"]}
    measured = raw["durations"][spec["measure_after"] :]
    tokens_per_step = spec["micro_batch"] * spec["accumulation"] * spec["seq"]
    tokens_per_s = len(measured) * tokens_per_step / sum(measured)
    # MFU counts a full model's 6 N: an adapter's run (frozen base, no weight gradients) has none.
    counted = peak is not None and "adapter" not in (RUNS[spec["name"]] or {})
    row = {
        "tokens_per_s": round(tokens_per_s, 1),
        "median_step_s": round(statistics.median(measured), 4),
        "mfu": round(tokens_per_s * flops["total"] / (peak * 1e12), 4) if counted else None,
        "mfu_causal": round(tokens_per_s * flops["total_causal"] / (peak * 1e12), 4) if counted else None,
        "peak_mem_mb": round(raw["peak_mem_mb"], 1),
        "first_loss": round(raw["losses"][0], 6),
        "final_loss": round(raw["losses"][-1], 6),
        "steps": len(raw["durations"]),
        "wall_s": round(raw["wall_s"], 1),
    }
    for key in ("peak_reserved_mb", "trainable_params", "compiled_layers", "options"):
        if key in raw:
            row[key] = raw[key]
    row.update(planned_memory(spec))
    return row


def planned_memory(spec: dict) -> dict:
    """docs/scaling.md's formula (fedtune.train.memory_plan) for an FSDP2 run's device memory, beside
    what it measured: the formula counts live tensors, as torch.cuda.max_memory_allocated does."""
    from fedtune.train import memory_plan

    options = RUNS[spec["name"]]
    if not options or options.get("backend") != "fsdp" or options.get("sharding") != "full":
        return {}
    if spec["name"] in RUN_EXTRA:  # every N-th layer recomputed: the formula knows all or none
        return {}
    a = spec["architecture"]
    shape = memory_plan.Shape(
        spec["name"], a["hidden_size"], a["num_hidden_layers"], a["num_attention_heads"],
        a.get("num_key_value_heads", a["num_attention_heads"]), a["intermediate_size"], a["vocab_size"],
        tied=a.get("tie_word_embeddings", False),
    )  # fmt: skip
    setup = memory_plan.Setup(
        "full", 1, precision=spec["precision"], micro_batch=spec["micro_batch"], seq=spec["seq"],
        checkpointing=bool(spec["checkpoint_every"]),
    )  # fmt: skip
    parts = memory_plan.per_device(shape, setup)
    return {"plan_mem_mb": round(parts["total"] / 2**20, 1),
            "plan_parts_mb": {k: round(v / 2**20, 1) for k, v in parts.items()}}  # fmt: skip


def mb(value) -> str:
    return "-" if value is None else f"{value:,.0f}"


def markdown(report: dict) -> str:
    lines = [
        f"{report['device']}: {report['settings']['parameters'] / 1e9:.2f}B parameters, seq "
        f"{report['settings']['seq']}, {report['settings']['precision']}, "
        f"{report['settings']['tokens_per_step']} tokens per step",
        "",
        "| run | tokens/s | vs Trainer | MFU | MFU (causal) | peak memory MB | reserved MB | planned MB "
        "| first loss | final loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in report["runs"].items():
        if "error" in row:
            lines.append(f"| {name} | {row['error']} | | | | | | | | |")
            continue
        ratio = report["ratio_to_hf_trainer"].get(name, 1.0 if is_trainer(name) else None)

        def pct(v):
            return "-" if v is None else f"{100 * v:.1f}%"

        lines.append(
            f"| {name} | {row['tokens_per_s']:,.0f} | {'-' if ratio is None else f'{ratio:.2f}'} | "
            f"{pct(row['mfu'])} | {pct(row['mfu_causal'])} | {row['peak_mem_mb']:,.0f} | "
            f"{mb(row.get('peak_reserved_mb'))} | {mb(row.get('plan_mem_mb'))} | "
            f"{row['first_loss']:.4f} | {row['final_loss']:.4f} |"
        )
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model, CPU, fp32, a few steps")
    parser.add_argument("--runs", default="all", help=f"comma-separated subset of {','.join(RUNS)}")
    parser.add_argument("--seq", type=int, help="sequence length (2048; smoke 64)")
    parser.add_argument("--micro-batch", type=int, help="sequences per micro batch (1; smoke 2)")
    parser.add_argument("--arch", choices=[a for a in ARCHITECTURES if a != "smoke"], default="2.7b",
                        help="the model's shape (ARCHITECTURES; default 2.7b)")  # fmt: skip
    parser.add_argument("--accumulation", type=int, help="micro batches per optimizer step (8; smoke 2)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (20; smoke 3)")
    parser.add_argument("--measure-after", type=int, help="steps left out of tokens/s (5; smoke 1)")
    parser.add_argument("--checkpoint-every", type=int, default=0,
                        help="activation checkpointing: 0 off; N: fsdp_fast every N-th layer, others all")  # fmt: skip
    parser.add_argument("--no-compile", action="store_true", help="fsdp_fast without torch.compile")
    parser.add_argument("--peak-tflops", type=float, help="the device's peak, where PEAK_TFLOPS lacks it")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--adapter-lr", type=float, default=1e-3, help="the qlora run's learning rate")
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="start no run after this many seconds, and stop a run that reaches it")  # fmt: skip
    parser.add_argument("--workdir", type=Path,
                        help="folder for the starting weights and every cache (default: a temporary one, removed)")  # fmt: skip
    parser.add_argument("--logs", type=Path, help="folder to keep each run's log in")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    import torch

    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        sys.exit("gpu_training.py: no CUDA device; run it on a GPU machine, or use --smoke on CPU")
    started = time.perf_counter()
    names = list(RUNS) if args.runs == "all" else args.runs.split(",")
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        sys.exit(f"gpu_training.py: --runs: unknown {unknown}; choose from {list(RUNS)}")
    architecture = ARCHITECTURES["smoke" if smoke else args.arch]
    spec = {
        "architecture": architecture,
        "seq": args.seq or (64 if smoke else 2048),
        "micro_batch": args.micro_batch or (2 if smoke else 1),
        "accumulation": args.accumulation or (2 if smoke else 8),
        "steps": args.steps or (3 if smoke else 20),
        "measure_after": args.measure_after if args.measure_after is not None else (1 if smoke else 5),
        "precision": "fp32" if smoke else "bf16",
        "device": "cpu" if smoke else "cuda",
        "checkpoint_every": args.checkpoint_every,
        # Compiling on CPU takes minutes and measures nothing the smoke test needs.
        "compile": not (smoke or args.no_compile),
        "lr": args.lr,
        "adapter_lr": args.adapter_lr,
        "seed": 1234,
    }
    if spec["steps"] <= spec["measure_after"]:
        sys.exit("gpu_training.py: --steps must exceed --measure-after")
    flops = flops_per_token(architecture, spec["seq"])
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="fedtune-gpu-bench-", dir=args.workdir) as tmp:
        work = Path(tmp)
        spec["model_dir"] = str(work / "model")
        built = run_one({**spec, "name": "build"}, work, args.budget_s, args.logs)
        if "error" in built:
            sys.exit(f"gpu_training.py: building the starting weights failed: {built['error']}")
        device_name, parameters = built["device_name"], built["parameters"]
        peak = args.peak_tflops or (None if smoke else peak_tflops(device_name))
        for name in names:
            left = args.budget_s - (time.perf_counter() - started)
            if left <= 0:
                runs[name] = {"error": f"not started: --budget-s {args.budget_s:.0f} spent"}
                continue
            print(f"[gpu benchmark] {name} ...", file=sys.stderr, flush=True)
            one = {**spec, "name": name, **run_spec(name, spec)}
            runs[name] = summarise(one, run_one(one, work, left, args.logs), flops, peak)
            print(f"[gpu benchmark] {name}: {json.dumps(runs[name])}", file=sys.stderr, flush=True)
            if args.out:  # what was measured survives a stop at the call's time limit
                args.out.write_text(json.dumps({"device": device_name, "runs": runs}, indent=2) + "\n")
    ok = {n: r for n, r in runs.items() if "error" not in r}
    # Against the Trainer at the same micro batch only.
    trainers = {MICRO_FACTOR.get(n, 1): r["tokens_per_s"] for n, r in ok.items() if is_trainer(n)}
    ratios = {
        n: round(r["tokens_per_s"] / trainers[MICRO_FACTOR.get(n, 1)], 3)
        for n, r in ok.items()
        if not is_trainer(n) and MICRO_FACTOR.get(n, 1) in trainers
    }
    report = {
        "device": device_name,
        "peak_tflops": peak,
        "torch": torch.__version__,
        "settings": {
            **{k: v for k, v in spec.items() if k not in ("architecture",)},
            "architecture": architecture,
            "parameters": parameters,
            "tokens_per_step": spec["micro_batch"] * spec["accumulation"] * spec["seq"],
            "flops_per_token": flops,
        },
        "runs": runs,
        "ratio_to_hf_trainer": ratios,
    }
    report["wall_s"] = round(time.perf_counter() - started, 1)
    full = {n: r for n, r in ok.items() if not is_trainer(n) and "adapter" not in (RUNS[n] or {})}
    if full and peak is not None:
        best = max(full, key=lambda n: full[n]["mfu"])
        report["best_mfu_run"] = best
        report["goal_mfu_45"] = full[best]["mfu"] >= 0.45
    if ratios:
        report["goal_1_2x_trainer"] = max(ratios.values()) >= 1.2
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    print(markdown(report), file=sys.stderr)
    return 0 if len(ok) == len(runs) and all(math.isfinite(r["final_loss"]) for r in ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
