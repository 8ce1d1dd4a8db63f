"""Perplexity and bits per byte of one model on one site's test text.

The documents are templated and tokenized exactly as the tokenize stage does it (BOS before and EOS
after each document, nothing added by the tokenizer itself) and joined into one token stream. The stream
is scored over windows of `max_length` tokens that start every `stride` tokens; in each window only the
tokens not scored by an earlier window count, the rest is context (labels -100), as in the Hugging Face
perplexity guide (https://huggingface.co/docs/transformers/perplexity). stride = max_length gives
disjoint blocks, where the first token of each block has no context and is not scored.

Perplexity depends on the tokenizer; bits per byte (total NLL in bits over the UTF-8 bytes of the text)
does not, so models with different vocabularies can be compared on it.

A classifier (task sequence-classification in --options) is scored by accuracy and macro-F1 on the test split's
labels: each document is templated and tokenized as the tokenize stage does for classification (the
tokenizer's special tokens, truncated at max_length, which EvaluateOptions.for_run sets to tokenize.block_size)."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fedtune.core import adapters, cli, tracking
from fedtune.core.accelerators import check_device
from fedtune.core.atomic import write_json
from fedtune.core.models import load_tokenizer
from fedtune.core.options import (
    CLASSIFICATION,
    UserError,
    check_fits,
    check_template,
    label_problem,
)
from fedtune.core.progress import track
from fedtune.core.tracking_options import TrackingOptions
from fedtune.evaluate.options import EvaluateOptions
from fedtune.tokenize.shards import TokenizeError, encode_documents, encode_examples


class EvaluateError(UserError):
    """Bad options or data: the message names the option or the file to fix."""


@dataclass(frozen=True)
class Window:
    begin: int  # first token of the window in the stream
    end: int  # one past the last token
    targets: int  # the last `targets` tokens of the window are scored (when they have a predecessor)


@dataclass
class Stream:
    ids: list[int]
    documents: int
    bytes: int


@dataclass(frozen=True)
class EvalJob:
    """One model scored on one site's split: this job's facts (paths, the site's columns and template,
    the model's label and round), where EvaluateOptions holds the run's settings. `base`: the base model
    of an adapter folder (train.adapter), evaluated as base + adapter without merging."""

    model_dir: str | Path
    data_dir: str | Path
    split: str = "test"
    text_field: str = "text"
    template: str = "{text}"
    label_field: str = "label"
    site: str | None = None
    label: str | None = None
    round_number: int | None = None
    base: str | Path | None = None


def windows(n_tokens: int, max_length: int, stride: int | None = None) -> list[Window]:
    """The HF perplexity guide's windows over a stream of n_tokens; stride None means disjoint blocks."""
    stride = max_length if stride is None else stride
    if max_length < 2:
        raise EvaluateError(f"max_length: {max_length} is too small (at least 2 tokens)")
    if not 1 <= stride <= max_length:
        raise EvaluateError(f"stride: {stride} must be between 1 and max_length ({max_length})")
    result = []
    previous_end = 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + max_length, n_tokens)
        result.append(Window(begin, end, end - previous_end))
        previous_end = end
        if end == n_tokens:
            break
    return result


def build_stream(
    texts: Iterable[str], tokenizer, template: str = "{text}", *, add_bos: bool = True
) -> Stream:
    """Template, tokenize and join the documents: [BOS] doc [EOS] [BOS] doc [EOS] ...

    The tokenize stage's own encoder does it, so the evaluated text is exactly the trained-on kind."""

    texts = list(texts)
    try:
        flat, _, n_bytes = encode_documents(texts, tokenizer, template, add_bos)
    except TokenizeError as e:
        raise EvaluateError(str(e)) from None
    return Stream(flat.tolist(), len(texts), n_bytes)


def score(
    model, ids: Sequence[int], max_length: int, stride: int | None, batch_size: int, device=None,
    desc: str = "evaluate",
):  # fmt: skip
    """(total NLL in nats, tokens scored, windows) of `model` on the token stream `ids`; `desc` labels
    the progress bar (or, in a log, its periodic lines)."""
    import torch
    import torch.nn.functional as F

    device = device or next(model.parameters()).device
    spans = windows(len(ids), max_length, stride)
    stream = torch.tensor(ids, dtype=torch.long)
    # Summed on the device, read once at the end: a .item() per batch would stall a GPU every step.
    nll = torch.zeros((), dtype=torch.float64, device=device)
    scored = 0
    for first in track(range(0, len(spans), batch_size), desc=desc, unit="batch"):
        batch = spans[first : first + batch_size]
        width = max(w.end - w.begin for w in batch)
        # Right padding: a causal model's earlier positions never see it, and its labels are masked.
        input_ids = torch.zeros((len(batch), width), dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, w in enumerate(batch):
            length = w.end - w.begin
            input_ids[row, :length] = stream[w.begin : w.end]
            attention[row, :length] = 1
            context = max(length - w.targets, 0)
            labels[row, context:length] = stream[w.begin + context : w.end]
        scored += int((labels[:, 1:] != -100).sum())
        padded = bool((attention == 0).any())
        input_ids, labels = input_ids.to(device), labels.to(device)
        with torch.inference_mode():
            logits = model(
                input_ids=input_ids,
                attention_mask=attention.to(device) if padded else None,
                use_cache=False,
            ).logits
            # Row by row: fp32 logits of a whole batch of a 32k-vocabulary model take gigabytes.
            for row in range(len(batch)):
                nll += F.cross_entropy(
                    logits[row, :-1].float(), labels[row, 1:], ignore_index=-100, reduction="sum"
                ).double()
    return nll.item(), scored, len(spans)


def load_split(data_dir: str | Path, split: str, columns: dict[str, str], max_documents: int | None):
    """The split's columns ({option: column name}), after checking each exists."""
    from datasets import DatasetDict, load_from_disk

    try:
        data = load_from_disk(str(data_dir))
    except FileNotFoundError:
        raise EvaluateError(f"--data: no dataset saved with save_to_disk at {data_dir}") from None
    if isinstance(data, DatasetDict):
        if split not in data:
            raise EvaluateError(f"--split: {data_dir} has no split {split!r}; it has {sorted(data)}")
        data = data[split]
    for option, column in columns.items():
        if column not in data.column_names:
            raise EvaluateError(f"{option}: {data_dir} has no column {column!r}; it has {data.column_names}")
    if max_documents is not None:
        data = data.select(range(min(max_documents, len(data))))
    return data


def load_texts(data_dir: str | Path, split: str, text_field: str, max_documents: int | None) -> list[str]:
    return list(load_split(data_dir, split, {"--text-field": text_field}, max_documents)[text_field])


def classification_metrics(labels: Sequence[int], predictions: Sequence[int]) -> dict:
    """Accuracy, macro-F1 and per-class precision / recall / F1 / support. Macro-F1 averages over the
    classes that occur among the labels or the predictions (scikit-learn's f1_score(average="macro")),
    with F1 = 0 for a class never predicted correctly."""
    import numpy as np

    labels, predictions = np.asarray(labels), np.asarray(predictions)
    if len(labels) == 0 or len(labels) != len(predictions):
        raise EvaluateError(f"{len(labels)} labels and {len(predictions)} predictions: nothing to score")
    classes = sorted(set(labels.tolist()) | set(predictions.tolist()))
    per_class = {}
    for c in classes:
        tp = int(((predictions == c) & (labels == c)).sum())
        predicted, actual = int((predictions == c).sum()), int((labels == c).sum())
        precision = tp / predicted if predicted else 0.0
        recall = tp / actual if actual else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        per_class[str(c)] = {"precision": precision, "recall": recall, "f1": f1, "support": actual}
    return {
        "accuracy": float((labels == predictions).mean()),
        "macro_f1": float(np.mean([m["f1"] for m in per_class.values()])),
        "per_class": per_class,
    }


def classify(
    model, rows, lengths, batch_size: int, device, desc: str = "evaluate"
) -> tuple[list[int], list[list[float]]]:
    """Predicted class and logits of each row; a batch is cut to its longest row, the rest masked."""
    import torch

    predictions, all_logits = [], []
    for first in track(range(0, len(rows), batch_size), desc=desc, unit="batch"):
        width = int(lengths[first : first + batch_size].max())
        input_ids = torch.as_tensor(rows[first : first + batch_size, :width], dtype=torch.long)
        mask = torch.arange(width)[None, :] < torch.as_tensor(lengths[first : first + batch_size])[:, None]
        with torch.inference_mode():
            logits = model(
                input_ids=input_ids.to(device), attention_mask=mask.long().to(device)
            ).logits.float()
        predictions += logits.argmax(-1).tolist()
        all_logits += logits.cpu().tolist()
    return predictions, all_logits


def evaluate_classifier(job: EvalJob, options: EvaluateOptions, device: str, loaded: tuple | None) -> dict:
    import numpy as np
    import torch

    model_dir, data_dir, split, label_field = job.model_dir, job.data_dir, job.split, job.label_field
    max_length, batch_size = options.max_length, options.batch_size
    data = load_split(
        data_dir, split, {"--text-field": job.text_field, "--label-field": label_field}, options.max_documents
    )
    labels = np.asarray(data.with_format("numpy")[label_field])
    if len(labels) == 0:
        raise EvaluateError(f"{data_dir} ({split}): no documents to classify")
    model, tokenizer = loaded or load(model_dir, options, device, job.base)
    num_labels = model.config.num_labels
    problem = label_problem(labels, num_labels)
    if problem:
        raise EvaluateError(
            f"--label-field: {data_dir} ({split}) column {label_field!r}: {problem} ({model_dir})"
        )
    try:
        rows, lengths, _, truncated, n_bytes = encode_examples(
            data[job.text_field], tokenizer, job.template, max_length
        )
    except TokenizeError as e:
        raise EvaluateError(str(e)) from None
    predictions, logits = classify(
        model,
        rows,
        lengths,
        batch_size,
        device,
        desc=f"evaluate {Path(model_dir).name} on {split} of {data_dir}",
    )
    log_probs = torch.log_softmax(torch.tensor(logits, dtype=torch.float64), dim=-1)
    nll = float(-log_probs[torch.arange(len(labels)), torch.as_tensor(labels)].mean())
    metrics = classification_metrics(labels.tolist(), predictions)
    return {
        **metrics,
        "nll": nll,
        "documents": len(labels),
        "truncated": truncated,
        "tokens": int(lengths.sum()),
        "bytes": n_bytes,
        "num_labels": num_labels,
        "max_length": max_length,
        "batch_size": batch_size,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }


def load(model_dir, options: EvaluateOptions, device: str = "cpu", base=None):
    """(model on `device`, in eval mode; tokenizer) of a model folder, or of a base + adapter folder, for
    the options' task, in their dtype."""
    tokenizer = load_tokenizer(adapters.weights_folder(model_dir, base))
    model = adapters.load_model(model_dir, base=base, task=options.task, dtype=options.dtype)
    return model.to(device).eval(), tokenizer


def evaluate(
    job: EvalJob, options: EvaluateOptions, device: str | None = None, loaded: tuple | None = None
) -> dict:
    """Scores of one model on one split (`job`), as `options` (the evaluate section with the run's task
    and BOS choice, EvaluateOptions.for_run) says. `loaded`: (model, tokenizer) as `load` returned them
    for this model, device and dtype, so that one load serves every site."""
    import torch

    started = time.perf_counter()
    task, max_length, stride = options.task, options.max_length, options.stride
    batch_size, max_documents = options.batch_size, options.max_documents
    add_bos = options.add_bos
    if task != CLASSIFICATION:
        windows(max_length, max_length, stride)  # option checks, before loading anything
    if batch_size < 1:
        raise EvaluateError(f"batch_size: {batch_size} must be at least 1")
    check_template(job.template, "--template")
    model_dir, data_dir, split, base = job.model_dir, job.data_dir, job.split, job.base
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_device(device)  # a GPU this torch build cannot drive stops here, not at the first kernel
    identity = {
        "model": job.label or Path(model_dir).name,
        "model_dir": str(model_dir),
        "round": job.round_number,
        "site": job.site,
        "task": task,
        "data": str(data_dir),
        "split": split,
        "base": str(base) if base is not None and adapters.is_adapter(model_dir) else None,
    }
    if task == CLASSIFICATION:
        scores = evaluate_classifier(job, options, device, loaded)
        return {
            **identity,
            **scores,
            "template": job.template,
            "device": str(device),
            "wall_time_s": round(time.perf_counter() - started, 3),
        }

    texts = load_texts(data_dir, split, job.text_field, max_documents)
    weights = adapters.weights_folder(model_dir, base)
    tokenizer = loaded[1] if loaded else load_tokenizer(weights)
    stream = build_stream(texts, tokenizer, job.template, add_bos=add_bos)
    if len(stream.ids) < 2:
        raise EvaluateError(f"{data_dir} ({split}): {len(stream.ids)} tokens, nothing to score")
    model_config = weights / "config.json"
    if model_config.is_file():
        check_fits(max_length, json.loads(model_config.read_text()), "max_length", str(model_config))
    model = loaded[0] if loaded else load(model_dir, options, device, base)[0]

    nll, scored, n_windows = score(
        model, stream.ids, max_length, stride, batch_size, device,
        desc=f"evaluate {job.label or Path(model_dir).name} on {job.site or data_dir} ({split})",
    )  # fmt: skip
    mean = nll / scored
    return {
        **identity,
        "perplexity": math.exp(mean),
        "nll": mean,
        "nll_sum": nll,
        "bits_per_byte": nll / math.log(2) / stream.bytes if stream.bytes else None,
        "tokens": scored,
        "stream_tokens": len(stream.ids),
        "documents": stream.documents,
        "bytes": stream.bytes,
        "windows": n_windows,
        "max_length": max_length,
        "stride": stride if stride is not None else max_length,
        "batch_size": batch_size,
        "template": job.template,
        "add_bos": add_bos,
        "device": str(device),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "wall_time_s": round(time.perf_counter() - started, 3),
    }


def _tracking_options(args) -> TrackingOptions | None:
    """The tracking section of --tracking, checked before any model loads (None: not tracked)."""
    if args.tracking is None:
        return None
    options = tracking.check_available(TrackingOptions.from_json(args.tracking, source="--tracking"))
    if options.on and (args.run_name is None or args.round is None or args.label is None):
        raise tracking.TrackingError(
            "--tracking: needs --run-name, --round and --label to name the tracked run"
        )
    return options


@cli.entry("fedtune.evaluate.scores", offline=True)
def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.parser(
        "fedtune.evaluate.scores", "Perplexity and bits per byte of one model on one site's raw test split."
    )
    parser.add_argument(
        "--model", required=True, help="HF model folder (save_pretrained) or PEFT adapter folder"
    )
    parser.add_argument("--base", default=None, help="the base model of an adapter --model (train.adapter)")
    parser.add_argument("--data", default=None, help="raw DatasetDict folder (save_to_disk): data/<site>/raw")
    # Per-invocation facts, not settings: which split, and each site's columns and template (--sites).
    parser.add_argument("--split", default="test")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--label-field", default="label", help="class column (sequence-classification)")
    parser.add_argument("--template", default="{text}", help="format string applied to each document")
    parser.add_argument(
        "--options",
        default=None,
        help="every setting: the evaluate config section as JSON (evaluate.schema.yaml) with the run's task "
        "and add_bos (EvaluateOptions.for_run); defaults for what it leaves out",
    )
    parser.add_argument("--site", default=None, help="name of the site whose text this is (for the report)")
    cli.add_scored_model(parser)
    parser.add_argument("--out", default=None, help="result JSON")
    cli.add_tracking(parser)
    parser.add_argument(
        "--sites",
        default=None,
        help="several sites' test splits for one load of the model: a JSON list of {site, data, out, "
        "text_field, template, label_field}; replaces --site, --data, --text-field, --template, "
        "--label-field and --out",
    )
    args = parser.parse_args(argv)

    tracked = _tracking_options(args)
    options = EvaluateOptions.from_json(args.options or "{}", source="--options")
    sites = _site_jobs(args)
    if options.task != CLASSIFICATION:
        windows(options.max_length, options.max_length, options.stride)  # option checks before loading
    for i, job in enumerate(sites):
        check_template(job["template"], f"--sites[{i}].template" if args.sites else "--template")
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_device(device)
    # One load of the model for every site.
    loaded = load(args.model, options, device, args.base)
    for job in sites:
        scored = EvalJob(
            args.model,
            job["data"],
            split=args.split,
            text_field=job["text_field"],
            template=job["template"],
            label_field=job["label_field"],
            site=job["site"],
            label=args.label,
            round_number=args.round,
            base=args.base,
        )
        result = evaluate(scored, options, device, loaded)
        write_json(job["out"], result)
        if tracked is not None:
            tracking.log_evaluation(tracked, result, run=args.run_name)
        _print_result(result, job["data"], options.task)
    return 0


def _site_jobs(args) -> list[dict]:
    """The sites to score: --sites, or the one of --site, --data, --out and their fields."""
    if args.sites is None:
        if args.data is None or args.out is None:
            raise EvaluateError("--data and --out are needed (or --sites)")
        return [
            {"site": args.site, "data": args.data, "out": args.out, "text_field": args.text_field,
             "template": args.template, "label_field": args.label_field}
        ]  # fmt: skip
    try:
        entries = json.loads(args.sites)
    except json.JSONDecodeError as e:
        raise EvaluateError(f"--sites: not valid JSON: {e}") from None
    if not isinstance(entries, list) or not entries:
        raise EvaluateError("--sites: a non-empty JSON list of {site, data, out, ...} expected")
    jobs = []
    for i, entry in enumerate(entries):
        missing = [key for key in ("site", "data", "out") if not isinstance(entry, dict) or key not in entry]
        if missing:
            raise EvaluateError(f"--sites[{i}]: {', '.join(missing)} missing")
        jobs.append({"text_field": "text", "template": "{text}", "label_field": "label", **entry})
    return jobs


def _print_result(result: dict, data, task: str) -> None:
    if task == CLASSIFICATION:
        print(
            f"[evaluate] {result['model']} on {result['site'] or data}: accuracy {result['accuracy']:.4f}, "
            f"macro-F1 {result['macro_f1']:.4f} on {result['documents']:,} documents, "
            f"{result['wall_time_s']:.1f} s on {result['device']}",
            file=sys.stderr,
        )
        return
    print(
        f"[evaluate] {result['model']} on {result['site'] or data}: perplexity {result['perplexity']:.4f}, "
        f"{result['bits_per_byte']:.4f} bits/byte, {result['tokens']:,} tokens in {result['windows']} windows, "
        f"{result['wall_time_s']:.1f} s on {result['device']}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    sys.exit(main())
