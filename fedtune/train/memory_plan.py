"""How much memory a training run needs per GPU (or per CPU process), from the model's shape and the train
options, for each way fedtune can shard it; and how long an epoch takes at a given MFU. docs/scaling.md
is this module's output (`python -m fedtune.train.memory_plan`), and tests/test_memory_plan.py checks the same
formulas against the peak a real train run measures on CPU.

Per device, for P parameters (L layers of Lp each, R in the embedding, final norm and head), a shard
group of S devices, a world of W, low-precision bytes l (2 for bf16/fp16, 4 for fp32):

    FSDP2 (fedtune's FSDPBackend: fp32 sharded parameters, bf16 compute copies, fp32 gradient reduction)
      sharded state        16 P / S   (fp32 parameter 4 + fp32 gradient 4 + Adam's two moments 8)
      working parameters   l R + 2 l Lp                reshard after forward (full, hybrid): the root's
                           l P                         all-gathered weights and two layers in flight
                                                       (current + prefetched); hybrid_zero2 keeps every
                                                       layer gathered from its forward to its backward
      unsharded gradients  (l + 4) max(Lp, R)          one unit's gradient and its fp32 reduce copy
      optimizer step       4 P / S on CPU, 0 on a GPU  foreach AdamW's parameter-sized temporaries; on
                                                       CUDA fedtune's AdamW is fused and holds none
    DeepSpeed ZeRO (bf16 weights in the module, fp32 master weights in the optimizer)
      ZeRO-2               l P + l P / W + 16 P / W + bucket   (replicated weights; gradients,
                                                               master, fp32 gradient, Adam sharded)
      ZeRO-3               (l + l + 16) P / W + l (R + 2 Lp) + bucket
      (both, + 4 P / W for the optimizer step's temporaries on CPU, where torch's AdamW is foreach;
       none on a GPU, where it is fused, nor with the optimizer offloaded)
      offload_optimizer    moves the 16 P / W (master, fp32 gradient, Adam) to host memory
      offload_params       (ZeRO-3) moves the l P / W weight shards to host memory
      bucket               DeepSpeed's reduce bucket, min(P, 5e8) elements of l bytes
    activations (both)     per layer and token: 2 (4 + l) h (two RMSNorms: fp32 input, normed output)
                           + l (3 h + 2 h kv / heads) (q, attention output, o_proj input, k and v)
                           + 4 l f (SwiGLU: gate, up, silu, product); with SDPA, no s x s term;
                           activation checkpointing keeps only each layer's input (l h) plus one
                           layer's full set during its recomputation; logits (2 l + 8) V per token
                           (low-precision logits and their gradient, the fp32 copy the loss takes and
                           its log-softmax).

A configuration fits a GPU when this total plus CUDA_RESERVE (context, workspace, allocator
fragmentation) is at most the GPU's memory.

Measured on one H100 80GB (benchmarks/gpu_training.py, 2026-11-27; a 2.70B Llama, FSDP2 full, bf16,
seq 2048): the peak of live tensors (torch.cuda.max_memory_allocated) was 50.2 GB with torch.compile and
52.5 GB without at micro batch 1, 56.4 GB compiled at micro batch 2, against 53.0 / 53.0 / 61.1 GB from
this formula (+5%, +1%, +8%; compiled layers keep fewer activations than the eager count here). The
caching allocator reserved 1.23-1.29x the live peak under FSDP2: CUDA_RESERVE_SHARE is set from that."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

from fedtune.core import cli
from fedtune.core.options import UserError

GiB = 2**30
# CUDA context (~0.5-1 GB), cuBLAS/NCCL workspaces and the caching allocator's fragmentation: a fixed
# part and a share of the rest. The share is measured: on an H100, FSDP2's reserved peak was 1.23-1.29x
# its live peak (module docstring), so 2 GiB + 25% covers every run measured there.
CUDA_RESERVE_BYTES = 2 * GiB
CUDA_RESERVE_SHARE = 0.25
DEEPSPEED_BUCKET = 500_000_000  # elements: reduce_bucket_size's default
FSDP_MODES = ("full", "hybrid", "hybrid_zero2")
ZERO_MODES = ("zero2", "zero3")
MODES = FSDP_MODES + ZERO_MODES


@dataclass(frozen=True)
class Shape:
    """A Llama-architecture decoder, as its config.json gives it."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return 2 * h * h + 2 * h * kv + 3 * h * self.ffn + 2 * h  # q, o; k, v; MLP; two norms

    @property
    def root_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params


LLAMA2 = {
    "7B": Shape("Llama-2-7B", 4096, 32, 32, 32, 11008, 32000),
    "13B": Shape("Llama-2-13B", 5120, 40, 40, 40, 13824, 32000),
    "70B": Shape("Llama-2-70B", 8192, 80, 64, 8, 28672, 32000),
}


@dataclass(frozen=True)
class Cluster:
    name: str
    gpu: str
    gpu_bytes: int
    gpus_per_node: int
    node_ram_bytes: int
    low_precision: str  # bf16, or fp16 where the GPU has no bf16


CLUSTERS = (
    Cluster("Leonardo", "A100 64 GB", 64 * 10**9, 4, 494_000 * 2**20, "bf16"),
    Cluster("Karolina", "A100 40 GB", 40 * 10**9, 8, 900_000 * 2**20, "bf16"),
    Cluster("MeluXina", "A100 40 GB", 40 * 10**9, 4, 512 * 10**9, "bf16"),
    Cluster("Iris", "V100 32 GB", 32 * 10**9, 4, 768 * 10**9, "fp16"),
    Cluster("Iris", "V100 16 GB", 16 * 10**9, 4, 768 * 10**9, "fp16"),
)


@dataclass(frozen=True)
class Setup:
    mode: str  # one of MODES
    gpus_per_node: int
    nodes: int = 1
    precision: str = "bf16"  # bf16, fp16 or fp32
    micro_batch: int = 1
    seq: int = 2048
    checkpointing: bool = False
    offload_optimizer: bool = False
    offload_params: bool = False
    # "cuda": fedtune's AdamW is fused (no parameter-sized temporaries); "cpu": foreach, which has them.
    device: str = "cuda"

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def low_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    def check(self) -> None:
        if self.mode not in MODES:
            raise UserError(f"mode: {self.mode!r} is not one of {MODES}")
        if (self.offload_optimizer or self.offload_params) and self.mode not in ZERO_MODES:
            raise UserError(f"{self.mode}: offload is a DeepSpeed option (zero2, zero3)")
        if self.offload_params and self.mode != "zero3":
            raise UserError("offload_params needs zero3")
        if self.device not in ("cuda", "cpu"):
            raise UserError(f"device: {self.device!r} is not cuda or cpu")


def activations(shape: Shape, setup: Setup) -> int:
    """Bytes of saved activations and logits for one micro batch (module docstring)."""
    lo, h, f = setup.low_bytes, shape.hidden, shape.ffn
    tokens = setup.micro_batch * setup.seq
    kv_share = shape.kv_heads / shape.heads
    norm = 4 + (lo if lo < 4 else 0)  # fp32 input (the input itself in fp32) and the normed output
    per_layer = 2 * norm * h + lo * (3 * h + 2 * h * kv_share) + 4 * lo * f
    if setup.checkpointing:
        layers = shape.layers * lo * h + per_layer
    else:
        layers = shape.layers * per_layer
    logits = (2 * lo + 8) * shape.vocab if lo < 4 else 12 * shape.vocab
    return int(tokens * (layers + logits + norm * h))


def per_device(shape: Shape, setup: Setup) -> dict[str, int]:
    """Bytes per device by component; `total` is their sum."""
    setup.check()
    lo, P, Lp, R = setup.low_bytes, shape.params, shape.layer_params, shape.root_params
    W = setup.world
    parts: dict[str, int] = {}
    if setup.mode in FSDP_MODES:
        S = W if setup.mode == "full" else setup.gpus_per_node
        parts["sharded_state"] = 16 * P // S
        parts["working_params"] = lo * P if setup.mode == "hybrid_zero2" else lo * R + 2 * lo * Lp
        parts["unsharded_grads"] = (lo + (4 if lo < 4 else 0)) * max(Lp, R)
        parts["optimizer_temporaries"] = 4 * P // S if setup.device == "cpu" else 0
    else:
        bucket = min(P, DEEPSPEED_BUCKET) * lo
        optimizer = 0 if setup.offload_optimizer else 16 * P // W
        if setup.mode == "zero2":
            parts["weights"] = lo * P
            parts["grad_shard"] = lo * P // W
        else:
            parts["weights"] = 0 if setup.offload_params else lo * P // W
            parts["grad_shard"] = lo * P // W
            parts["working_params"] = lo * (R + 2 * Lp)
        parts["optimizer_state"] = optimizer
        foreach = setup.device == "cpu" and not setup.offload_optimizer
        parts["optimizer_temporaries"] = 4 * P // W if foreach else 0
        parts["bucket"] = bucket
    parts["activations"] = activations(shape, setup)
    parts["total"] = sum(parts.values())
    return parts


def host_per_node(shape: Shape, setup: Setup, *, load_once: bool = False) -> int:
    """Host memory a node needs: the starting weights (fp32, once per process as fedtune.train.loop loads
    them today, or once per node with `load_once`) or the offloaded optimizer and weight shards,
    whichever is larger (loading ends before training starts)."""
    G = setup.gpus_per_node
    loading = 4 * shape.params * (1 if load_once else G)
    offloaded = 0
    if setup.offload_optimizer:
        offloaded += 16 * shape.params * G // setup.world
    if setup.offload_params:
        offloaded += setup.low_bytes * shape.params * G // setup.world
    return max(loading, offloaded)


def fits(total: int, gpu_bytes: int) -> bool:
    return total + CUDA_RESERVE_BYTES + CUDA_RESERVE_SHARE * total <= gpu_bytes


def cpu_process(shape: Shape, setup: Setup) -> dict[str, int]:
    """The same components for one CPU process (foreach AdamW's temporaries included): what its peak
    resident memory adds to the interpreter's (tests/test_memory_plan.py measures it)."""
    return per_device(shape, replace(setup, device="cpu"))


# -- time per epoch ----------------------------------------------------------------------------------


def flops_per_token(matmul_params: int, layers: int, hidden: int, seq: int) -> float:
    """6 N + 12 L s d (benchmarks/gpu_training.py derives it): N the parameters in matrix multiplies."""
    return 6 * matmul_params + 12 * layers * seq * hidden


def epoch_hours(tokens: float, flops: float, gpus: int, peak_tflops: float, mfu: float) -> float:
    """Hours to train on `tokens` (padding included: it is computed on) at `mfu` of `gpus` peaks."""
    return tokens * flops / (gpus * peak_tflops * 1e12 * mfu) / 3600


# -- the tables of docs/scaling.md -------------------------------------------------------------------


def configurations(cluster: Cluster):
    """(label, Setup) for each sharding mode with and without offload and checkpointing, one node."""
    base = {"gpus_per_node": cluster.gpus_per_node, "precision": cluster.low_precision}
    for checkpointing in (False, True):
        suffix = " + AC" if checkpointing else ""
        for mode in MODES:
            yield f"{mode}{suffix}", Setup(mode, checkpointing=checkpointing, **base)
        yield (
            f"zero2 + offload opt{suffix}",
            Setup("zero2", checkpointing=checkpointing, offload_optimizer=True, **base),
        )
        yield (
            f"zero3 + offload opt+params{suffix}",
            Setup("zero3", checkpointing=checkpointing, offload_optimizer=True, offload_params=True, **base),
        )


def memory_table(shape: Shape, *, micro_batch: int = 1, seq: int = 2048, nodes: int = 1) -> str:
    header = [
        c.name + " " + c.gpu.split()[0] + " " + c.gpu.split()[1] + f" x{c.gpus_per_node}" for c in CLUSTERS
    ]
    lines = [
        f"| {shape.name}, micro batch {micro_batch} x {seq}, {nodes} node(s) | " + " | ".join(header) + " |",
        "|---|" + "---:|" * len(CLUSTERS),
    ]
    labels = [label for label, _ in configurations(CLUSTERS[0])]
    for i, label in enumerate(labels):
        cells = []
        for cluster in CLUSTERS:
            setup = list(configurations(cluster))[i][1]
            setup = Setup(**{**setup.__dict__, "micro_batch": micro_batch, "seq": seq, "nodes": nodes})
            total = per_device(shape, setup)["total"]
            host = host_per_node(shape, setup, load_once=True)
            ok = fits(total, cluster.gpu_bytes) and host <= cluster.node_ram_bytes
            cells.append(f"{total / 1e9:.1f} {'fits' if ok else '-'}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def min_nodes(shape: Shape, cluster: Cluster, setup: Setup, limit: int = 64) -> int | None:
    """The fewest nodes on which `setup` fits `cluster`'s GPUs and host memory, up to `limit`."""
    for nodes in range(1, limit + 1):
        trial = Setup(**{**setup.__dict__, "nodes": nodes, "gpus_per_node": cluster.gpus_per_node})
        total = per_device(shape, trial)["total"]
        if (
            fits(total, cluster.gpu_bytes)
            and host_per_node(shape, trial, load_once=True) <= cluster.node_ram_bytes
        ):
            return nodes
    return None


def nodes_table(shape: Shape, *, micro_batch: int = 1, seq: int = 2048) -> str:
    header = [f"{c.name} {c.gpu}" for c in CLUSTERS]
    lines = [
        f"| {shape.name}: fewest nodes | " + " | ".join(header) + " |",
        "|---|" + "---:|" * len(CLUSTERS),
    ]
    for i, (label, _) in enumerate(configurations(CLUSTERS[0])):
        cells = []
        for cluster in CLUSTERS:
            setup = list(configurations(cluster))[i][1]
            setup = Setup(**{**setup.__dict__, "micro_batch": micro_batch, "seq": seq})
            n = min_nodes(shape, cluster, setup)
            cells.append("never" if n is None else str(n))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@dataclass(frozen=True)
class Workload:
    """One site of an example config: its data per epoch and the GPUs it trains on. `tokens` and
    `mfu` are ASSUMED (the notes say from what) until the tokenize manifests and the GPU benchmark
    give measured ones."""

    config: str
    site: str
    gpus: str
    gpu_count: int
    peak_tflops: float
    matmul_params: float
    layers: int
    hidden: int
    seq: int
    tokens: float
    epochs: float
    mfu: float
    notes: str


def _llama7b_matmul() -> int:
    shape = LLAMA2["7B"]
    return shape.params - shape.vocab * shape.hidden


WORKLOADS = (
    Workload("llama2-it-cs", "cs", "Karolina 2 x 8 A100 40 GB", 16, 312, _llama7b_matmul(), 32, 4096, 2048,
             1_000_000 * 2048, 1, 0.30,
             "max_documents 1,000,000, padding: one 2048-token block per document (longer ones truncated)"),
    Workload("llama2-it-cs", "it (1M docs)", "Leonardo 4 x 4 A100 64 GB", 16, 312, _llama7b_matmul(), 32,
             4096, 2048, 1_000_000 * 2048, 1, 0.30,
             "clean_mc4_it tiny: 1M-10M documents (the dataset card's size category); low end"),
    Workload("llama2-it-cs", "it (10M docs)", "Leonardo 4 x 4 A100 64 GB", 16, 312, _llama7b_matmul(), 32,
             4096, 2048, 10_000_000 * 2048, 1, 0.30, "high end of the same range"),
    Workload("gpt2-wikitext(-deepspeed)", "wiki", "MeluXina 2 x 4 A100 40 GB", 8, 312, 124e6, 12, 768, 1024,
             2.4e6, 3, 0.25, "wikitext-2 train: ~2.4M GPT-2 tokens, packed"),
    Workload("gpt2-scratch", "wiki", "MeluXina 1 x 4 A100 40 GB", 4, 312, 124e6, 12, 768, 512,
             5000 * 64 * 512, 1, 0.25, "max_steps 5000 x 64 blocks x 512: the run, not an epoch"),
    Workload("opt125m-yelp", "yelp", "Iris 1 x 4 V100 (fp16)", 4, 125, 124e6, 12, 768, 512,
             650_000 * 180, 1, 0.25, "Yelp review full train: 650k reviews x ~180 tokens, packed"),
    Workload("distilbert-imdb", "imdb", "Karolina 1 x 2 A100 40 GB", 2, 312, 43e6, 6, 768, 512,
             25_000 * 512, 2, 0.25, "IMDB train: 25k reviews, padding: one 512-token block each"),
)  # fmt: skip


def epoch_table() -> str:
    lines = [
        "| example | site | GPUs | tokens per epoch | epochs | FLOPs per token | assumed MFU | hours per epoch | notes |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for w in WORKLOADS:
        flops = flops_per_token(int(w.matmul_params), w.layers, w.hidden, w.seq)
        hours = epoch_hours(w.tokens, flops, w.gpu_count, w.peak_tflops, w.mfu)
        lines.append(
            f"| {w.config} | {w.site} | {w.gpus} | {w.tokens / 1e6:,.1f}M | {w.epochs:g} | "
            f"{flops / 1e9:.2f} G | {w.mfu:.0%} | {hours:.3g} | {w.notes} |"
        )
    return "\n".join(lines)


def example_table() -> str:
    """The Llama-2-7B example's two sites as configured (config/examples/llama2-it-cs.yaml)."""
    shape = LLAMA2["7B"]
    rows = (
        (
            "it: hybrid_zero2 + AC, micro 4",
            CLUSTERS[0],
            Setup("hybrid_zero2", 4, 4, micro_batch=4, checkpointing=True),
        ),
        ("cs: hybrid + AC, micro 4", CLUSTERS[1], Setup("hybrid", 8, 2, micro_batch=4, checkpointing=True)),
        ("cs: hybrid + AC, micro 2", CLUSTERS[1], Setup("hybrid", 8, 2, micro_batch=2, checkpointing=True)),
        ("cs: full + AC, micro 4", CLUSTERS[1], Setup("full", 8, 2, micro_batch=4, checkpointing=True)),
    )
    lines = [
        "| site, setting | GPU | state + optimizer step | working + grads | activations | total | fits |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for label, cluster, setup in rows:
        parts = per_device(shape, setup)
        working = parts["working_params"] + parts["unsharded_grads"]
        state = parts["sharded_state"] + parts["optimizer_temporaries"]
        lines.append(
            f"| {label} | {cluster.name} {cluster.gpu} | {state / 1e9:.1f} | {working / 1e9:.1f} | "
            f"{parts['activations'] / 1e9:.1f} | {parts['total'] / 1e9:.1f} | "
            f"{'yes' if fits(parts['total'], cluster.gpu_bytes) else 'no'} |"
        )
    return "\n".join(lines)


@cli.entry("fedtune.train.memory_plan")
def main(argv=None) -> None:
    parser = cli.parser("fedtune.train.memory_plan", "Memory per GPU of each sharding mode (docs/scaling.md)")
    parser.add_argument("--model", choices=sorted(LLAMA2), action="append")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--nodes", type=int, default=1)
    args = parser.parse_args(argv)
    for key in args.model or list(LLAMA2):
        print(memory_table(LLAMA2[key], micro_batch=args.micro_batch, seq=args.seq, nodes=args.nodes))
        print()
        print(nodes_table(LLAMA2[key], micro_batch=args.micro_batch, seq=args.seq))
        print()
    print(example_table())
    print()
    print(epoch_table())


if __name__ == "__main__":
    sys.exit(main())
