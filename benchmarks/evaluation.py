"""Benchmark: fedtune's perplexity beside the Hugging Face perplexity-guide loop.

    python benchmarks/evaluation.py [--documents 400] [--max-length 256] [--stride 128] [--batch-size 8]

Both score the same token stream (the demo test text, templated and joined as fedtune does) with the
same model (a small Llama built from config: no download) at the same max_length and stride. The guide
loop is the one from the transformers docs ("Perplexity of fixed-length models"): one window per
forward, the model's own loss times the scored tokens. Prints JSON with both perplexities, their
relative difference (target: under 1e-4) and tokens/s (target: fedtune at least the same)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path


def guide_loop(model, ids, max_length: int, stride: int):
    import torch

    encodings = torch.tensor([ids])
    seq_len = encodings.size(1)
    nll_sum, n_tokens, prev_end_loc = 0.0, 0, 0
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + max_length, seq_len)
        trg_len = end_loc - prev_end_loc
        input_ids = encodings[:, begin_loc:end_loc]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            outputs = model(input_ids, labels=target_ids)
        num_valid_tokens = (target_ids != -100).sum().item()
        num_loss_tokens = num_valid_tokens - target_ids.size(0)
        nll_sum += outputs.loss.item() * num_loss_tokens
        n_tokens += num_loss_tokens
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    return math.exp(nll_sum / n_tokens), n_tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--documents", type=int, default=400)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--stride", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    import random

    import torch

    from fedtune.core.models import build_model, train_tokenizer
    from fedtune.download.demo_data import bulletin, recipe
    from fedtune.evaluate.scores import build_stream, score

    torch.set_num_threads(args.threads)
    rng = random.Random(1)
    texts = [(recipe if i % 2 else bulletin)(rng) for i in range(args.documents)]
    tokenizer = train_tokenizer(texts, vocab_size=2048)
    architecture = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
                    "num_attention_heads": 8, "max_position_embeddings": 1024}  # fmt: skip
    model = build_model(architecture, tokenizer, seed=0).eval()
    ids = build_stream(texts, tokenizer).ids

    start = time.perf_counter()
    nll, scored, windows = score(model, ids, args.max_length, args.stride, args.batch_size)
    fedtune_s = time.perf_counter() - start
    fedtune_ppl = math.exp(nll / scored)

    start = time.perf_counter()
    guide_ppl, guide_tokens = guide_loop(model, ids, args.max_length, args.stride)
    guide_s = time.perf_counter() - start

    print(json.dumps({
        "tokens": len(ids), "windows": windows, "max_length": args.max_length, "stride": args.stride,
        "fedtune": {"perplexity": fedtune_ppl, "tokens_scored": scored, "seconds": round(fedtune_s, 2),
                    "tokens_per_s": round(scored / fedtune_s)},
        "hf_guide": {"perplexity": guide_ppl, "tokens_scored": guide_tokens, "seconds": round(guide_s, 2),
                     "tokens_per_s": round(guide_tokens / guide_s)},
        "relative_difference": abs(fedtune_ppl - guide_ppl) / guide_ppl,
        "speedup": round((scored / fedtune_s) / (guide_tokens / guide_s), 2),
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
