"""task: sequence-classification through every stage: labels checked at download, a seeded head on the
base model, one row per document at tokenize (the tokenizer's own special tokens, truncation, padding
masked), training on labels, aggregation of heads, accuracy and macro-F1 in evaluate and the report, and
the whole workflow on CPU."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fedtune.core.models import CLASSIFICATION, ModelError, load_model, load_tokenizer, model_task
from fedtune.download.fetch import DownloadError, download_data, download_model
from fedtune.download.options import DatasetOptions, ModelOptions
from fedtune.evaluate.options import EvaluateOptions
from fedtune.evaluate.scores import EvalJob, EvaluateError, classification_metrics, evaluate
from fedtune.tokenize.shards import ShardJob, TokenizeError, encode_examples, tokenize_shard, verify_shard
from tests.conftest import TINY_ARCHITECTURE, corpus
from tests.workflow_harness import planned_jobs, snakemake, write_config

NUM_LABELS = 3


# -- metrics --------------------------------------------------------------------------------------------


def shard_options(**values):
    """One shard of a classifier's data: the tokenize options of the workflow's classification runs."""
    from fedtune.tokenize.options import TokenizeOptions

    return TokenizeOptions.from_mapping({"shards": 1, "task": CLASSIFICATION, **values})


def test_metrics_match_a_hand_computation():
    labels = [0, 0, 1, 1, 2, 2]
    predictions = [0, 1, 1, 1, 0, 3]  # class 3 is predicted but never the label
    m = classification_metrics(labels, predictions)
    assert m["accuracy"] == pytest.approx(3 / 6)
    # class 0: tp 1, predicted 2, actual 2 -> p 1/2, r 1/2, f1 1/2
    # class 1: tp 2, predicted 3, actual 2 -> p 2/3, r 1, f1 0.8
    # class 2: tp 0 -> f1 0; class 3: tp 0, actual 0 -> f1 0 (it still counts, as in scikit-learn)
    assert m["per_class"]["1"] == pytest.approx({"precision": 2 / 3, "recall": 1.0, "f1": 0.8, "support": 2})
    assert m["macro_f1"] == pytest.approx((0.5 + 0.8 + 0 + 0) / 4)
    assert classification_metrics([1, 1], [1, 1]) == {
        "accuracy": 1.0,
        "macro_f1": 1.0,
        "per_class": {"1": {"precision": 1.0, "recall": 1.0, "f1": 1.0, "support": 2}},
    }


# -- download -------------------------------------------------------------------------------------------


def labelled(tmp_path: Path, rows_train: list[dict], rows_test: list[dict] | None = None) -> dict:
    files = {}
    for split, rows in (("train", rows_train), ("test", rows_test or rows_train)):
        path = tmp_path / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        files[split] = str(path)
    return {"source": "local", "data_files": files}


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"text": "a", "label": 0}, {"text": "b", "label": 3}], "row 1 has label 3, outside 0..2"),
        ([{"text": "a", "label": -1}], "row 0 has label -1"),
        ([{"text": "a", "label": "good"}], "not class numbers"),
        ([{"text": "a", "stars": 1}], "dataset.label_field 'label' is not a column"),
    ],
)
def test_download_refuses_bad_labels_naming_row_and_value(tmp_path, rows, message):
    with pytest.raises(DownloadError, match=message):
        download_data(
            DatasetOptions.from_mapping(labelled(tmp_path, rows)), tmp_path / "raw", num_labels=NUM_LABELS
        )
    assert not (tmp_path / "raw").exists()


def test_download_accepts_good_labels_and_a_custom_label_field(tmp_path):
    spec = labelled(tmp_path, [{"text": "a", "stars": 2}, {"text": "b", "stars": 0}])
    counts = download_data(
        DatasetOptions.from_mapping({**spec, "label_field": "stars"}), tmp_path / "raw", num_labels=NUM_LABELS
    )
    assert counts == {"train": 2, "test": 2}


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory) -> Path:
    """The init source for classification: a tiny Llama classifier and its tokenizer."""
    root = tmp_path_factory.mktemp("classifier")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus(200)))
    spec = {"source": "init", "architecture": TINY_ARCHITECTURE, "num_labels": NUM_LABELS}
    spec["tokenizer"] = {"vocab_size": 300}
    raw = root / "raw"
    download_data(
        DatasetOptions.from_mapping(
            {"source": "local", "data_files": {"train": str(data)}, "test_fraction": 0.1}
        ),
        raw,
    )
    download_model(ModelOptions.from_mapping(spec), root / "model", [{"path": str(raw)}], task=CLASSIFICATION)
    return root / "model"


def test_init_builds_a_classifier_with_the_configured_classes(classifier_dir):
    model = load_model(classifier_dir, task=CLASSIFICATION)
    assert model_task(classifier_dir) == CLASSIFICATION
    assert model.config.num_labels == NUM_LABELS and model.score.weight.shape[0] == NUM_LABELS
    # Last-token pooling needs a padding id.
    assert model.config.pad_token_id == load_tokenizer(classifier_dir).pad_token_id is not None


def test_hf_body_gets_a_seeded_head_and_a_padding_token(tiny_model_dir, tmp_path):
    """A causal LM checkpoint (a hub model) becomes a classifier; the new head depends on model.seed
    only, so reruns and every rank start from the same head. A tokenizer without padding pads with EOS."""
    body = tmp_path / "body"
    shutil.copytree(tiny_model_dir, body)
    config = json.loads((body / "tokenizer_config.json").read_text())
    config.pop("pad_token", None)
    (body / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(body).pad_token is None

    spec = {"source": "hf", "name": str(body), "num_labels": NUM_LABELS}
    heads = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        download_model(
            ModelOptions.from_mapping({**spec, "seed": seed}), tmp_path / name, task=CLASSIFICATION
        )
        heads.append(load_model(tmp_path / name, task=CLASSIFICATION).score.weight.detach())
    assert torch.equal(heads[0], heads[1]) and not torch.equal(heads[0], heads[2])
    tokenizer = load_tokenizer(tmp_path / "a")
    assert tokenizer.pad_token == tokenizer.eos_token
    assert load_model(tmp_path / "a", task=CLASSIFICATION).config.pad_token_id == tokenizer.eos_token_id
    # The body's weights are the checkpoint's.
    original = load_model(body).model.embed_tokens.weight
    assert torch.equal(load_model(tmp_path / "a", task=CLASSIFICATION).model.embed_tokens.weight, original)


def test_a_local_model_folder_becomes_a_classifier_with_its_head_saved(tiny_model_dir, tmp_path):
    """source local links a language model's files as they are; a classifier's head must be saved with
    the body, so the folder is loaded and saved instead, and the source folder is left untouched."""
    before = sorted(p.name for p in tiny_model_dir.iterdir())
    spec = {"source": "local", "path": str(tiny_model_dir), "num_labels": NUM_LABELS}
    download_model(ModelOptions.from_mapping(spec), tmp_path / "m", task=CLASSIFICATION)
    model = load_model(tmp_path / "m", task=CLASSIFICATION)
    assert model.score.weight.shape[0] == NUM_LABELS
    assert sorted(p.name for p in tiny_model_dir.iterdir()) == before
    assert model_task(tiny_model_dir) == "causal-lm"


def test_classification_needs_num_labels(tiny_model_dir, tmp_path):
    from fedtune.core.options import ConfigError

    with pytest.raises(ConfigError, match="model.num_labels"):
        download_model(
            ModelOptions.from_mapping({"source": "hf", "name": str(tiny_model_dir)}),
            tmp_path / "m",
            task=CLASSIFICATION,
        )


def test_a_model_of_the_other_task_is_refused(classifier_dir, tiny_model_dir):
    with pytest.raises(ModelError, match="a sequence-classification model .* the task is causal-lm"):
        load_model(classifier_dir)
    with pytest.raises(ModelError, match="a causal-lm model .* the task is sequence-classification"):
        load_model(tiny_model_dir, task=CLASSIFICATION)


# -- tokenize -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wordpiece_tokenizer():
    """A BERT-style tokenizer: its post-processor wraps every text in [CLS] ... [SEP]."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(corpus(200), trainers.WordPieceTrainer(vocab_size=200, special_tokens=specials))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    )


def test_rows_carry_the_tokenizers_special_tokens_and_keep_sep_when_truncated(wordpiece_tokenizer):
    tok = wordpiece_tokenizer
    texts = ["the cat sat", "the quick red dog ran over the blue mat and then the log"]
    rows, lengths, dropped, truncated, n_bytes = encode_examples(texts, tok, "{text}", block_size=8)
    cls, sep, pad = tok.cls_token_id, tok.sep_token_id, tok.pad_token_id
    short = tok("the cat sat")["input_ids"]  # the tokenizer's own encoding, [CLS] ... [SEP]
    assert short[0] == cls and short[-1] == sep
    assert rows[0].tolist() == short + [pad] * (8 - len(short)) and lengths[0] == len(short)
    full = tok(texts[1])["input_ids"]
    assert rows[1].tolist() == full[:7] + [sep] and lengths[1] == 8  # truncated text, [SEP] kept
    assert truncated == 1 and dropped == len(full) - 8
    assert n_bytes == sum(len(t) for t in texts)
    # The caller's tokenizer is left as it was: no truncation state leaks out.
    assert len(tok(texts[1])["input_ids"]) == len(full)


def test_classification_shards_hold_one_labelled_row_per_document(classifier_dir, tmp_path):
    from datasets import Dataset, DatasetDict

    from fedtune.tokenize.blocks import Blocks

    texts = corpus(10)
    labels = [i % NUM_LABELS for i in range(10)]
    DatasetDict({"train": Dataset.from_dict({"text": texts, "y": labels})}).save_to_disk(tmp_path / "raw")
    options = shard_options(block_size=16, label_field="y", template="Review: {text}")
    counts = tokenize_shard(
        ShardJob(tmp_path / "raw", "train", 0, classifier_dir, tmp_path / "shard"), options
    )
    verify_shard(tmp_path / "shard")
    assert counts["task"] == CLASSIFICATION and counts["blocks"] == counts["documents"] == 10
    assert counts["label_counts"] == {"0": 4, "1": 3, "2": 3}
    blocks = Blocks([tmp_path / "shard"])
    assert blocks.classification and len(blocks) == 10
    input_ids, row_labels = blocks.get(range(10))
    assert row_labels.tolist() == labels and input_ids.shape == (10, 16)
    mask = blocks.attention_mask(range(10))
    tokenizer = load_tokenizer(classifier_dir)
    for i, text in enumerate(texts):
        ids = tokenizer(f"Review: {text}")["input_ids"][:16]
        assert input_ids[i, : len(ids)].tolist() == ids and mask[i].tolist() == [1] * len(ids) + [0] * (
            16 - len(ids)
        )


def test_tokenize_refuses_labels_outside_the_models_classes(classifier_dir, tmp_path):
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_dict({"text": ["a", "b"], "label": [0, 5]})}).save_to_disk(
        tmp_path / "raw"
    )
    with pytest.raises(
        TokenizeError,
        match=r"--options: label_field: .* row 1 has label 5, outside 0..2 \(the model has 3 classes\)",
    ):
        tokenize_shard(
            ShardJob(tmp_path / "raw", "train", 0, classifier_dir, tmp_path / "s"), shard_options()
        )
    assert not (tmp_path / "s").exists()


def test_tokenize_refuses_a_base_model_that_is_no_classifier(tiny_model_dir, tmp_path):
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_dict({"text": ["a"], "label": [0]})}).save_to_disk(tmp_path / "raw")
    with pytest.raises(TokenizeError, match="is not a sequence classifier"):
        tokenize_shard(
            ShardJob(tmp_path / "raw", "train", 0, tiny_model_dir, tmp_path / "s"), shard_options()
        )


# -- evaluate -------------------------------------------------------------------------------------------


def test_evaluate_scores_predictions_with_padding_masked(classifier_dir, tmp_path):
    """Accuracy and macro-F1 of the model's own predictions, one document at a time (no padding at all)
    against batches cut to their longest row: the masked padding must not change a single prediction."""
    from datasets import Dataset, DatasetDict

    texts = corpus(24)
    labels = [i % NUM_LABELS for i in range(24)]
    DatasetDict({"test": Dataset.from_dict({"text": texts, "label": labels})}).save_to_disk(tmp_path / "raw")
    # stride belongs to perplexity windows: a classifier ignores it, even one above max_length.
    settings = dict(task=CLASSIFICATION, max_length=24, stride=512)
    batched, single = (
        evaluate(EvalJob(classifier_dir, tmp_path / "raw", template="{text}"),
                 EvaluateOptions.from_mapping({**settings, "batch_size": size}), device="cpu")
        for size in (8, 1)
    )  # fmt: skip
    model = load_model(classifier_dir, task=CLASSIFICATION).eval()
    tokenizer = load_tokenizer(classifier_dir)
    with torch.no_grad():
        own = [int(model(torch.tensor([tokenizer(t)["input_ids"][:24]])).logits.argmax(-1)) for t in texts]
    expected = classification_metrics(labels, own)
    for result in (batched, single):
        assert result["accuracy"] == pytest.approx(expected["accuracy"])
        assert result["macro_f1"] == pytest.approx(expected["macro_f1"])
    assert batched["nll"] == pytest.approx(single["nll"], rel=1e-5)
    assert batched["task"] == CLASSIFICATION and batched["documents"] == 24


def test_evaluate_refuses_a_missing_label_column(classifier_dir, tmp_path):
    from datasets import Dataset, DatasetDict

    DatasetDict({"test": Dataset.from_dict({"text": ["a"]})}).save_to_disk(tmp_path / "raw")
    with pytest.raises(EvaluateError, match="--label-field: .* has no column 'label'"):
        evaluate(
            EvalJob(classifier_dir, tmp_path / "raw"), EvaluateOptions.from_mapping({"task": CLASSIFICATION})
        )


# -- aggregate ------------------------------------------------------------------------------------------


def test_aggregation_merges_the_classification_heads(classifier_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from fedtune.aggregate.merge import AggregateJob, aggregate
    from fedtune.aggregate.options import AggregateOptions
    from fedtune.core.models import record_checksums

    states = {}
    for k, site in enumerate(("alpha", "beta")):
        shutil.copytree(classifier_dir, tmp_path / site)
        path = tmp_path / site / "model.safetensors"
        state = load_file(path)
        state = {name: t + (k + 1) * 0.5 for name, t in state.items()}
        save_file(state, path, metadata={"format": "pt"})
        record_checksums(tmp_path / site)
        states[site] = state
    aggregate(
        AggregateJob({"alpha": tmp_path / "alpha", "beta": tmp_path / "beta"}, tmp_path / "out"),
        AggregateOptions.from_mapping({"weights": {"alpha": 1.0, "beta": 3.0}}),
    )
    merged = load_model(tmp_path / "out", task=CLASSIFICATION)
    expected = (states["alpha"]["score.weight"] + 3 * states["beta"]["score.weight"]) / 4
    assert torch.allclose(merged.score.weight, expected, atol=1e-6)
    assert merged.config.num_labels == NUM_LABELS


# -- report ---------------------------------------------------------------------------------------------


def test_report_tabulates_accuracy_and_macro_f1(tmp_path):
    from fedtune.report.build import ReportError, ReportJob, report

    evals = []
    for rnd, model, alpha, beta in (
        (0, "base", 0.3, 0.4),
        (1, "alpha", 0.9, 0.5),
        (1, "aggregate", 0.8, 0.8),
    ):
        for site, acc in (("alpha", alpha), ("beta", beta)):
            path = tmp_path / f"{model}-{site}.json"
            result = {"model": model, "round": rnd, "site": site, "task": CLASSIFICATION}
            path.write_text(json.dumps({**result, "accuracy": acc, "macro_f1": acc / 2}))
            evals.append(path)
    paths = report(ReportJob(tmp_path / "report", evals))
    table = (tmp_path / "report" / "accuracy.csv").read_text().splitlines()
    assert table[0] == "round,model,alpha,beta" and table[2] == "1,alpha,0.9,0.5"
    assert (tmp_path / "report" / "macro_f1.csv").read_text().splitlines()[2] == "1,alpha,0.45,0.25"
    md = (tmp_path / "report" / "accuracy.md").read_text()
    assert "| 1 | alpha | **0.900** | 0.500 |" in md  # the highest is bold
    assert "Macro-F1" in md and "| 1 | aggregate | 0.400 | **0.400** |" in md
    assert paths["accuracy_png"].stat().st_size > 0 and not (tmp_path / "report" / "perplexity.csv").exists()

    lm = tmp_path / "lm.json"
    lm.write_text(json.dumps({"model": "base", "round": 0, "site": "alpha", "perplexity": 3.0}))
    with pytest.raises(ReportError, match="a causal-lm result among sequence-classification results"):
        report(ReportJob(tmp_path / "mixed", [*evals, lm]))


# -- the workflow ---------------------------------------------------------------------------------------


# With an adapter (train.adapter) the sites train LoRA on every linear layer plus the new head (peft's
# SEQ_CLS keeps the classifier whole), evaluated as base + adapter, aggregated exactly.
ADAPTER = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}


def reviews_config(root: Path, adapter: dict | None) -> dict:
    """Labelled reviews at two sites (written under root), a tiny Llama classifier from scratch, FSDP on 2
    CPU processes."""
    return {
        "run": "reviews",
        "task": CLASSIFICATION,
        "model": {
            "source": "init",
            "num_labels": NUM_LABELS,
            "architecture": {**TINY_ARCHITECTURE, "max_position_embeddings": 64},
            "tokenizer": {"vocab_size": 400},
        },
        "sites": {
            site: {
                "dataset": {
                    "source": "local",
                    "data_files": {
                        split: str(root / "reviews" / site / f"{split}.jsonl") for split in ("train", "test")
                    },
                },
                "prompt_template": "Review: {text}",
            }
            for site in ("alpha", "beta")
        },
        "tokenize": {"block_size": 32, "shards": 1},
        "train": {
            "micro_batch": 8,
            "global_batch": 16,
            "max_steps": 24,
            "lr": 0.003,
            "warmup_steps": 3,
            "checkpoint_every": 0,
            "processes_per_node": 2,
            "adapter": adapter,
        },
    }


# Jobs keep about one core busy each (OMP_NUM_THREADS=1): twice the cores schedules them sooner.
CORES = str(2 * (os.cpu_count() or 1))


@pytest.fixture(scope="module")
def reviews_prepared(tmp_path_factory) -> Path:
    """The stages before training, through the workflow, once for both runs below: the reviews downloaded
    and tokenized, the base classifier built and scored. None of them depends on train.adapter."""
    from fedtune.download.demo_data import write_reviews

    root = tmp_path_factory.mktemp("reviews")
    write_reviews(root / "reviews")
    write_config(root, reviews_config(root, None))
    targets = [f"results/reviews/data/{site}/manifest.json" for site in ("alpha", "beta")]
    targets += ["results/reviews/model/base"] + [
        f"results/reviews/eval/base/{s}.json" for s in ("alpha", "beta")
    ]
    snakemake(root, *targets, "--cores", CORES)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("adapter", [None, ADAPTER], ids=["full", "adapter"])
def test_classification_runs_end_to_end_on_cpu(reviews_prepared, tmp_path, adapter):
    """From the prepared data and base model (copied with their times: the workflow takes them as done),
    the rest of the workflow: each site model beats the base model's accuracy on its own test set, and
    the report tables it."""
    for part in ("data", "model", "eval"):
        shutil.copytree(
            reviews_prepared / "results/reviews" / part,
            tmp_path / "results/reviews" / part,
            copy_function=shutil.copy2,
        )
    write_config(tmp_path, reviews_config(reviews_prepared, adapter))
    result = snakemake(tmp_path, "--cores", CORES)
    # Only the stages from training on ran here.
    ran = {job.name for job in planned_jobs(result.stdout + result.stderr)}
    assert "train" in ran and not ran & {"download_data", "download_model", "tokenize", "evaluate_base"}, ran
    run = tmp_path / "results" / "reviews"

    def accuracy(path: Path) -> float:
        return json.loads(path.read_text())["accuracy"]

    for site in ("alpha", "beta"):
        base = accuracy(run / "eval" / "base" / f"{site}.json")
        own = accuracy(run / "round-1" / "eval" / site / f"{site}.json")
        assert own > base + 0.2, (site, base, own)
        summary = json.loads((run / "round-1" / site / "model" / "training.json").read_text())
        assert summary["task"] == CLASSIFICATION and summary["blocks"] == 480
    table = (run / "report" / "accuracy.csv").read_text().splitlines()
    assert table[0] == "round,model,alpha,beta" and len(table) == 5  # base, alpha, beta, aggregate
    assert (run / "report" / "macro_f1.csv").is_file() and (run / "report" / "accuracy.png").is_file()
    merged = load_model(run / "round-1" / "aggregate" / "model", task=CLASSIFICATION)
    assert merged.config.num_labels == NUM_LABELS
    assert np.isfinite(merged.score.weight.detach().numpy()).all()
    if adapter:
        from safetensors.torch import load_file

        heads = []
        for site in ("alpha", "beta"):
            saved = load_file(run / "round-1" / site / "model" / "adapter_model.safetensors")
            heads.append(saved["base_model.model.score.weight"])
            assert any(".lora_A." in name for name in saved)
            assert json.loads((run / "round-1" / "eval" / site / f"{site}.json").read_text())["base"]
        # The heads were trained whole and averaged by token weights into the merged model's head.
        assert not torch.equal(heads[0], heads[1])
        low, high = torch.minimum(*heads), torch.maximum(*heads)
        assert ((merged.score.weight >= low - 1e-6) & (merged.score.weight <= high + 1e-6)).all()


def test_two_classes_the_default_transformers_leaves_out_of_config_json(tmp_path):
    """config.json omits num_labels when it is 2 (transformers' default); tokenize must still see 2."""
    from datasets import Dataset, DatasetDict

    raw = tmp_path / "raw"
    DatasetDict({"train": Dataset.from_dict({"text": corpus(20), "label": [0, 1] * 10})}).save_to_disk(raw)
    spec = {
        "source": "init",
        "architecture": TINY_ARCHITECTURE,
        "num_labels": 2,
        "tokenizer": {"vocab_size": 300},
    }
    download_model(
        ModelOptions.from_mapping(spec), tmp_path / "model", [{"path": str(raw)}], task=CLASSIFICATION
    )
    assert "id2label" not in json.loads((tmp_path / "model" / "config.json").read_text())
    counts = tokenize_shard(
        ShardJob(raw, "train", 0, tmp_path / "model", tmp_path / "shard"), shard_options()
    )
    assert counts["num_labels"] == 2 and counts["label_counts"] == {"0": 10, "1": 10}
