"""Benchmark: fedtune's perplexity beside the Hugging Face perplexity-guide loop.

    python benchmarks/evaluation.py [--documents 400] [--max-length 256] [--stride 128] [--batch-size 8]

Both score the same token stream (the demo test text, templated and joined as fedtune does) with the
same model (a small Llama built from config: no download) at the same max_length and stride. The guide
loop is the one from the transformers docs ("Perplexity of fixed-length models"): one window per
forward, the model's own loss times the scored tokens. Prints JSON with both perplexities, their
relative difference (target: under 1e-4) and tokens/s (target: fedtune at least the same).

On a GPU (issue 41), the same comparison on a model of a realistic size and on real text:

    python benchmarks/evaluation.py --device cuda --dtype bfloat16 --arch smollm2-1.7b \
        --texts data/real/libreoffice-help-it/test.jsonl --max-length 2048 --stride 1024 --batch-size 16
    python benchmarks/evaluation.py --device cuda --dtype bfloat16 --model results/x/model/base --texts ...

--arch builds SmolLM2-1.7B's shape (random weights; the tokenizer is trained on the texts, so its
vocabulary is smaller than the real 49,152); --model loads a model folder as the evaluate stage does.
Both loops run on the same model object in the same dtype; CUDA is synchronised before each clock read."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ARCHITECTURES = {
    "tiny": {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
             "num_attention_heads": 8, "max_position_embeddings": 1024},
    # SmolLM2-1.7B's config.json (Hugging Face, HuggingFaceTB/SmolLM2-1.7B), the vocabulary left to the
    # tokenizer trained here.
    "smollm2-1.7b": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
                     "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 32,
                     "max_position_embeddings": 8192, "tie_word_embeddings": True, "rope_theta": 130000},
}  # fmt: skip


def guide_loop(model, ids, max_length: int, stride: int, device=None):
    import torch

    encodings = torch.tensor([ids], device=device)
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
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="tiny")
    parser.add_argument("--model", type=Path, help="a model folder (download's output) instead of --arch")
    parser.add_argument("--texts", type=Path, nargs="*", help="json lines files with a 'text' field")
    parser.add_argument("--vocab-size", type=int, default=2048, help="of the tokenizer trained for --arch")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    import random

    import torch

    from fedtune.core.models import build_model, train_tokenizer
    from fedtune.download.demo_data import bulletin, recipe
    from fedtune.evaluate.scores import build_stream, score

    torch.set_num_threads(args.threads)
    if args.texts:
        texts = [json.loads(line)["text"] for path in args.texts for line in path.read_text().splitlines()]
        texts = texts[: args.documents]
    else:
        rng = random.Random(1)
        texts = [(recipe if i % 2 else bulletin)(rng) for i in range(args.documents)]
    device = torch.device(args.device)
    if args.model:
        from fedtune.evaluate.options import EvaluateOptions
        from fedtune.evaluate.scores import load

        model, tokenizer = load(args.model, EvaluateOptions.from_mapping({"dtype": args.dtype}), args.device)
    else:
        tokenizer = train_tokenizer(texts, vocab_size=args.vocab_size)
        with device:
            model = build_model(ARCHITECTURES[args.arch], tokenizer, seed=0)
        model = model.to(getattr(torch, args.dtype)).eval()
    ids = build_stream(texts, tokenizer).ids

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    if device.type == "cuda":  # the first kernels' start-up out of both timings
        score(model, ids[: 4 * args.max_length], args.max_length, args.stride, args.batch_size)
        guide_loop(model, ids[: 4 * args.max_length], args.max_length, args.stride, device)
    start = clock()
    nll, scored, windows = score(model, ids, args.max_length, args.stride, args.batch_size)
    fedtune_s = clock() - start
    fedtune_ppl = math.exp(nll / scored)

    start = clock()
    guide_ppl, guide_tokens = guide_loop(model, ids, args.max_length, args.stride, device)
    guide_s = clock() - start

    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype, "model": str(args.model) if args.model else args.arch,
        "parameters": sum(p.numel() for p in model.parameters()), "batch_size": args.batch_size,
        "tokens": len(ids), "windows": windows, "max_length": args.max_length, "stride": args.stride,
        "fedtune": {"perplexity": fedtune_ppl, "tokens_scored": scored, "seconds": round(fedtune_s, 2),
                    "tokens_per_s": round(scored / fedtune_s)},
        "hf_guide": {"perplexity": guide_ppl, "tokens_scored": guide_tokens, "seconds": round(guide_s, 2),
                     "tokens_per_s": round(guide_tokens / guide_s)},
        "relative_difference": abs(fedtune_ppl - guide_ppl) / guide_ppl,
        "speedup": round((scored / fedtune_s) / (guide_tokens / guide_s), 2),
    }  # fmt: skip
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
