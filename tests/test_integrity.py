"""Weights are checked against the sizes and checksums their writer recorded: a corrupted or
truncated safetensors file is refused with its name, by every stage that reads it."""

from __future__ import annotations

import json
import shutil

import pytest

from fedtune.aggregate.merge import AggregateJob, aggregate
from fedtune.aggregate.options import AggregateOptions
from fedtune.core.models import CHECKSUMS, ModelError, load_causal_lm, verify_checksums

UNIFORM = AggregateOptions.from_mapping({"weights": "uniform"})


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    copy = tmp_path / "site"
    shutil.copytree(tiny_model_dir, copy)
    return copy


def flip_a_byte(path):
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    path.write_bytes(bytes(blob))


def test_save_model_records_each_weight_file(tiny_model_dir):
    record = json.loads((tiny_model_dir / CHECKSUMS).read_text())
    assert set(record) == {"model.safetensors"}
    assert record["model.safetensors"]["bytes"] == (tiny_model_dir / "model.safetensors").stat().st_size
    verify_checksums(tiny_model_dir)


def test_a_flipped_byte_is_refused_by_name(model_copy):
    flip_a_byte(model_copy / "model.safetensors")
    with pytest.raises(ModelError, match="model.safetensors: sha256 differs"):
        load_causal_lm(model_copy)


def test_a_truncated_file_is_refused_by_name(model_copy):
    weights = model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ModelError, match="model.safetensors: .* bytes, but .* were written: truncated"):
        load_causal_lm(model_copy)


def test_aggregate_checks_its_inputs_and_records_its_output(tiny_model_dir, model_copy, tmp_path):
    out = tmp_path / "merged"
    aggregate(AggregateJob({"a": tiny_model_dir, "b": model_copy}, out), UNIFORM)
    verify_checksums(out)
    assert json.loads((out / CHECKSUMS).read_text())["model.safetensors"]["bytes"] > 0

    flip_a_byte(model_copy / "model.safetensors")
    with pytest.raises(ModelError, match=f"{model_copy}/model.safetensors: sha256 differs"):
        aggregate(AggregateJob({"a": tiny_model_dir, "b": model_copy}, tmp_path / "merged-2"), UNIFORM)
    assert not (tmp_path / "merged-2").exists()
