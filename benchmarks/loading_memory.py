"""Benchmark: host memory of a train job's processes, summed, from their start to the first forward pass,
with the starting weights loaded by every rank (before) and once (fedtune.train.loading, after), on CPU.

    .venv/bin/python benchmarks/loading_memory.py            # 2 and 4 processes, a 102M-parameter Llama

Each run is `scripts/launch --procs-per-node N -- python -m fedtune.train ...` as the train rule starts it
(FSDP2 full sharding, fp32). Every 10 ms the script reads /proc/<pid>/smaps_rollup of every train process
and sums their PSS (proportional set size: a page shared by k processes counts 1/k to each, so the sum is
what the node holds; shared libraries are counted once) and their Pss_Anon (private and shared anonymous
memory: tensors). The loading phase ends when rank 0 prints the "training ..." line, right before the
first forward pass; the run is then stopped. The old path (mode per-rank) comes back through benchmarks/old_paths.

The interpreter, torch and the other libraries take the same memory whatever the model: the script runs a
2-layer, hidden-64 model the same way and subtracts its peak, leaving what the model costs. Goal (issue
15): at most 1.3 x one fp32 copy of the model per node, whatever the number of processes."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from fedtune.tools.sample_data import corpus, site_data

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "scripts" / "launch"
BLOCK_SIZE = 32  # tokens a block, as the train tests' sites
# Rank 0's first line once the model is loaded and sharded. Searched anywhere in a line: the other rank's
# progress bar (stderr, no newline until it ends) can share the line with it.
LOADED_LINE = re.compile(r"training \S+, round \d+ of \d+ from step")
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def architecture(hidden: int, layers: int) -> dict:
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": hidden * 8 // 3 // 16 * 16 + 16,
        "num_hidden_layers": layers,
        "num_attention_heads": max(1, hidden // 64),
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    }


def prepare(
    root: Path, hidden: int, layers: int, *, dtype: str = "bfloat16", tokenizer_dir: Path | None = None
) -> tuple[Path, Path, int]:
    """A model folder of the given size, its weights saved in `dtype`, and a small tokenized site for it;
    returns (model, manifest, P). bfloat16, as the examples download Llama-2: training in fp32 then
    needs a converted, private copy per rank (an fp32 file could be memory-mapped and shared)."""
    sys.path.insert(0, str(ROOT))
    from fedtune.core.models import build_model, load_tokenizer, save_model, train_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir else train_tokenizer(corpus(), vocab_size=512)
    model = build_model(architecture(hidden, layers), tokenizer, seed=0, dtype=dtype)
    params = sum(p.numel() for p in model.parameters())
    save_model(model, tokenizer, root / "model")
    del model
    return root / "model", site_data(root, root / "model", blocks=16, block_size=BLOCK_SIZE), params


def _smaps(pid: int) -> tuple[int, int] | None:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = {
        line.split(":")[0]: int(line.split()[1]) for line in text.splitlines()[1:] if line.endswith("kB")
    }
    return fields.get("Pss", 0), fields.get("Pss_Anon", 0)


def _high_water_mark(pid: int) -> int:
    """The process's peak resident set (kB, VmHWM), 0 once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def _train_processes(launcher_pid: int) -> list[int]:
    import psutil

    try:
        children = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for child in children:
        try:
            cmdline = child.cmdline()
        except psutil.NoSuchProcess:
            continue
        # The workers run `python -m fedtune.train`; torchrun's own command line names its module.
        launcher = any("torchrun" in c or "distributed.run" in c for c in cmdline)
        if "fedtune.train" in cmdline and "python" in Path(cmdline[0]).name and not launcher:
            found.append(child.pid)
    return found


# "once" is fedtune.train.loading's path for each: meta device + rank 0's reads (FSDP2), zero.Init (ZeRO-3).
BACKENDS = {
    "fsdp": {"backend": "fsdp", "sharding": "full"},
    "zero3": {"backend": "deepspeed", "zero_stage": 3},
}


def measure(
    model_dir: Path,
    manifest: Path,
    procs: int,
    mode: str,
    run_dir: Path,
    env: dict | None = None,
    backend: dict | None = None,
    tries: int = 3,
) -> dict:
    """_measure's reading of one path. It stops at rank 0's first line after loading; on a loaded
    machine another rank can start late and be caught before its own load (a suite beside two
    benchmarks: 1.33 copies per rank), which is no reading of the per-rank path. There every rank loads
    the whole model, so their own peaks are alike once all have loaded: that path is measured again, up
    to `tries` times, while its ranks' own peaks are more than 20% apart (`tries` in the result: how many
    it took)."""
    for attempt in range(tries):
        folder = run_dir if attempt == 0 else run_dir.with_name(f"{run_dir.name}-try{attempt + 1}")
        run = _measure(model_dir, manifest, procs, mode, folder, env=env, backend=backend)
        run["tries"] = attempt + 1
        peaks = run["own_peak_each_mb"]
        if mode != "per-rank" or peaks[0] >= 0.8 * peaks[-1]:
            break
    return run


def _measure(
    model_dir: Path,
    manifest: Path,
    procs: int,
    mode: str,
    run_dir: Path,
    env: dict | None = None,
    backend: dict | None = None,
) -> dict:
    """Summed PSS and Pss_Anon peaks (MB) of the train processes until the model is loaded and sharded;
    `backend`: train options over FSDP2 full sharding (DeepSpeed ZeRO-3: {"backend": "deepspeed",
    "zero_stage": 3})."""
    options = {
        **(backend or {"backend": "fsdp", "sharding": "full"}),
        "device": "cpu",
        "precision": "fp32",
        "micro_batch": 1,
        "global_batch": procs,
        "max_steps": 1,
        "checkpoint_every": 0,
        "processes_per_node": procs,
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [
        "bash", str(LAUNCH), "--procs-per-node", str(procs), "--",
        sys.executable, "-m", "fedtune.train", "--site", "site", "--init", str(model_dir),
        "--manifest", str(manifest), "--options", json.dumps(options),
        "--checkpoints", str(run_dir / "checkpoints"), "--out", str(run_dir / "model"),
    ]  # fmt: skip
    run_env = {
        **(env or os.environ),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks" / "old_paths"), str(ROOT)]),
        "OMP_NUM_THREADS": "1",
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "FEDTUNE_OLD_PATHS": "per-rank-loading" if mode == "per-rank" else "",
    }
    started = time.perf_counter()
    proc = subprocess.Popen(
        command, cwd=ROOT, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    loaded = threading.Event()
    lines: list[str] = []

    def read_output():
        for line in proc.stdout:
            lines.append(line)
            if LOADED_LINE.search(line):
                loaded.set()

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    peak_pss = peak_anon = 0
    seen: set[int] = set()
    # Each process's own peak as well, as the kernel keeps it (VmHWM): their sum depends neither on whether
    # the processes' peaks met in time nor on the polling catching them, both of which the machine's load
    # decides (a rank that starts late may load after the other freed its copy).
    own_peak: dict[int, int] = {}
    try:
        while not loaded.is_set():
            if proc.poll() is not None:
                reader.join(5)
                raise RuntimeError(f"train exited {proc.returncode} before loading:\n{''.join(lines[-40:])}")
            pids = _train_processes(proc.pid)
            seen.update(pids)
            for pid in pids:
                own_peak[pid] = max(own_peak.get(pid, 0), _high_water_mark(pid))
            readings = [r for r in map(_smaps, pids) if r is not None]
            peak_pss = max(peak_pss, sum(r[0] for r in readings))
            peak_anon = max(peak_anon, sum(r[1] for r in readings))
            if time.perf_counter() - started > 600:
                raise RuntimeError("no model loaded within 600 s")
            time.sleep(0.01)
        for pid in seen:  # the last look: a peak reached since the loop's
            own_peak[pid] = max(own_peak.get(pid, 0), _high_water_mark(pid))
    finally:
        _stop(proc)
    return {
        "processes": procs,
        "mode": mode,
        "processes_seen": len(seen),
        "peak_pss_mb": round(peak_pss / 1024, 1),
        "peak_pss_anon_mb": round(peak_anon / 1024, 1),
        "own_peaks_rss_mb": round(sum(own_peak.values()) / 1024, 1),
        "own_peak_each_mb": sorted(round(v / 1024, 1) for v in own_peak.values()),
        "seconds_to_loaded": round(time.perf_counter() - started, 1),
    }


def _stop(proc) -> None:
    import psutil

    try:
        tree = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
    except psutil.NoSuchProcess:
        return
    for p in tree:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait(30)


def model_share(run: dict, baseline: dict, params: int) -> dict:
    """What the model adds to the baseline model's peak, in MB and in fp32 copies of the model."""
    copy_mb = 4 * params / 2**20
    pss = run["peak_pss_mb"] - baseline["peak_pss_mb"]
    anon = run["peak_pss_anon_mb"] - baseline["peak_pss_anon_mb"]
    own = run["own_peaks_rss_mb"] - baseline["own_peaks_rss_mb"]
    return {
        "copies_own_peaks": round(own / copy_mb, 3),
        "model_pss_mb": round(pss, 1),
        "model_anon_mb": round(anon, 1),
        "fp32_copy_mb": round(copy_mb, 1),
        "copies_pss": round(pss / copy_mb, 3),
        "copies_anon": round(anon / copy_mb, 3),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--procs", default="2,4", help="comma-separated process counts")
    parser.add_argument("--checkpoint-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--backend", default="fsdp", choices=sorted(BACKENDS), help="what loads the weights")
    parser.add_argument(
        "--fixed-mmap-threshold",
        action="store_true",
        help="run the train processes with MALLOC_MMAP_THRESHOLD_=131072 (glibc then returns every freed "
        "buffer above 128 KiB, so that the peak counts live memory rather than the heap's history)",
    )
    args = parser.parse_args(argv)
    procs = [int(p) for p in args.procs.split(",")]
    with tempfile.TemporaryDirectory(prefix="fedtune-loading-") as tmp:
        tmp = Path(tmp)
        os.environ.setdefault("TMPDIR", str(tmp))
        dtype = args.checkpoint_dtype
        model_dir, manifest, params = prepare(tmp / "big", args.hidden, args.layers, dtype=dtype)
        small_dir, small_manifest, _ = prepare(tmp / "small", 64, 2, dtype=dtype, tokenizer_dir=model_dir)
        results = []
        env = {**os.environ, **(MALLOC_ENV if args.fixed_mmap_threshold else {})}
        for n in procs:
            baseline = measure(
                small_dir,
                small_manifest,
                n,
                "once",
                tmp / f"base-{n}",
                env=env,
                backend=BACKENDS[args.backend],
            )
            for mode in ("per-rank", "once"):
                backend = BACKENDS[args.backend]
                run = measure(model_dir, manifest, n, mode, tmp / f"{mode}-{n}", env=env, backend=backend)
                run.update(model_share(run, baseline, params), baseline_pss_mb=baseline["peak_pss_mb"])
                results.append(run)
                print(f"[loading] {json.dumps(run)}", file=sys.stderr, flush=True)
    report = {
        "parameters": params,
        "fp32_copy_mb": round(4 * params / 2**20, 1),
        "architecture": architecture(args.hidden, args.layers),
        "checkpoint_dtype": args.checkpoint_dtype,
        "backend": BACKENDS[args.backend],
        "fixed_mmap_threshold": args.fixed_mmap_threshold,
        "runs": results,
        "goal_at_most_1_3_copies": all(r["copies_pss"] <= 1.3 for r in results if r["mode"] == "once"),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
