"""Benchmark: fedtune's tokenize stage beside the run_clm.py way and the raw fast tokenizer.

    python benchmarks/tokenization.py [--megabytes 50] [--threads 2] [--block-size 128]

On one generated corpus (the demo generator, scaled up), in one process, back to back:
  fedtune    tokenize_shard: read Arrow, template, encode, pack, write the Arrow shard and counts
  run_clm    datasets.map(tokenizer(...), batched, num_proc) then map(group_texts), fresh cache
  raw        the fast tokenizer's encode_batch (and encode_batch_fast, which fedtune uses) on the same
             templated texts: the ceiling, with no I/O
Prints one JSON object with tokens/s of each and the ratios the targets are stated in."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--megabytes", type=float, default=50)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=2048)
    args = parser.parse_args()
    # Before any tokenizer is used: the Rust pool is sized once. All three get the same threads.
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

    import random

    from datasets import Dataset, DatasetDict, disable_caching

    from fedtune.core.models import train_tokenizer
    from fedtune.download.demo_data import bulletin, recipe
    from fedtune.tokenize.options import TokenizeOptions
    from fedtune.tokenize.shards import ShardJob, tokenize_shard

    work = Path(tempfile.mkdtemp(prefix="fedtune-bench-tokenize-"))
    rng = random.Random(0)
    texts, size = [], 0
    while size < args.megabytes * 1e6:
        text = (recipe if len(texts) % 2 else bulletin)(rng)
        texts.append(text)
        size += len(text.encode())
    raw = work / "raw"
    DatasetDict({"train": Dataset.from_dict({"text": texts})}).save_to_disk(str(raw))
    tokenizer = train_tokenizer(texts[:20000], vocab_size=args.vocab_size)
    # tokenize_shard reads the tokenizer from a folder; without a config.json no position limit applies.
    model_dir = work / "tokenizer"
    tokenizer.save_pretrained(model_dir)
    template = "{text}"
    results = {"megabytes": round(size / 1e6, 1), "documents": len(texts), "threads": args.threads}

    start = time.perf_counter()
    options = TokenizeOptions.from_mapping({"shards": 1, "template": template, "block_size": args.block_size})
    counts = tokenize_shard(ShardJob(raw, "train", 0, model_dir, work / "shard"), options)
    seconds = time.perf_counter() - start
    results["fedtune"] = {"seconds": round(seconds, 2), "tokens": counts["tokens"],
                          "tokens_per_s": round(counts["tokens"] / seconds)}  # fmt: skip

    backend = tokenizer.backend_tokenizer
    # encode_batch is the API the issue names; encode_batch_fast skips offsets, as fedtune does.
    for name, encode in (
        ("raw_encode_batch", backend.encode_batch),
        ("raw_encode_batch_fast", backend.encode_batch_fast),
    ):
        start = time.perf_counter()
        tokens = 0
        for i in range(0, len(texts), 10000):
            tokens += sum(len(e.ids) for e in encode([template.format(text=t) for t in texts[i : i + 10000]]))
        seconds = time.perf_counter() - start
        results[name] = {
            "seconds": round(seconds, 2),
            "tokens": tokens,
            "tokens_per_s": round(tokens / seconds),
        }

    # After the raw runs: datasets' map sets TOKENIZERS_PARALLELISM=false in this process when it
    # forks, which would leave every later encode on one thread.
    disable_caching()
    dataset = Dataset.from_dict({"text": texts})
    block = args.block_size

    def tokenize_function(examples):
        return tokenizer(examples["text"])

    def group_texts(examples):
        concatenated = {k: sum(examples[k], []) for k in examples}
        total = (len(concatenated["input_ids"]) // block) * block
        result = {k: [t[i : i + block] for i in range(0, total, block)] for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    start = time.perf_counter()
    tokenized = dataset.map(tokenize_function, batched=True, num_proc=args.threads, remove_columns=["text"])
    tokens = sum(len(ids) for ids in tokenized["input_ids"])
    grouped = tokenized.map(group_texts, batched=True, num_proc=args.threads)
    seconds = time.perf_counter() - start
    results["run_clm"] = {"seconds": round(seconds, 2), "tokens": tokens, "blocks": len(grouped),
                          "tokens_per_s": round(tokens / seconds)}  # fmt: skip

    results["fedtune_vs_run_clm"] = round(
        results["fedtune"]["tokens_per_s"] / results["run_clm"]["tokens_per_s"], 2
    )
    for name in ("raw_encode_batch", "raw_encode_batch_fast"):
        ratio = results["fedtune"]["tokens_per_s"] / results[name]["tokens_per_s"]
        results[f"fedtune_vs_{name.removeprefix('raw_')}"] = round(ratio, 2)
    print(json.dumps(results, indent=2))
    import shutil

    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
