"""tokenize: packing and padding give the blocks a hand computation gives, shards partition the
documents, counts and manifests add up, corruption is caught, and the stage never goes online."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from datasets import Dataset, DatasetDict, load_from_disk

from fedtune.core.models import load_tokenizer
from fedtune.tokenize.options import TokenizeOptions
from fedtune.tokenize.shards import (
    ShardJob,
    TokenizeError,
    main,
    tokenize_shard,
    verify_shard,
    write_manifest,
)

from .conftest import ROOT, corpus

TEMPLATE = "Doc: {text}"


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    texts = corpus(60) + ["word " * 200]  # one document longer than any block, to test truncation
    path = tmp_path_factory.mktemp("raw") / "raw"
    DatasetDict(
        {"train": Dataset.from_dict({"text": texts}), "test": Dataset.from_dict({"text": texts[:9]})}
    ).save_to_disk(str(path))
    return path, texts


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def by_hand(texts, tokenizer, template=TEMPLATE):
    """Each document as [BOS] ids [EOS], tokenized one by one through the high-level API."""
    return [
        [tokenizer.bos_token_id] + tokenizer(template.format(text=t), add_special_tokens=False)["input_ids"]
        + [tokenizer.eos_token_id]
        for t in texts
    ]  # fmt: skip


def shard(raw_path, tiny_model_dir, out, **kwargs):
    options = dict(template=TEMPLATE, block_size=32, mode="packing")
    options.update(kwargs)
    options["shards"] = options.pop("num_shards", 1)
    index = options.pop("index", 0)
    split = options.pop("split", "train")
    site = options.pop("site", None)
    counts = tokenize_shard(
        ShardJob(raw_path, split, index, tiny_model_dir, out, site=site),
        TokenizeOptions.from_mapping(options),
    )
    return counts, load_from_disk(str(out))


def test_packing_matches_a_hand_computation(raw, tokenizer, tiny_model_dir, tmp_path):
    raw_path, texts = raw
    counts, data = shard(raw_path, tiny_model_dir, tmp_path / "s", mode="packing")
    stream = [t for doc in by_hand(texts, tokenizer) for t in doc]
    n_blocks = len(stream) // 32
    expected = np.array(stream[: n_blocks * 32]).reshape(n_blocks, 32)
    assert np.array_equal(np.array(data["input_ids"]), expected)
    assert np.array_equal(np.array(data["labels"]), expected)
    assert counts["tokens"] == len(stream)
    assert counts["blocks"] == n_blocks == len(data)
    assert counts["tokens_kept"] == n_blocks * 32
    assert counts["tokens_dropped"] == len(stream) % 32
    assert counts["documents"] == len(texts)
    assert counts["bytes"] == sum(len(TEMPLATE.format(text=t).encode()) for t in texts)


def test_padding_matches_a_hand_computation(raw, tokenizer, tiny_model_dir, tmp_path):
    raw_path, texts = raw
    counts, data = shard(raw_path, tiny_model_dir, tmp_path / "s", mode="padding")
    docs = by_hand(texts, tokenizer)
    pad = tokenizer.pad_token_id
    assert len(data) == len(texts) == counts["blocks"]
    for row, doc in zip(data, docs, strict=True):
        kept = doc[:32]
        assert row["input_ids"] == kept + [pad] * (32 - len(kept))
        assert row["labels"] == kept + [-100] * (32 - len(kept))
    assert counts["tokens"] == sum(map(len, docs))
    assert counts["tokens_kept"] == sum(min(len(d), 32) for d in docs)
    assert counts["tokens_dropped"] > 0  # the long document was truncated
    assert counts["tokens_kept"] == int((np.array(data["labels"]) != -100).sum())


def test_no_bos_and_the_template_reach_the_tokens(raw, tokenizer, tiny_model_dir, tmp_path):
    raw_path, texts = raw
    _, data = shard(
        raw_path, tiny_model_dir, tmp_path / "s", mode="padding", add_bos=False, template="{text}"
    )
    short = min(range(len(texts)), key=lambda i: len(texts[i]))
    ids = tokenizer(texts[short], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert len(ids) < 32
    assert data[short]["input_ids"][: len(ids) + 1] == ids + [tokenizer.pad_token_id]


@pytest.mark.parametrize("mode", ["packing", "padding"])
def test_shards_partition_the_documents(raw, tiny_model_dir, tmp_path, mode):
    raw_path, texts = raw
    one, one_data = shard(raw_path, tiny_model_dir, tmp_path / "one", mode=mode)
    parts = [
        shard(raw_path, tiny_model_dir, tmp_path / f"part-{k}", mode=mode, num_shards=3, index=k)
        for k in range(3)
    ]
    for key in ("documents", "tokens", "bytes"):
        assert sum(counts[key] for counts, _ in parts) == one[key], key
    if mode == "padding":
        # One block per document, in document order: the shards together are the unsharded result.
        together = [row for _, data in parts for row in data["input_ids"]]
        assert together == one_data["input_ids"]


def test_counts_checksums_catch_corruption(raw, tiny_model_dir, tmp_path):
    counts, data = shard(raw[0], tiny_model_dir, tmp_path / "s")
    assert verify_shard(tmp_path / "s")["blocks"] == len(data)
    arrow = next((tmp_path / "s").glob("*.arrow"))
    assert counts["files"][arrow.name]["bytes"] == arrow.stat().st_size
    blob = bytearray(arrow.read_bytes())
    blob[-100] ^= 0xFF
    arrow.write_bytes(bytes(blob))
    with pytest.raises(TokenizeError, match=f"{arrow.name}: missing or corrupted"):
        verify_shard(tmp_path / "s")
    (tmp_path / "s" / "counts.json").unlink()
    with pytest.raises(TokenizeError, match="no counts.json: the shard is incomplete"):
        verify_shard(tmp_path / "s")


def test_manifest_sums_each_split_and_requires_every_shard(raw, tiny_model_dir, tmp_path):
    site = tmp_path / "site"
    results = []
    for split in ("train", "test"):
        for k in range(2):
            out = site / split / f"shard-{k}"
            results.append(
                shard(raw[0], tiny_model_dir, out, split=split, num_shards=2, index=k, site="alpha")[0]
            )
    dirs = [site / s / f"shard-{k}" for s in ("train", "test") for k in range(2)]
    manifest = write_manifest(dirs, site / "manifest.json")
    assert json.loads((site / "manifest.json").read_text()) == manifest
    assert manifest["site"] == "alpha"
    train = manifest["splits"]["train"]
    assert train["tokens_kept"] == sum(c["tokens_kept"] for c in results if c["split"] == "train")
    assert train["documents"] == len(raw[1])
    assert train["shards"] == ["train/shard-0", "train/shard-1"]
    with pytest.raises(TokenizeError, match="split test lacks shards \\[1\\]"):
        write_manifest(dirs[:3], tmp_path / "m.json")
    with pytest.raises(TokenizeError, match="given twice"):
        write_manifest(dirs + dirs[:1], tmp_path / "m.json")


def run_cli(capsys, *args):
    code = main(list(map(str, args)))
    return code, capsys.readouterr().err


def test_cli_errors_name_the_option_and_write_nothing(raw, tiny_model_dir, tmp_path, capsys):
    base = ["shard", "--raw", raw[0], "--split", "train", "--shard", 0,
            "--tokenizer", tiny_model_dir, "--out", tmp_path / "out"]  # fmt: skip

    def options(**values):
        return ["--options", json.dumps({"shards": 1, **values})]

    code, err = run_cli(capsys, *base, *options(block_size=1024))
    assert code == 2 and "--options: block_size: 1024 exceeds the model's maximum positions (256)" in err
    assert err.startswith("fedtune.tokenize: error:") and "config.json" in err
    code, err = run_cli(capsys, *base, *options(text_field="body"))
    assert code == 2 and "--options: text_field: 'body' is not a column" in err
    code, err = run_cli(capsys, *base[:4], "validation", *base[5:], *options())
    assert code == 2 and "has no split 'validation'" in err
    code, err = run_cli(capsys, *base, *options(template="no placeholder"))
    assert code == 2 and "--options: template" in err and "does not contain {text}" in err
    code, err = run_cli(capsys, *base, *options(shards=0))
    assert code == 2 and "--options: shards: 0 is less than the minimum of 1" in err
    assert not (tmp_path / "out").exists()


GUARD = textwrap.dedent(
    """
    import runpy, socket, sys
    def refuse(*args, **kwargs):
        print("NETWORK ATTEMPT", args, file=sys.stderr)
        raise OSError("network refused by the test")
    socket.socket.connect = refuse
    socket.create_connection = refuse
    sys.argv = ["fedtune.tokenize.shards"] + sys.argv[1:]
    runpy.run_module("fedtune.tokenize.shards", run_name="__main__")
    """
)


def test_the_stage_never_opens_a_connection(raw, tmp_path):
    # A tokenizer named like a hub id: online code would try to fetch it. The stage must refuse
    # without trying, even though this environment does not set the offline variables itself.
    env = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE")}
    result = subprocess.run(
        [sys.executable, "-c", GUARD, "shard", "--raw", str(raw[0]), "--split", "train", "--shard", "0",
         "--options", '{"shards": 1}', "--tokenizer", "someone/some-model", "--out", str(tmp_path / "out")],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "NETWORK ATTEMPT" not in result.stderr
    assert "offline" in result.stderr.lower()
