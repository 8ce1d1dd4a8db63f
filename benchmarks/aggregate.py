"""Benchmark of `fedtune.aggregate.merge` against a naive merge and against the I/O floor.

    .venv/bin/python benchmarks/aggregate.py [--sites 2] [--layers 11] [--workdir /tmp/fedtune-bench]

Builds N synthetic fp16 checkpoints with Llama-like names and shapes (hidden 2048, 32k vocabulary;
11 layers make 1.37 GB per site), sharded like save_pretrained, then measures, each from a cold page
cache:

- floor: reading every input (`cat > /dev/null`) plus writing the output's size with fsync;
- fedtune: `python -m fedtune.aggregate` (streaming, sha256 of inputs and outputs included);
- naive: the published run's way: from_pretrained every site, average the state dicts in fp32,
  save_pretrained;
- ties: `--method ties --density 0.5 --start START` (a third checkpoint as the round's start), against
  its own floor: reading the sites and the start, writing the output;
- fedadam: the second round of `--server-optimizer fedadam` (the first, unmeasured, writes the state),
  reading the sites, the start and the fp32 state (m, v), writing the output and the new state; its
  floor counts the state's read and write.

Wall time is the whole process (interpreter start and imports included). Memory is the peak of RssAnon
(private anonymous memory, sampled every 5 ms from /proc/<pid>/status): memory-mapped input pages are
file-backed and reclaimable, so they are not counted. The cache is dropped with /proc/sys/vm/drop_caches
when permitted, else each input file's pages are evicted with posix_fadvise(DONTNEED), which needs no
privilege. Prints one JSON object; --keep leaves the files in the workdir."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Python puts this folder first on sys.path, where benchmarks/tokenize.py would shadow the standard
# library's tokenize (which linecache imports on the first traceback).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
HIDDEN, INTERMEDIATE, VOCAB, HEADS = 2048, 5504, 32000, 16

NAIVE = r"""
import sys, torch
from transformers import AutoModelForCausalLM
out, dirs = sys.argv[1], sys.argv[2:]
models = [AutoModelForCausalLM.from_pretrained(d) for d in dirs]
states = [m.state_dict() for m in models]
avg = {k: sum(s[k].float() for s in states) / len(states) for k in states[0]}
models[0].load_state_dict({k: v.to(states[0][k].dtype) for k, v in avg.items()})
models[0].save_pretrained(out, max_shard_size="1GB")
"""


def llama_config(layers: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "dtype": "float16",
    }


def tensor_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}"
        for proj in ("q", "k", "v", "o"):
            shapes[f"{p}.self_attn.{proj}_proj.weight"] = (HIDDEN, HIDDEN)
        shapes[f"{p}.mlp.gate_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[f"{p}.mlp.up_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[f"{p}.mlp.down_proj.weight"] = (HIDDEN, INTERMEDIATE)
        shapes[f"{p}.input_layernorm.weight"] = (HIDDEN,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (HIDDEN,)
    shapes["model.norm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    return shapes


def make_checkpoint(folder: Path, layers: int, seed: int, shard_bytes: int) -> None:
    """A save_pretrained-like folder written shard by shard, so making it needs little memory."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(llama_config(layers), indent=2))
    gen = torch.Generator().manual_seed(seed)
    shapes = tensor_shapes(layers)
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = 2 * int(torch.tensor(shape).prod()) if shape else 2
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map = {}
    for k, names in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: (torch.randn(shapes[n], generator=gen) * 0.02).to(torch.float16) for n in names}
        save_file(tensors, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        del tensors
    total = sum(2 * int(torch.tensor(s).prod()) for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def drop_cache(files: list[Path]) -> str:
    """Evict the inputs from the page cache, then re-read the Python libraries: the benchmark times the
    merge from cold inputs, not a cold torch import (about 3 s here, the same for every model size)."""
    how = _evict(files)
    warm = "import torch, safetensors, transformers, fedtune.aggregate.merge"
    subprocess.run([sys.executable, "-c", warm], cwd=ROOT, check=True, capture_output=True)
    return how


def _evict(files: list[Path]) -> str:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        for file in files:
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "posix_fadvise(DONTNEED) per file"


def cached_fraction(files: list[Path]) -> float:
    """Share of the files' pages in the page cache (mincore), to show that a cold run really was cold."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    resident = total = 0
    for file in files:
        size = file.stat().st_size
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        with open(file, "rb") as f:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                return float("nan")
            resident += sum(v & 1 for v in bytes(vec))
            total += pages
        finally:
            libc.munmap(addr, size)
    return resident / total if total else 0.0


def run_measured(cmd: list[str], log: Path) -> dict:
    """Wall time and peak RssAnon of a command, sampled from /proc every 5 ms."""
    peak = [0]
    started = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)

        def sample():
            status = Path(f"/proc/{proc.pid}/status")
            while proc.poll() is None:
                try:
                    for line in status.read_text().splitlines():
                        if line.startswith("RssAnon:"):
                            peak[0] = max(peak[0], int(line.split()[1]) * 1024)
                except (FileNotFoundError, ProcessLookupError):
                    break
                time.sleep(0.005)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        rc = proc.wait()
        thread.join()
    wall = time.perf_counter() - started
    if rc != 0:
        raise SystemExit(f"{cmd[:3]} failed with exit code {rc}; see {log}:\n{log.read_text()[-3000:]}")
    return {"wall_s": round(wall, 2), "peak_rss_anon_mb": round(peak[0] / 1e6, 1)}


def floor(inputs: list[Path], out_bytes: int, scratch: Path) -> dict:
    started = time.perf_counter()
    subprocess.run(["cat", *map(str, inputs)], stdout=subprocess.DEVNULL, check=True)
    read = time.perf_counter() - started
    started = time.perf_counter()
    block = bytes(16 << 20)
    with open(scratch, "wb") as f:
        left = out_bytes
        while left > 0:
            left -= f.write(block[: min(left, len(block))])
        f.flush()
        os.fsync(f.fileno())
    write = time.perf_counter() - started
    scratch.unlink()
    return {"read_s": round(read, 2), "write_s": round(write, 2), "wall_s": round(read + write, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sites", type=int, default=2)
    parser.add_argument("--layers", type=int, default=11, help="11 layers: 1.37 GB per site in fp16")
    parser.add_argument("--shard-size", default="1GB", help="input and output shard size")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fedtune-bench"))
    parser.add_argument("--skip-naive", action="store_true")
    parser.add_argument(
        "--skip-methods", action="store_true", help="measure fedavg (and naive) only, not ties and fedadam"
    )
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints and outputs")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    from fedtune.aggregate.merge import parse_size

    shard_bytes = parse_size(args.shard_size)
    work = args.workdir
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    python = sys.executable
    try:
        started = time.perf_counter()
        sites = [work / f"site{k}" for k in range(args.sites)]
        for k, site in enumerate(sites):
            make_checkpoint(site, args.layers, seed=k, shard_bytes=shard_bytes)
        setup_s = time.perf_counter() - started
        inputs = sorted(p for site in sites for p in site.glob("*.safetensors"))
        site_bytes = [sum(p.stat().st_size for p in site.glob("*.safetensors")) for site in sites]
        shapes = tensor_shapes(args.layers)
        numels = [s[0] * (s[1] if len(s) > 1 else 1) for s in shapes.values()]
        largest_fp32 = 4 * max(numels)
        out_bytes = 2 * sum(numels)
        budget = min(shard_bytes, out_bytes) + 4 * largest_fp32 + 300e6

        result: dict = {
            "command": " ".join([Path(python).name, *sys.argv]),
            "sites": args.sites,
            "bytes_per_site": site_bytes,
            "largest_tensor_fp32_bytes": largest_fp32,
            "output_bytes": out_bytes,
            "shard_size": args.shard_size,
            "setup_s": round(setup_s, 1),
            "cpus": os.cpu_count(),
        }
        result["cache_drop"] = drop_cache(inputs)
        result["cached_after_drop"] = round(cached_fraction(inputs), 3)
        result["floor"] = floor(inputs, out_bytes, work / "floor.bin")

        drop_cache(inputs)
        result["cached_before_fedtune"] = round(cached_fraction(inputs), 3)
        cmd = [python, "-m", "fedtune.aggregate", "--out", str(work / "merged"), "--weights", "uniform"]
        cmd += ["--dtype", "float16", "--max-shard-size", args.shard_size, "--model"]
        cmd += [f"site{k}={site}" for k, site in enumerate(sites)]
        result["fedtune"] = run_measured(cmd, work / "fedtune.log")
        record = json.loads((work / "merged" / "aggregate.json").read_text())
        result["fedtune"]["in_process_s"] = record["wall_time_s"]
        result["fedtune"]["output_files"] = len(record["output"]["files"])

        if not args.skip_naive:
            drop_cache(inputs)
            result["cached_before_naive"] = round(cached_fraction(inputs), 3)
            script = work / "naive.py"
            script.write_text(NAIVE)
            result["naive"] = run_measured(
                [python, str(script), str(work / "naive"), *map(str, sites)], work / "naive.log"
            )
            # Same inputs, same mean: the outputs must agree (fp16 rounding of a fp32 mean either way).
            result["naive_matches_fedtune"] = outputs_match(work / "naive", work / "merged")

        result["targets"] = {
            "wall_limit_s": round(2 * result["floor"]["wall_s"], 2),
            "wall_ok": result["fedtune"]["wall_s"] <= 2 * result["floor"]["wall_s"],
            "memory_limit_mb": round(budget / 1e6, 1),
            "memory_ok": result["fedtune"]["peak_rss_anon_mb"] * 1e6 <= budget,
        }
        if not args.skip_methods:
            fixed = min(shard_bytes, out_bytes) + 300e6
            budgets = {
                # sparsified task vector per site, kthvalue's copy and indices, sign, sums, output slots
                "ties": fixed + (args.sites + 7) * largest_fp32,
                # fedavg's two fp32 buffers, two state slots, the update, two output slots
                "fedadam": fixed + 6 * largest_fp32,
            }
            result.update(method_runs(args, work, sites, inputs, out_bytes, shard_bytes, budgets, python))
        print(json.dumps(result, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def method_runs(args, work, sites, inputs, out_bytes, shard_bytes, budgets, python) -> dict:
    """ties and the second round of fedadam, each against its own floor, from a cold cache."""
    start = work / "start"
    make_checkpoint(start, args.layers, seed=99, shard_bytes=shard_bytes)
    start_files = sorted(start.glob("*.safetensors"))
    base = [python, "-m", "fedtune.aggregate", "--weights", "uniform", "--dtype", "float16"]
    base += ["--max-shard-size", args.shard_size, "--start", str(start), "--model"]
    base += [f"site{k}={site}" for k, site in enumerate(sites)]
    runs: dict = {}

    files = inputs + start_files
    drop_cache(files)
    floor_ties = floor(files, out_bytes, work / "floor.bin")
    drop_cache(files)
    ties = run_measured(
        [*base, "--out", str(work / "ties"), "--method", "ties", "--density", "0.5"], work / "ties.log"
    )
    runs["ties"] = {"floor": floor_ties, **ties}

    adam = ["--server-optimizer", '{"name": "fedadam", "lr": 0.01}']
    run_measured(
        [*base, "--out", str(work / "adam1"), *adam, "--server-state-out", str(work / "state1")],
        work / "adam1.log",
    )
    shutil.rmtree(work / "adam1")
    state_files = sorted((work / "state1").glob("*.safetensors"))
    state_bytes = sum(p.stat().st_size for p in state_files)
    files = inputs + start_files + state_files
    drop_cache(files)
    floor_adam = floor(files, out_bytes + state_bytes, work / "floor.bin")
    drop_cache(files)
    cmd = [*base, "--out", str(work / "adam2"), *adam]
    cmd += ["--server-state-in", str(work / "state1"), "--server-state-out", str(work / "state2")]
    adam2 = run_measured(cmd, work / "adam2.log")
    runs["fedadam"] = {"floor": floor_adam, "state_bytes": state_bytes, **adam2}
    for name, run in runs.items():
        run["in_process_s"] = json.loads(
            (work / ("ties" if name == "ties" else "adam2") / "aggregate.json").read_text()
        )["wall_time_s"]
        run["targets"] = {
            "wall_limit_s": round(2 * run["floor"]["wall_s"], 2),
            "wall_ok": run["wall_s"] <= 2 * run["floor"]["wall_s"],
            "memory_limit_mb": round(budgets[name] / 1e6, 1),
            "memory_ok": run["peak_rss_anon_mb"] * 1e6 <= budgets[name],
        }
    return runs


def outputs_match(a: Path, b: Path) -> bool:
    import torch
    from safetensors import safe_open

    def tensors(folder: Path):
        files = sorted(folder.glob("*.safetensors"))
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    left = dict(tensors(a))
    for name, tensor in tensors(b):
        if name not in left or not torch.allclose(
            left.pop(name).float(), tensor.float(), atol=1e-3, rtol=1e-2
        ):
            return False
    return not left


if __name__ == "__main__":
    sys.exit(main())
