"""Perplexity against hand-written loops (disjoint blocks and sliding windows), the token stream, and
bits per byte."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random

import pytest
import torch

from fedtune.core.options import ConfigError
from fedtune.evaluate.options import EvaluateOptions
from fedtune.evaluate.scores import EvalJob, EvaluateError, Window, build_stream, evaluate, score, windows

TEMPLATE = "Scrivi: {text}"


def options(**settings) -> EvaluateOptions:
    """The evaluate section with these settings, the schema's defaults for the rest."""
    return EvaluateOptions.from_mapping(settings)


def corpus(n: int) -> list[str]:
    rng = random.Random(1)
    words = "the a cat dog sat ran on over mat log quick slow red blue green big small and then".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 60))) + "." for _ in range(n)]


@pytest.fixture(scope="module")
def raw_data(tmp_path_factory):
    from datasets import Dataset, DatasetDict

    texts = corpus(60)
    # Non-ASCII text: bytes and characters differ, which bits per byte must count right.
    test = [t.replace("cat", "gattò") for t in texts[:12]]
    out = tmp_path_factory.mktemp("raw") / "raw"
    DatasetDict(
        {"train": Dataset.from_dict({"text": texts}), "test": Dataset.from_dict({"text": test})}
    ).save_to_disk(out)
    return out, test


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    from fedtune.core.models import load_causal_lm, load_tokenizer

    return load_causal_lm(tiny_model_dir).eval(), load_tokenizer(tiny_model_dir)


def test_windows_disjoint_and_sliding():
    assert windows(10, 4) == [Window(0, 4, 4), Window(4, 8, 4), Window(8, 10, 2)]
    assert windows(10, 4, 4) == windows(10, 4, None)
    assert windows(10, 4, 2) == [Window(0, 4, 4), Window(2, 6, 2), Window(4, 8, 2), Window(6, 10, 2)]
    assert windows(3, 8, 2) == [Window(0, 3, 3)]
    with pytest.raises(EvaluateError, match="stride: 5 must be between 1 and max_length"):
        windows(10, 4, 5)


def test_stream_puts_bos_and_eos_around_each_templated_document(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    texts = ["the cat sat.", "a dog ran."]
    stream = build_stream(texts, tokenizer, TEMPLATE)
    expected = []
    for text in texts:
        ids = tokenizer(TEMPLATE.format(text=text), add_special_tokens=False)["input_ids"]
        expected += [tokenizer.bos_token_id, *ids, tokenizer.eos_token_id]
    assert stream.ids == expected
    assert stream.documents == 2
    assert stream.bytes == sum(len(TEMPLATE.format(text=t).encode()) for t in texts)
    assert build_stream(texts, tokenizer, TEMPLATE, add_bos=False).ids == [
        i for i in expected if i != tokenizer.bos_token_id
    ]


def hand_disjoint(model, ids, block):
    """Independent of evaluate: every block on its own, log-softmax picked at the next token."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids), block):
            chunk = torch.tensor([ids[start : start + block]])
            if chunk.shape[1] < 2:
                continue
            logp = torch.log_softmax(model(chunk).logits[0, :-1].double(), dim=-1)
            nll -= logp.gather(1, chunk[0, 1:, None]).sum().item()
            count += chunk.shape[1] - 1
    return nll, count


def hand_sliding(model, ids, max_length, stride):
    """The HF perplexity guide's loop, one window at a time, with the model's own loss; the token
    count is the labels that survive the shift."""
    nll, count, prev_end = 0.0, 0, 0
    with torch.no_grad():
        for begin in range(0, len(ids), stride):
            end = min(begin + max_length, len(ids))
            trg_len = end - prev_end
            input_ids = torch.tensor([ids[begin:end]])
            target_ids = input_ids.clone()
            target_ids[:, :-trg_len] = -100
            n = int((target_ids[:, 1:] != -100).sum())
            nll += model(input_ids, labels=target_ids).loss.item() * n
            count += n
            prev_end = end
            if end == len(ids):
                break
    return nll, count


@pytest.mark.parametrize(("max_length", "stride"), [(32, None), (32, 32), (32, 8), (40, 13)])
def test_perplexity_matches_hand_loops(tiny_model_dir, model_and_tokenizer, raw_data, max_length, stride):
    model, tokenizer = model_and_tokenizer
    data, texts = raw_data
    ids = build_stream(texts, tokenizer, TEMPLATE).ids
    if stride in (None, max_length):
        nll, count = hand_disjoint(model, ids, max_length)
        assert count == len(ids) - math.ceil(len(ids) / max_length)
    else:
        nll, count = hand_sliding(model, ids, max_length, stride)
        # Sliding windows score every token but the first exactly once.
        assert count == len(ids) - 1
    # A batch size that does not divide the window count: the last batch holds a padded short window.
    settings = options(max_length=max_length, stride=stride, batch_size=3)
    result = evaluate(EvalJob(tiny_model_dir, data, template=TEMPLATE), settings)
    assert result["tokens"] == count
    assert result["stream_tokens"] == len(ids)
    assert result["windows"] == len(windows(len(ids), max_length, stride))
    assert result["nll_sum"] == pytest.approx(nll, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-5)
    assert result["nll"] == pytest.approx(nll / count, rel=1e-5)


def test_bits_per_byte(tiny_model_dir, raw_data):
    data, texts = raw_data
    result = evaluate(
        EvalJob(tiny_model_dir, data, template=TEMPLATE), options(max_length=64, stride=32, max_documents=5)
    )
    n_bytes = sum(len(TEMPLATE.format(text=t).encode("utf-8")) for t in texts[:5])
    assert result["documents"] == 5 and result["bytes"] == n_bytes
    assert n_bytes > sum(len(TEMPLATE.format(text=t)) for t in texts[:5])  # the ò counts twice
    assert result["bits_per_byte"] == pytest.approx(result["nll_sum"] / math.log(2) / n_bytes)
    # The same total NLL spread over tokens: log2(ppl) * tokens == bits per byte * bytes.
    assert math.log2(result["perplexity"]) * result["tokens"] == pytest.approx(
        result["bits_per_byte"] * n_bytes
    )


def test_option_and_data_errors(tiny_model_dir, raw_data):
    data, _ = raw_data
    with pytest.raises(EvaluateError, match="--split"):
        evaluate(EvalJob(tiny_model_dir, data, split="validation"), options())
    with pytest.raises(EvaluateError, match="--text-field"):
        evaluate(EvalJob(tiny_model_dir, data, text_field="body"), options())
    with pytest.raises(ConfigError, match=r"max_length: 512 exceeds the model's maximum positions \(256\)"):
        evaluate(EvalJob(tiny_model_dir, data), options(max_length=512))
    with pytest.raises(ConfigError, match="--template"):
        evaluate(EvalJob(tiny_model_dir, data, template="{text} {other}"), options())


def test_cli_writes_result(tiny_model_dir, raw_data, tmp_path, monkeypatch):
    from fedtune.core.offline import OFFLINE_VARIABLES
    from fedtune.evaluate.scores import main

    for name in OFFLINE_VARIABLES:  # main() sets them; monkeypatch restores them afterwards
        monkeypatch.setenv(name, "0")
    data, _ = raw_data
    out = tmp_path / "eval" / "alpha.json"
    argv = ["--model", str(tiny_model_dir), "--data", str(data), "--template", TEMPLATE]
    argv += [
        "--options",
        '{"max_length":32,"stride":null}',
        "--site",
        "alpha",
        "--label",
        "aggregate",
        "--round",
        "2",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    assert all(os.environ[name] == "1" for name in OFFLINE_VARIABLES)
    result = json.loads(out.read_text())
    assert (result["site"], result["model"], result["round"]) == ("alpha", "aggregate", 2)
    assert result["stride"] == 32 and result["max_length"] == 32
    assert result["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    for key in ("perplexity", "nll", "bits_per_byte", "tokens", "bytes", "windows"):
        assert result[key] > 0, key
    assert main([*argv[:-1], str(tmp_path / "bad.json"), "--split", "nope"]) == 2


def test_one_load_scores_every_site_as_separate_runs_do(tiny_model_dir, raw_data, tmp_path, monkeypatch):
    """--sites: the workflow's one job per model; each site's result is what a run of its own gives."""
    from fedtune.core.offline import OFFLINE_VARIABLES
    from fedtune.evaluate import scores
    from fedtune.evaluate.scores import main

    for name in OFFLINE_VARIABLES:
        monkeypatch.setenv(name, "0")
    data, _ = raw_data
    common = [
        "--model",
        str(tiny_model_dir),
        "--options",
        '{"max_length":32}',
        "--label",
        "aggregate",
        "--round",
        "1",
    ]
    assert main([*common, "--data", str(data), "--site", "alpha", "--template", TEMPLATE,
                 "--out", str(tmp_path / "alone.json")]) == 0  # fmt: skip
    loads = []
    real_load = scores.load
    monkeypatch.setattr(scores, "load", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    sites = [
        {"site": "alpha", "data": str(data), "template": TEMPLATE, "out": str(tmp_path / "a" / "alpha.json")},
        {"site": "beta", "data": str(data), "out": str(tmp_path / "a" / "beta.json")},
    ]
    assert main([*common, "--sites", json.dumps(sites)]) == 0
    assert len(loads) == 1
    alone, together = (json.loads((tmp_path / p).read_text()) for p in ("alone.json", "a/alpha.json"))
    assert together["perplexity"] == alone["perplexity"] and together["site"] == "alpha"
    beta = json.loads((tmp_path / "a" / "beta.json").read_text())
    assert beta["site"] == "beta" and beta["template"] == "{text}"
    assert main([*common, "--sites", '[{"site": "x"}]']) == 2  # data and out missing: named


@pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None,
    reason="tensorboard missing: pip install -e '.[tracking]'",
)
def test_cli_sends_its_result_to_the_tracker(tiny_model_dir, raw_data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fedtune.evaluate.scores import main

    data, _ = raw_data
    out, tracked = tmp_path / "beta.json", tmp_path / "tracking"
    tracking = json.dumps({"backend": "tensorboard", "dir": str(tracked)})
    argv = [
        "--model",
        str(tiny_model_dir),
        "--data",
        str(data),
        "--options",
        '{"max_length":32}',
        "--site",
        "beta",
    ]
    argv += [
        "--label",
        "alpha",
        "--round",
        "1",
        "--out",
        str(out),
        "--tracking",
        tracking,
        "--run-name",
        "demo",
    ]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    events = EventAccumulator(str(tracked / "tensorboard" / "demo" / "round-1" / "alpha"))
    events.Reload()
    (point,) = events.Scalars("eval/beta/perplexity")
    assert point.step == 1 and point.value == pytest.approx(result["perplexity"], rel=1e-6)
    # A tracker that cannot work fails before any model loads, naming the option.
    assert main([*argv[:-4], "--out", str(tmp_path / "x.json"), "--tracking", "{", "--run-name", "demo"]) == 2
    assert not (tmp_path / "x.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_scores_like_cpu(model_and_tokenizer):
    import copy

    model, tokenizer = model_and_tokenizer
    ids = build_stream(corpus(40), tokenizer, TEMPLATE).ids
    cpu = score(model, ids, 32, 8, batch_size=5, device="cpu")
    gpu = score(copy.deepcopy(model).to("cuda"), ids, 32, 8, batch_size=5, device="cuda")
    assert gpu[1:] == cpu[1:]
    assert gpu[0] == pytest.approx(cpu[0], rel=1e-4)


def test_options_are_the_single_source_of_the_settings(tiny_model_dir, raw_data, tmp_path, monkeypatch):
    """--options carries every setting, the run's BOS choice included: the CLI scores as evaluate() does
    with the same options object, and add_bos false in it changes the stream."""
    from fedtune.core.offline import OFFLINE_VARIABLES
    from fedtune.evaluate.scores import main

    for name in OFFLINE_VARIABLES:
        monkeypatch.setenv(name, "0")
    data, _ = raw_data
    settings = options(max_length=32, stride=16, batch_size=2).for_run("causal-lm", False, block_size=64)
    assert settings.max_length == 32  # a language model keeps evaluate.max_length
    direct = evaluate(EvalJob(tiny_model_dir, data, template=TEMPLATE), settings)
    out = tmp_path / "alpha.json"
    argv = ["--model", str(tiny_model_dir), "--data", str(data), "--template", TEMPLATE, "--out", str(out)]
    assert main([*argv, "--options", settings.perplexity_json()]) == 0
    result = json.loads(out.read_text())
    assert result["add_bos"] is False and result["stride"] == 16 and result["batch_size"] == 2
    assert result["perplexity"] == direct["perplexity"] and result["tokens"] == direct["tokens"]
    with_bos = evaluate(EvalJob(tiny_model_dir, data, template=TEMPLATE), options(max_length=32, stride=16))
    assert with_bos["stream_tokens"] > result["stream_tokens"]
    # A classifier is cut where training cut it: tokenize.block_size, not evaluate.max_length.
    assert options(max_length=32).for_run("sequence-classification", True, block_size=64).max_length == 64
    assert main([*argv, "--options", '{"task":"nope"}']) == 2
