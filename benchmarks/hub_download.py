"""Benchmark: peak memory of the download stage for a hub model (model.source: hf), which runs on login
nodes, against loading the same model (what the stage did before: from_pretrained, then save_pretrained).

    .venv/bin/python benchmarks/hub_download.py        # a 134M-parameter fp32 Llama, 537 MB of weights

The model is built here (LlamaForCausalLM, hidden 768, 12 layers, vocabulary 32,000, untied embeddings)
with a byte-level BPE tokenizer, and laid out as a Hugging Face hub cache (models--bench--llama-134m,
refs/main -> one commit), which `python -m fedtune.download model` reads with HF_HUB_OFFLINE=1, exactly
as it would after fetching the files. Each measured command runs under a small Python parent that reports
its child's peak resident set size (getrusage RUSAGE_CHILDREN ru_maxrss). Goal (issue 26): under 1 GB,
whatever the model's size; the download's cost does not grow with the weights (they are linked or copied
file by file, and only their headers are read)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPO, SMALL, REVISION = "bench/llama-134m", "bench/llama-small", "a" * 40


def build(folder: Path, layers: int = 12, vocab: int = 32000) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from fedtune.core.models import save_model, train_tokenizer

    texts = [
        line for path in sorted((ROOT / "data").rglob("*.jsonl")) for line in path.read_text().splitlines()
    ]
    tokenizer = train_tokenizer(texts, vocab_size=2048)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers,
        num_attention_heads=12, num_key_value_heads=12, tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    save_model(LlamaForCausalLM(config), tokenizer, folder)


def hub_cache(root: Path, model_dir: Path, repo: str = REPO, revision: str = REVISION) -> Path:
    """A Hugging Face hub cache holding model_dir's files as `repo` at commit `revision` (with refs/main
    pointing there): the layout huggingface_hub reads offline (tests/test_download.py uses it too)."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for path in model_dir.iterdir():
        shutil.copy(path, snapshot / path.name)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(revision)
    return root


def measured(command: list[str], env: dict, *, quiet: bool = False) -> dict:
    """Run command under a parent that reports the child's peak RSS (MB) and wall time (benchmarks/
    download_memory.py uses it too); `quiet` drops the child's stdout."""
    probe = (
        "import resource, subprocess, sys, time, json\n"
        f"t = time.monotonic(); rc = subprocess.call(sys.argv[1:]{', stdout=subprocess.DEVNULL' if quiet else ''})\n"
        "print(json.dumps({'rc': rc, 'seconds': round(time.monotonic() - t, 1),"
        " 'peak_mb': round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, *command], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--keep", help="a folder to build the model in once and keep")
    args = parser.parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix="hub-download-"))
    models = {REPO: (work / "model", 12, 32000), SMALL: (work / "small", 1, 2048)}
    cache = work / "hub"
    for name, (folder, layers, vocab) in models.items():
        if not (folder / "model.safetensors").is_file():
            build(folder, layers, vocab)
        if not (cache / f"models--{name.replace('/', '--')}").is_dir():
            hub_cache(cache, folder, name)
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    report = {}
    for name, (folder, _, _) in models.items():
        out = work / "base"
        shutil.rmtree(out, ignore_errors=True)
        spec = {"source": "hf", "name": name, "revision": REVISION, "dtype": "bfloat16"}
        command = [
            sys.executable,
            "-m",
            "fedtune.download",
            "model",
            "--options",
            json.dumps(spec),
            "--out",
            str(out),
        ]
        report[name] = {
            "weights_mb": round(sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 1e6),
            "download": measured(command, env),
        }
    # What the stage did before: load the model in model.dtype and save it again.
    before = (
        "from fedtune.core.models import load_causal_lm, load_tokenizer, save_model; "
        f"save_model(load_causal_lm({str(models[REPO][0])!r}, dtype='bfloat16'), "
        f"load_tokenizer({str(models[REPO][0])!r}), {str(work / 'before')!r})"
    )
    shutil.rmtree(work / "before", ignore_errors=True)
    report[REPO]["load_and_save_before"] = measured([sys.executable, "-c", before], env)
    report["date"] = time.strftime("%Y-%m-%d")
    print(json.dumps(report, indent=2))
    download = report[REPO]["download"]
    if not args.keep:
        shutil.rmtree(work)
    return 0 if download["rc"] == 0 and download["peak_mb"] < 1000 else 1


if __name__ == "__main__":
    sys.exit(main())
