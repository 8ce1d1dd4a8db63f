"""The published model's size (Llama-2-7B's shape, random weights) through train, exchange, merge and
evaluate on one GPU (issue 52): the helpers of benchmarks/gpu-checks/published.sh, which runs fedtune's
own CLIs and calls this file for what they do not do (preparing data, building the model, measuring a
process, comparing models, the report).

    python benchmarks/published_size.py prepare .gpuwhl7b/prep        # CPU side: tokenizer, text, shards
    ARCH=tiny OUT=/tmp/out benchmarks/gpu-checks/published.sh           # the whole script, tiny, on CPU

Subcommands (each prints one JSON object or writes it to --json):
  prepare DIR          a byte-level BPE tokenizer (vocabulary up to 32,000, trained on data/real's text), the
                       text as a raw DatasetDict (train: 1,000 pages; test: 400 documents for evaluate),
                       and `python -m fedtune.tokenize` shards of it (packing) for block sizes 2048 and 256
  build                the starting model from a config (ARCHITECTURES), random weights from a seed,
                       saved with fedtune.core.models.save_model (bf16, 5 GB shards, checksums)
  train-cli ARGS       `python -m fedtune.train ARGS`, with the train stage's checkpoints left out when
                       PUBLISHED_NO_CHECKPOINT=1: the run's last step always saves one, and a 7B model's
                       FSDP optimizer checkpoint (12 bytes per parameter, 81 GB) fits neither the 64 GB
                       disk nor, staged, the host memory beside the rest
  measure -- CMD       CMD's wall time, peak private memory (RssAnon, sampled every 5 ms) and ru_maxrss,
                       stopped after --timeout seconds
  diskbw DIR           write --gib GiB with fsync, drop it from the page cache, read it back: GB/s
  evict PATH...        sync, then drop the files from the page cache (drop_caches, else posix_fadvise)
  compare              streamed, tensor by tensor: the rebuilt model against the site's model and the
                       update (site - start), and the residual's largest value
  report               published.json and published.md from the steps' results, with the plan's
                       prediction beside each figure (fedtune.train.memory_plan, benchmarks/exchange.py,
                       benchmarks/gpu_training.py's FLOPs and peaks)"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(HERE))

# Llama-2-7B's config.json (meta-llama/Llama-2-7b-hf) in the sizes that matter; tiny: the CPU rehearsal.
ARCHITECTURES = {
    "7b": {
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
}
TEXTS = ("libreoffice-help-it", "libreoffice-help-cs")
EVAL_DOCUMENTS = 400
GB = 1e9


def dump(value, path: str | Path | None = None) -> None:
    text = json.dumps(value, indent=2)
    if path:
        Path(path).write_text(text + "\n")
    print(text)


# -- prepare (CPU side) ------------------------------------------------------------------------------


def prepare(out: Path, block_sizes: list[int], vocab_size: int) -> dict:
    from datasets import Dataset, DatasetDict

    from fedtune.core.models import train_tokenizer

    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    docs = {split: [] for split in ("train", "test")}
    for name in TEXTS:
        for split in docs:
            path = ROOT / "data" / "real" / name / f"{split}.jsonl"
            docs[split] += [
                json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()
            ]
    tokenizer = train_tokenizer(docs["train"] + docs["test"], vocab_size=vocab_size)
    tokenizer.save_pretrained(out / "tokenizer")
    # evaluate reads "a few hundred documents": the test pages, then train pages up to EVAL_DOCUMENTS.
    test = (docs["test"] + docs["train"])[:EVAL_DOCUMENTS]
    DatasetDict(
        {"train": Dataset.from_dict({"text": docs["train"]}), "test": Dataset.from_dict({"text": test})}
    ).save_to_disk(str(out / "raw"))
    record = {
        "tokenizer_vocab": len(tokenizer),
        "train_documents": len(docs["train"]),
        "test_documents": len(test),
    }
    # Two sites' manifests of the same text (the merge weighs the sites by their manifests' tokens);
    # training reads site it's.
    for block in block_sizes:
        for name in ("it", "cs"):
            site = out / f"data-{block}" / name
            shard = site / "train" / "shard-00000"
            options = {"shards": 1, "block_size": block, "mode": "packing", "add_bos": True}
            subprocess.run(
                [sys.executable, "-m", "fedtune.tokenize", "shard", "--raw", str(out / "raw"), "--split", "train",
                 "--shard", "0", "--tokenizer", str(out / "tokenizer"), "--site", name,
                 "--options", json.dumps(options), "--out", str(shard)],
                cwd=ROOT, check=True,
            )  # fmt: skip
            subprocess.run(
                [sys.executable, "-m", "fedtune.tokenize", "manifest", "--out", str(site / "manifest.json"), str(shard)],
                cwd=ROOT, check=True,
            )  # fmt: skip
        from fedtune.tokenize.blocks import Blocks, manifest_shards

        record[f"blocks_{block}"] = len(
            Blocks(manifest_shards(out / f"data-{block}" / "it" / "manifest.json"))
        )
    record["seconds"] = round(time.perf_counter() - started, 1)
    return record


# -- build ---------------------------------------------------------------------------------------------


def build(arch: str, tokenizer_dir: Path, out: Path, device: str, dtype: str, seed: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fedtune.core.models import load_tokenizer, save_model
    from fedtune.core.options import torch_dtype

    started = time.perf_counter()
    tokenizer = load_tokenizer(tokenizer_dir)
    config = LlamaConfig(
        **ARCHITECTURES[arch],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype(dtype))  # drawn in the saved dtype: no fp32 copy of 7B
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    built = time.perf_counter() - started
    model = model.to("cpu")
    save_model(model, tokenizer, out)
    files = sorted(out.glob("*.safetensors"))
    return {
        "arch": arch,
        "parameters": sum(p.numel() for p in model.parameters()),
        "weight_bytes": sum(p.stat().st_size for p in files),
        "weight_files": len(files),
        "build_s": round(built, 1),
        "total_s": round(time.perf_counter() - started, 1),
    }


# -- the training setup the plan chooses -------------------------------------------------------------------

# The Leonardo site of config/examples/llama2-it-cs.yaml first (hybrid_zero2, activation checkpointing,
# micro batch 4), then the closest setups with less memory per GPU.
CANDIDATES = (("hybrid_zero2", 4), ("full", 4), ("full", 2), ("full", 1))


def choose(arch: str, gpu_mib: int | None, seq: int) -> list[dict]:
    """CANDIDATES in order with the plan's memory on one GPU and its fits rule for this GPU; the first
    that fits first (memory unknown: Leonardo's)."""
    from fedtune.train import memory_plan

    a = ARCHITECTURES[arch]
    shape = memory_plan.Shape(
        arch, a["hidden_size"], a["num_hidden_layers"], a["num_attention_heads"], a["num_key_value_heads"],
        a["intermediate_size"], a["vocab_size"], tied=a["tie_word_embeddings"],
    )  # fmt: skip
    rows = []
    for mode, micro in CANDIDATES:
        total = memory_plan.per_device(
            shape, memory_plan.Setup(mode, 1, 1, micro_batch=micro, seq=seq, checkpointing=True)
        )["total"]
        fits = memory_plan.fits(total, gpu_mib * 2**20) if gpu_mib else None
        rows.append({"sharding": mode, "micro_batch": micro, "plan_gb": round(total / GB, 2), "fits": fits})
    first = next((i for i, r in enumerate(rows) if r["fits"] is not False), 0)
    return rows[first:] + rows[:first]


# -- the train CLI, with checkpoints optional ------------------------------------------------------------


def train_cli(argv: list[str]) -> None:
    from fedtune.train import loop
    from fedtune.train.distributed import leave

    if os.environ.get("PUBLISHED_NO_CHECKPOINT") == "1":

        def no_checkpoint(run, progress, started):
            if run.job.is_main:
                loop.say(f"checkpoint at step {progress.step} left out (PUBLISHED_NO_CHECKPOINT=1)")

        loop.save_checkpoint = no_checkpoint
    leave(loop.main(argv))


# -- measure a process -----------------------------------------------------------------------------------


def measure(cmd: list[str], log: Path | None, timeout: float | None) -> dict:
    """Wall time, peak RssAnon (private memory; file pages of memory-mapped inputs are not counted) and
    ru_maxrss (resident, file pages included) of `cmd`, killed (its process group) after `timeout` s."""
    peak = [0]
    started = time.perf_counter()
    out = open(log, "w") if log else None
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    done = threading.Event()
    timed_out = [False]

    def sample():
        status = Path(f"/proc/{proc.pid}/status")
        while not done.is_set():
            try:
                for line in status.read_text().splitlines():
                    if line.startswith("RssAnon:"):
                        peak[0] = max(peak[0], int(line.split()[1]) * 1024)
            except (FileNotFoundError, ProcessLookupError, OSError):
                pass
            elapsed = time.perf_counter() - started
            if timeout and elapsed > timeout and not timed_out[0]:
                timed_out[0] = True  # SIGTERM first: fedtune.train stops after its step, exports nothing
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
            if timeout and elapsed > timeout + 20:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            time.sleep(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    thread.join()
    if out:
        out.close()
    return {
        "command": " ".join(cmd),
        "exit": 124 if timed_out[0] else proc.returncode,
        "wall_s": round(time.perf_counter() - started, 2),
        "peak_rss_anon_mb": round(peak[0] / 2**20, 1),
        "ru_maxrss_mb": round(usage.ru_maxrss / 1024, 1),
    }


# -- disk --------------------------------------------------------------------------------------------------


def evict(paths: list[Path]) -> str:
    """Drop the page cache of these files and folders' files (benchmarks/aggregate.py's way)."""
    from aggregate import _evict

    return _evict(
        [p for path in paths for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file()]
    )


def diskbw(folder: Path, gib: float) -> dict:
    """Sequential write (fsync included) and cold read of one file, as the I/O floor's bandwidths."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "diskbw.bin"
    size = int(gib * 2**30)
    block = os.urandom(64 << 20)
    started = time.perf_counter()
    with open(path, "wb") as f:
        left = size
        while left > 0:
            left -= f.write(block[: min(left, len(block))])
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - started
    how = evict([path])
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(64 << 20)
        while f.readinto(buffer):
            pass
    read_s = time.perf_counter() - started
    # The same file again, from the page cache: what a step reading a file just written gets.
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass
    cached_s = time.perf_counter() - started
    path.unlink()
    return {
        "bytes": size,
        "write_gb_s": round(size / write_s / GB, 3),
        "read_gb_s": round(size / read_s / GB, 3),
        "cached_read_gb_s": round(size / cached_s / GB, 3),
        "evicted_by": how,
    }


def folder_bytes(folder: Path, suffix: str = ".safetensors") -> int:
    return sum(p.stat().st_size for p in Path(folder).glob(f"*{suffix}"))


# -- compare -------------------------------------------------------------------------------------------


def compare(
    site: Path, rebuilt: Path, start: Path, residual: Path | None, device: str, json_path=None
) -> dict:
    """Per tensor, streamed: max |rebuilt - site| (what the exchange changed in the model), max |site -
    start| (the update itself), and the L2 norms of both; the residual's max |value| when kept."""
    from safetensors import safe_open

    def index(folder: Path) -> dict[str, Path]:
        where = {}
        for file in sorted(Path(folder).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                where.update({name: file for name in f.keys()})
        return where

    started = time.perf_counter()
    a, b, s = index(site), index(rebuilt), index(start)
    handles: dict[Path, object] = {}

    def get(where, name):
        file = where[name]
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt", device=device)
        return handles[file].get_tensor(name)

    max_diff = max_update = 0.0
    sq_diff = sq_update = 0.0
    worst = None
    for name in sorted(a):
        x = get(a, name).float()
        if not get(a, name).dtype.is_floating_point:
            continue
        y, z = get(b, name).float(), get(s, name).float()
        diff, update = (y - x), (x - z)
        d = float(diff.abs().max())
        if d > max_diff:
            max_diff, worst = d, name
        max_update = max(max_update, float(update.abs().max()))
        sq_diff += float(diff.double().square().sum())
        sq_update += float(update.double().square().sum())
    out = {
        "tensors": len(a),
        "max_abs_rebuilt_minus_site": max_diff,
        "worst_tensor": worst,
        "max_abs_update": max_update,
        "relative_l2_rebuilt_vs_update": math.sqrt(sq_diff / sq_update) if sq_update else None,
        "seconds": round(time.perf_counter() - started, 1),
    }
    if json_path:  # kept if the residual's pass runs out of time
        Path(json_path).write_text(json.dumps(out, indent=2) + "\n")
    handles.clear()
    if residual is not None and Path(residual).is_dir():
        r = index(residual)
        out["max_abs_residual"] = max(float(get(r, name).abs().max()) for name in r) if r else 0.0
        out["residual_bytes"] = folder_bytes(residual)
    out["seconds"] = round(time.perf_counter() - started, 1)
    return out


# -- report --------------------------------------------------------------------------------------------


def _read(path: Path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _loss_rows(model_dir: Path) -> list[dict]:
    path = Path(model_dir) / "loss.csv"
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    header = lines[0].split(",")
    return [dict(zip(header, map(float, line.split(",")), strict=True)) for line in lines[1:] if line]


def _train_figures(results: Path, name: str, setup: dict, arch: dict, seq: int, peak: float | None,
                   gpu_bytes: int | None, skip: int) -> dict | None:  # fmt: skip
    from gpu_training import flops_per_token

    from fedtune.train import memory_plan

    meta = _read(results / f"{name}.json")
    if meta is None:
        return None
    # A failed run's folder is the next run's (the fallback writes the same one): its figures only on exit 0.
    ok = meta.get("exit") == 0
    summary = (_read(Path(meta["out"]) / "training.json") or {}) if ok else {}
    rows = _loss_rows(meta["out"]) if ok else []
    row = {"exit": meta.get("exit"), "wall_s": meta.get("wall_s"), "options": setup}
    if rows:
        tokens_per_step = setup["global_batch"] * seq
        measured = rows[skip:] if len(rows) > skip else rows
        seconds = sum(tokens_per_step / r["tokens_per_s"] for r in measured)
        tokens_per_s = len(measured) * tokens_per_step / seconds
        flops = flops_per_token(arch, seq)
        row.update(
            steps=len(rows),
            tokens_per_s=round(tokens_per_s, 1),
            tokens_per_s_all_steps=summary.get("tokens_per_s"),
            first_loss=rows[0]["loss"],
            final_loss=rows[-1]["loss"],
            peak_allocated_gb=round(max(r["peak_mem_mb"] for r in rows) * 2**20 / GB, 2),
            flops_per_token=flops["total"],
            mfu=round(tokens_per_s * flops["total"] / (peak * 1e12), 4) if peak else None,
            mfu_causal=round(tokens_per_s * flops["total_causal"] / (peak * 1e12), 4) if peak else None,
        )
    smi = results / f"{name}.smi"
    if smi.is_file():
        used = [float(v) for v in smi.read_text().split() if v.replace(".", "").isdigit()]
        if used:
            row["peak_nvidia_smi_gb"] = round(max(used) * 2**20 / GB, 2)
    shape = memory_plan.Shape(
        "Llama-2-7B shape", arch["hidden_size"], arch["num_hidden_layers"], arch["num_attention_heads"],
        arch["num_key_value_heads"], arch["intermediate_size"], arch["vocab_size"],
        tied=arch["tie_word_embeddings"],
    )  # fmt: skip
    mode = setup["sharding"] if setup["backend"] == "fsdp" else f"zero{setup['zero_stage']}"
    plan = memory_plan.Setup(
        mode, 1, 1, precision=setup["precision"], micro_batch=setup["micro_batch"], seq=seq,
        checkpointing=bool(setup["gradient_checkpointing"]),
        device="cuda" if setup["device"] == "cuda" else "cpu",
    )  # fmt: skip
    try:
        parts = memory_plan.per_device(shape, plan)
    except Exception as error:  # noqa: BLE001 - a setup the plan does not know: the figures still count
        row["plan"] = {"memory_gb": None, "with_reserve_gb": None, "error": repr(error)}
        return row
    prediction = {
        "memory_gb": round(parts["total"] / GB, 2),
        "memory_parts_gb": {k: round(v / GB, 2) for k, v in parts.items() if k != "total"},
        "fits_this_gpu": memory_plan.fits(parts["total"], gpu_bytes) if gpu_bytes else None,
        "with_reserve_gb": round(
            (parts["total"] * (1 + memory_plan.CUDA_RESERVE_SHARE) + memory_plan.CUDA_RESERVE_BYTES) / GB, 2
        ),
    }
    if peak:
        # docs/scaling.md's time table: 40% MFU assumed, x 6/8 with full activation checkpointing.
        mfu = 0.40 * (6 / 8 if setup["gradient_checkpointing"] else 1)
        flops = flops_per_token(arch, seq)["total"]
        prediction.update(assumed_mfu=mfu, tokens_per_s=round(peak * 1e12 * mfu / flops, 1))
    row["plan"] = prediction
    if "peak_allocated_gb" in row:
        row["memory_measured_over_plan"] = round(row["peak_allocated_gb"] / prediction["memory_gb"], 3)
    if "tokens_per_s" in row and "tokens_per_s" in prediction:
        row["tokens_per_s_measured_over_plan"] = round(row["tokens_per_s"] / prediction["tokens_per_s"], 3)
    return row


def report(work: Path, out: Path, arch_name: str, seq: int, command: str) -> dict:
    results = work / "results"
    arch = ARCHITECTURES[arch_name]
    gpu = _read(results / "gpu.json") or {}
    peak = None
    if gpu.get("name"):
        from gpu_training import peak_tflops

        peak = peak_tflops(gpu["name"])
    gpu_bytes = int(gpu["memory_mib"]) * 2**20 if gpu.get("memory_mib") else None
    disk = _read(results / "diskbw.json") or {}
    report = {
        "title": "the published size on a GPU (issue 52)",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": command,
        "gpu": gpu,
        "peak_tflops": peak,
        "plan_choice": _read(results / "choice.json"),
        "architecture": {"name": arch_name, **arch},
        "seq": seq,
        "build": _read(results / "build.json"),
        "disk": disk,
        "steps": {},
    }
    steps = report["steps"]
    for name in ("train_fsdp", "train_fsdp_fallback", "train_deepspeed"):
        setup = (_read(results / f"{name}.json") or {}).get("options")
        if setup:
            try:
                steps[name] = _train_figures(results, name, setup, arch, seq, peak, gpu_bytes, skip=3)
            except Exception as error:  # noqa: BLE001 - the report must come out
                steps[name] = {
                    "error": repr(error),
                    "options": setup,
                    "exit": None,
                    "wall_s": None,
                    "plan": {},
                }
    # Exchange: compress and decode, against the bytes benchmarks/exchange.py plans from the config.
    compress, decode = _read(results / "compress.json"), _read(results / "decode.json")
    if compress:
        record = _read(results / "update.json") or {}
        row = {"compress": {k: compress.get(k) for k in ("exit", "wall_s", "peak_rss_anon_mb", "ru_maxrss_mb")},
               "residual": compress.get("residual"),
               "update_bytes": record.get("update_bytes"), "model_bytes": record.get("model_bytes"),
               "ratio": record.get("ratio"), "relative_error": record.get("relative_error")}  # fmt: skip
        try:
            import torch
            from exchange import mode_bytes, shapes_of

            shapes = shapes_of({"model_type": "llama", **arch})
            row["plan"] = {
                "update_bytes": mode_bytes(shapes, torch.bfloat16, {"dtype": "int8"}),
                "model_bytes": 2 * sum(math.prod(s) for s in shapes.values()),
                "memory_mb_rule": 4000,  # workflow/rules/exchange.smk: mem_mb of compress_update
            }
            if row["update_bytes"]:
                row["update_bytes_measured_over_plan"] = round(
                    row["update_bytes"] / row["plan"]["update_bytes"], 4
                )
        except Exception as error:  # noqa: BLE001 - the report must come out
            row["plan"] = {"error": repr(error)}
        if decode:
            row["decode"] = {k: decode.get(k) for k in ("exit", "wall_s", "peak_rss_anon_mb", "ru_maxrss_mb")}
        row["compare"] = _read(results / "compare.json")
        if disk.get("read_gb_s") and record.get("model_bytes"):
            mb, ub = record["model_bytes"], record.get("update_bytes") or 0
            row["io_floor_compress_s"] = round(
                2 * mb / GB / disk["read_gb_s"] + ub / GB / disk["write_gb_s"], 1
            )
            row["io_floor_decode_s"] = round(
                (mb + ub) / GB / disk["read_gb_s"] + mb / GB / disk["write_gb_s"], 1
            )
        steps["exchange"] = row
    merge = _read(results / "aggregate.json")
    if merge:
        row = dict(merge)
        inside = _read(Path(merge.get("out", "")) / "aggregate.json") or {}
        row["in_process_s"] = inside.get("wall_time_s")
        if disk.get("read_gb_s") and merge.get("read_bytes"):
            floor = (
                merge["read_bytes"] / GB / disk["read_gb_s"] + merge["write_bytes"] / GB / disk["write_gb_s"]
            )
            row["plan"] = {"io_floor_s": round(floor, 1), "memory_mb_rule": 4000,  # aggregate.smk mem_mb
                           "floor_from": "bytes read / cold read GB/s + bytes written / write GB/s (diskbw)"}  # fmt: skip
            row["wall_over_floor"] = round(merge["wall_s"] / floor, 3) if floor else None
        steps["aggregate"] = row
    evaluation = _read(results / "evaluate.json")
    if evaluation:
        scores = _read(evaluation.get("out", "")) or {}
        row = {k: evaluation.get(k) for k in ("exit", "wall_s", "peak_rss_anon_mb", "model")}
        if scores:
            row.update(
                {
                    k: scores.get(k)
                    for k in ("perplexity", "tokens", "windows", "documents", "wall_time_s", "device")
                }
            )
            if scores.get("wall_time_s"):
                row["scored_tokens_per_s"] = round(scores["tokens"] / scores["wall_time_s"], 1)
                length = evaluation.get("max_length")
                if length:
                    row["window_tokens_per_s"] = round(scores["windows"] * length / scores["wall_time_s"], 1)
                    if peak:
                        from gpu_training import flops_per_token

                        fwd = flops_per_token(arch, length)["total"] / 3  # the forward's third
                        row["mfu_forward"] = round(row["window_tokens_per_s"] * fwd / (peak * 1e12), 4)
        steps["evaluate"] = row
    report["skipped"] = _read(results / "skipped.json") or []
    report["wall_s"] = (_read(results / "wall.json") or {}).get("wall_s")
    out.mkdir(parents=True, exist_ok=True)
    (out / "published.json").write_text(json.dumps(report, indent=2) + "\n")
    try:
        table = markdown(report)
    except Exception as error:  # noqa: BLE001 - the JSON is written already
        table = f"(no table: {error!r})"
    (out / "published.md").write_text(table + "\n")
    print(table)
    return report


def _fmt(value, digits=1, scale=1.0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float | int):
        return f"{value / scale:,.{digits}f}"
    return str(value)


def markdown(r: dict) -> str:
    s = r["steps"]
    gpu = r["gpu"].get("name", "no GPU")
    lines = [
        f"{gpu}, {r['date']}: {r['architecture']['name']} ({(r.get('build') or {}).get('parameters', 0) / 1e9:.2f}B "
        f"parameters), seq {r['seq']}; disk write {_fmt(r['disk'].get('write_gb_s'), 2)} GB/s, "
        f"cold read {_fmt(r['disk'].get('read_gb_s'), 2)} GB/s; whole call {_fmt(r.get('wall_s'), 0)} s",
        "",
        "| step | measured | plan / floor | measured / plan |",
        "|---|---|---|---|",
    ]
    for name in ("train_fsdp", "train_fsdp_fallback", "train_deepspeed"):
        t = s.get(name)
        if not t:
            continue
        if "error" in t:
            lines.append(f"| {name} | report error: {t['error'][:200]} | | |")
            continue
        o = t["options"]
        label = f"{name} ({o['backend']} {o['sharding'] if o['backend'] == 'fsdp' else 'zero' + str(o['zero_stage'])}, micro {o['micro_batch']}, AC {o['gradient_checkpointing']})"
        if "tokens_per_s" not in t:
            lines.append(
                f"| {label} | exit {t['exit']} after {_fmt(t['wall_s'], 0)} s | {t['plan'].get('memory_gb')} GB | - |"
            )
            continue
        lines.append(
            f"| {label} | {t['tokens_per_s']:,.0f} tok/s, MFU {_fmt(t['mfu'] and 100 * t['mfu'])}%, live peak "
            f"{t['peak_allocated_gb']} GB (nvidia-smi {t.get('peak_nvidia_smi_gb', '-')} GB), loss {t['first_loss']:.3f} -> "
            f"{t['final_loss']:.3f}, {t['steps']} steps, wall {_fmt(t['wall_s'], 0)} s | {t['plan']['memory_gb']} GB "
            f"(fits rule {t['plan']['with_reserve_gb']} GB), {_fmt(t['plan'].get('tokens_per_s'), 0)} tok/s at MFU "
            f"{_fmt(t['plan'].get('assumed_mfu') and 100 * t['plan']['assumed_mfu'])}% | memory "
            f"{t.get('memory_measured_over_plan', '-')}, tok/s {t.get('tokens_per_s_measured_over_plan', '-')} |"
        )
    e = s.get("exchange")
    if e:
        c, d, cmp_ = e.get("compress") or {}, e.get("decode") or {}, e.get("compare") or {}
        lines.append(
            f"| exchange int8 + error feedback | compress {_fmt(c.get('wall_s'))} s ({_fmt(c.get('peak_rss_anon_mb'), 0)} MB "
            f"private), decode {_fmt(d.get('wall_s'))} s ({_fmt(d.get('peak_rss_anon_mb'), 0)} MB); "
            f"{_fmt(e.get('update_bytes'), 2, GB)} GB of {_fmt(e.get('model_bytes'), 2, GB)} GB ({e.get('ratio')}); "
            f"max abs rebuilt - site {_fmt(cmp_.get('max_abs_rebuilt_minus_site'), 6)} (update's max "
            f"{_fmt(cmp_.get('max_abs_update'), 6)}), residual max {_fmt(cmp_.get('max_abs_residual'), 6)}, relative "
            f"error {_fmt(e.get('relative_error'), 5)} | {_fmt((e.get('plan') or {}).get('update_bytes'), 2, GB)} GB; floors "
            f"{e.get('io_floor_compress_s', '-')} s / {e.get('io_floor_decode_s', '-')} s; 4,000 MB rule | bytes "
            f"{e.get('update_bytes_measured_over_plan', '-')} |"
        )
    a = s.get("aggregate")
    if a:
        lines.append(
            f"| aggregate (fedavg default, streamed, 2 sites) | {_fmt(a.get('wall_s'))} s, {_fmt(a.get('peak_rss_anon_mb'), 0)} MB "
            f"private, ru_maxrss {_fmt(a.get('ru_maxrss_mb'), 0)} MB, read {_fmt(a.get('read_bytes'), 1, GB)} GB, "
            f"wrote {_fmt(a.get('write_bytes'), 1, GB)} GB, exit {a.get('exit')} | I/O floor "
            f"{(a.get('plan') or {}).get('io_floor_s', '-')} s; 4,000 MB rule | {a.get('wall_over_floor', '-')} x floor |"
        )
    v = s.get("evaluate")
    if v:
        lines.append(
            f"| evaluate (GPU) | {_fmt(v.get('scored_tokens_per_s'), 0)} scored tok/s ({_fmt(v.get('window_tokens_per_s'), 0)} "
            f"window tok/s, forward MFU {_fmt(v.get('mfu_forward') and 100 * v['mfu_forward'])}%), {v.get('documents')} documents, "
            f"{v.get('windows')} windows, scoring {_fmt(v.get('wall_time_s'))} s, process {_fmt(v.get('wall_s'))} s, "
            f"exit {v.get('exit')} | - | - |"
        )
    for item in r.get("skipped") or []:
        lines.append(f"| {item.get('step')} | skipped: {item.get('why')} | | |")
    return "\n".join(lines)


# -- CLI -----------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "train-cli":
        train_cli(argv[1:])
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("out", type=Path)
    p.add_argument("--block-sizes", default="2048,256")
    p.add_argument("--vocab-size", type=int, default=32000)
    p = sub.add_parser("build")
    p.add_argument("--arch", choices=sorted(ARCHITECTURES), default="7b")
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    p = sub.add_parser("measure")
    p.add_argument("--json", required=True)
    p.add_argument("--log", type=Path)
    p.add_argument("--timeout", type=float)
    p.add_argument("--extra", default="{}", help="JSON merged into the record")
    p.add_argument("--read", action="append", default=[], help="a model folder the command reads (bytes)")
    p.add_argument("--write", action="append", default=[], help="a model folder the command writes (bytes)")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    p = sub.add_parser("diskbw")
    p.add_argument("folder", type=Path)
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--json")
    p = sub.add_parser("evict")
    p.add_argument("paths", nargs="+", type=Path)
    p = sub.add_parser("compare")
    p.add_argument("--site", type=Path, required=True)
    p.add_argument("--rebuilt", type=Path, required=True)
    p.add_argument("--start", type=Path, required=True)
    p.add_argument("--residual", type=Path)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json")
    p = sub.add_parser("choose")
    p.add_argument("--arch", default="7b")
    p.add_argument("--gpu-json", type=Path)
    p.add_argument("--seq", type=int, default=2048)
    p = sub.add_parser("report")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--arch", default="7b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--command-line", default="")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        dump(prepare(args.out, [int(b) for b in args.block_sizes.split(",")], args.vocab_size))
    elif args.command == "build":
        dump(build(args.arch, args.tokenizer, args.out, args.device, args.dtype, args.seed), args.json)
    elif args.command == "measure":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        record = {**measure(cmd, args.log, args.timeout), **json.loads(args.extra)}
        if args.read or args.write:
            record["read_bytes"] = sum(folder_bytes(Path(d)) for d in args.read)
            record["write_bytes"] = sum(folder_bytes(Path(d)) for d in args.write if Path(d).is_dir())
        dump(record, args.json)
        return 0 if record["exit"] == 0 else 1
    elif args.command == "diskbw":
        dump(diskbw(args.folder, args.gib), args.json)
    elif args.command == "evict":
        print(evict(args.paths))
    elif args.command == "compare":
        dump(compare(args.site, args.rebuilt, args.start, args.residual, args.device, args.json), args.json)
    elif args.command == "choose":
        gpu = _read(args.gpu_json) if args.gpu_json else None
        rows = choose(args.arch, (gpu or {}).get("memory_mib"), args.seq)
        print(json.dumps(rows), file=sys.stderr)
        for row in rows:  # the shell reads "sharding micro" lines, the plan's choice first
            print(row["sharding"], row["micro_batch"])
    elif args.command == "report":
        report(args.work, args.out, args.arch, args.seq, args.command_line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
