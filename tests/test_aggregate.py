"""fedavg: exact on identical inputs, equal to a hand-computed weighted mean otherwise (sharded and single
files, mixed dtypes), and refusing inputs or weights that do not make sense before writing anything."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fedtune.aggregate.merge import AggregateError, AggregateJob, aggregate, main, parse_size
from fedtune.aggregate.options import AggregateOptions
from fedtune.core.options import ConfigError

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8, "dtype": "float32"}
TOKENIZER = {
    "version": "1.0",
    "added_tokens": [],
    "model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []},
}


def options(**values) -> AggregateOptions:
    """Aggregate options as the config's section writes them (`lam` for its key lambda)."""
    if "lam" in values:
        values["lambda"] = values.pop("lam")
    return AggregateOptions.from_mapping(values)


def random_tensors(seed: int) -> dict[str, torch.Tensor]:
    """Llama-like names with the dtypes a real checkpoint mixes (norms kept in fp32, say)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(32, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g).to(torch.float16),
        "model.layers.0.input_layernorm.weight": torch.randn(8, generator=g),
        "model.norm.weight": torch.randn(8, generator=g),
        "lm_head.weight": torch.randn(32, 8, generator=g).to(torch.bfloat16),
    }


def write_checkpoint(
    folder: Path, tensors: dict[str, torch.Tensor], *, shards: int = 1, config=None, tokenizer=None
):
    """A save_pretrained-like folder: one model.safetensors, or `shards` files and an index."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config or CONFIG))
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer or TOKENIZER))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    if shards == 1:
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        return folder
    names = sorted(tensors)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::shards]}
        save_file(part, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def read_output(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        return load_file(folder / "model.safetensors")
    files = set(json.loads(index.read_text())["weight_map"].values())
    return {k: v for f in sorted(files) for k, v in load_file(folder / f).items()}


def write_manifest(path: Path, site: str, tokens_kept: int) -> Path:
    path.write_text(json.dumps({"site": site, "splits": {"train": {"tokens_kept": tokens_kept}, "test": {}}}))
    return path


def test_identical_models_give_that_model_bit_for_bit(tmp_path):
    tensors = random_tensors(0)
    models = {
        s: write_checkpoint(tmp_path / s, tensors, shards=2 if s == "b" else 1) for s in ("a", "b", "c")
    }
    record = aggregate(AggregateJob(models, tmp_path / "out"), options(weights={"a": 1, "b": 2.5, "c": 7}))
    merged = read_output(tmp_path / "out")
    assert merged.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert merged[name].dtype == tensor.dtype
        assert torch.equal(merged[name], tensor), name
    assert record["output"]["tensors"] == len(tensors)
    # Checksums are streamed from the merge's reads when a site's layout allows it, else re-read:
    # either way they are the files' real sha256.
    for entry in record["inputs"]:
        for name, file in entry["files"].items():
            real = hashlib.sha256((Path(entry["model_dir"]) / name).read_bytes()).hexdigest()
            assert file["sha256"] == real, (entry["site"], name)


def test_identical_hf_model_roundtrips_through_transformers(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    for site in ("alpha", "beta"):
        shutil.copytree(tiny_model_dir, tmp_path / site)
    out = tmp_path / "merged"
    record = aggregate(
        AggregateJob({"alpha": tmp_path / "alpha", "beta": tmp_path / "beta"}, out),
        options(weights="uniform", max_shard_size="100KB"),
    )
    # Tokenizer and config travel with the weights, so the merged folder is a complete model.
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).is_file(), name
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    merged = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert merged.keys() == original.keys()
    assert all(torch.equal(merged[k], original[k]) for k in original)
    assert record["warnings"] == ["sites alpha and beta have identical weights"]


def hand_mean(models: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
    total = sum(weights)
    return {
        name: sum(w * m[name].double() for m, w in zip(models, weights, strict=True)) / total
        for name in models[0]
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weighted_mean_matches_hand_computation(tmp_path, dtype):
    inputs = [random_tensors(seed) for seed in (1, 2, 3)]
    models = {
        "a": write_checkpoint(tmp_path / "a", inputs[0]),
        "b": write_checkpoint(tmp_path / "b", inputs[1], shards=3),
        "c": write_checkpoint(tmp_path / "c", inputs[2], shards=2),
    }
    aggregate(AggregateJob(models, tmp_path / "out"), options(weights={"a": 1, "b": 2, "c": 5}, dtype=dtype))
    merged = read_output(tmp_path / "out")
    expected = hand_mean(inputs, [1, 2, 5])
    for name, value in expected.items():
        assert merged[name].dtype == getattr(torch, dtype)
        if dtype == "float32":
            torch.testing.assert_close(merged[name].double(), value, rtol=1e-6, atol=1e-6)
        else:
            # fp32 mean then one rounding to bf16: at most one bf16 step from the exact mean.
            torch.testing.assert_close(merged[name].double(), value, rtol=2**-7, atol=1e-6)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == dtype


def test_token_weights_come_from_the_manifests(tmp_path):
    inputs = [random_tensors(seed) for seed in (4, 5)]
    models = {
        "a": write_checkpoint(tmp_path / "a", inputs[0]),
        "b": write_checkpoint(tmp_path / "b", inputs[1]),
    }
    manifests = {
        "a": write_manifest(tmp_path / "a.json", "a", 100),
        "b": write_manifest(tmp_path / "b.json", "b", 300),
    }
    record = aggregate(AggregateJob(models, tmp_path / "out", manifests=manifests), options(dtype="float32"))
    assert record["weights"] == {
        "source": "tokens",
        "raw": {"a": 100, "b": 300},
        "normalised": {"a": 0.25, "b": 0.75},
    }
    merged = read_output(tmp_path / "out")
    expected = hand_mean(inputs, [100, 300])
    for name, value in expected.items():
        torch.testing.assert_close(merged[name].double(), value, rtol=1e-6, atol=1e-6)


def test_output_shards_and_index_are_consistent(tmp_path):
    big = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(64, 64) for i in range(5)}
    big["model.norm.weight"] = torch.randn(64).to(torch.float16)
    models = {s: write_checkpoint(tmp_path / s, big) for s in ("a", "b")}
    record = aggregate(
        AggregateJob(models, tmp_path / "out"), options(weights="uniform", max_shard_size="40KB")
    )
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert set(index["weight_map"]) == set(big)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in big.values())
    for file in files:
        assert (out / file).stat().st_size <= 40_000 + 1_000  # data within the limit, plus the header
        with safe_open(out / file, framework="pt") as f:
            assert {index["weight_map"][k] for k in f.keys()} == {file}
    assert sorted(record["output"]["files"]) == files
    # Checksums in aggregate.json are the files' real sha256.
    for file, entry in record["output"]["files"].items():
        assert entry["sha256"] == hashlib.sha256((out / file).read_bytes()).hexdigest()
    entry = record["inputs"][0]["files"]["model.safetensors"]
    assert entry["sha256"] == hashlib.sha256((tmp_path / "a" / "model.safetensors").read_bytes()).hexdigest()
    assert (
        json.loads((out / "aggregate.json").read_text())["output"]["parameters"]
        == record["output"]["parameters"]
    )


def mismatch(tmp_path, **changes) -> str:
    tensors = random_tensors(0)
    write_checkpoint(tmp_path / "a", tensors)
    other = dict(tensors)
    other.update(changes.get("tensors", {}))
    for name in changes.get("drop", []):
        del other[name]
    write_checkpoint(tmp_path / "b", other, config=changes.get("config"), tokenizer=changes.get("tokenizer"))
    with pytest.raises(AggregateError) as error:
        aggregate(
            AggregateJob({"a": tmp_path / "a", "b": tmp_path / "b"}, tmp_path / "out"),
            options(weights="uniform"),
        )
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.tmp-*"))
    return str(error.value)


def test_refuses_different_tensor_names(tmp_path):
    message = mismatch(tmp_path, drop=["model.norm.weight"], tensors={"model.extra.weight": torch.zeros(2)})
    assert "tensor names differ" in message
    assert "model.norm.weight" in message and "model.extra.weight" in message


def test_refuses_different_shapes(tmp_path):
    message = mismatch(tmp_path, tensors={"model.norm.weight": torch.zeros(9)})
    assert "tensor shapes differ" in message and "model.norm.weight [9] vs [8]" in message


def test_refuses_different_dtypes(tmp_path):
    message = mismatch(tmp_path, tensors={"model.norm.weight": torch.zeros(8, dtype=torch.float16)})
    assert "tensor dtypes differ" in message and "model.norm.weight F16 vs F32" in message


def test_refuses_different_config_architecture(tmp_path):
    config = dict(CONFIG, architectures=["MistralForCausalLM"], model_type="mistral")
    message = mismatch(tmp_path, config=config)
    assert "config architecture differs" in message
    assert "MistralForCausalLM" in message and "model_type" in message


def test_refuses_different_tokenizer(tmp_path):
    tokenizer = json.loads(json.dumps(TOKENIZER))
    tokenizer["model"]["vocab"] = {"a": 1, "b": 0}
    message = mismatch(tmp_path, tokenizer=tokenizer)
    assert "tokenizer differs" in message and "vocabulary" in message


def test_lists_every_difference_at_once(tmp_path):
    message = mismatch(
        tmp_path,
        tensors={"model.norm.weight": torch.zeros(9)},
        config=dict(CONFIG, hidden_size=16),
        drop=["lm_head.weight"],
    )
    assert "tensor names" in message and "tensor shapes" in message and "hidden_size" in message


@pytest.mark.parametrize(
    ("weights", "expected"),
    [
        ({"a": 0, "b": 0}, "sum to zero"),
        ({"a": 1}, "missing: ['b']"),
        ({"a": 1, "b": 1, "c": 1}, "unknown: ['c']"),
        ("tokens", "needs --manifest"),
    ],
)
def test_refuses_bad_weights_before_reading_models(tmp_path, weights, expected):
    # The model folders do not exist: the weights must be rejected before they are even looked at.
    with pytest.raises(AggregateError, match="weights") as error:
        aggregate(
            AggregateJob({"a": tmp_path / "nope-a", "b": tmp_path / "nope-b"}, tmp_path / "out"),
            options(weights=weights),
        )
    assert expected in str(error.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("weights", "expected"),
    [
        ({"a": -1, "b": 2}, "less than the minimum"),
        ({"a": "x", "b": 1}, "is not of type 'number'"),
        ("biggest", "biggest"),
    ],
)
def test_weights_that_are_not_a_weighting_are_refused_by_the_options(weights, expected):
    with pytest.raises(ConfigError, match="aggregate.weights") as error:
        options(weights=weights)
    assert expected in str(error.value)


def test_refuses_zero_tokens_in_every_manifest(tmp_path):
    # A site's token count must be positive (issue 47): a zero is refused per site, before the sum.
    manifests = {s: write_manifest(tmp_path / f"{s}.json", s, 0) for s in ("a", "b")}
    with pytest.raises(
        AggregateError, match="site a: .*tokens_kept is 0; a site's token count must be positive"
    ):
        aggregate(
            AggregateJob({"a": tmp_path / "a", "b": tmp_path / "b"}, tmp_path / "out", manifests=manifests)
        )


def test_refuses_a_manifest_of_another_site(tmp_path):
    manifests = {
        "a": write_manifest(tmp_path / "a.json", "b", 5),
        "b": write_manifest(tmp_path / "b.json", "b", 5),
    }
    with pytest.raises(AggregateError, match="belongs to site 'b'"):
        aggregate(
            AggregateJob({"a": tmp_path / "a", "b": tmp_path / "b"}, tmp_path / "out", manifests=manifests)
        )


def test_refuses_the_same_folder_twice(tmp_path):
    write_checkpoint(tmp_path / "a", random_tensors(0))
    with pytest.raises(AggregateError, match="same model folder"):
        aggregate(
            AggregateJob({"a": tmp_path / "a", "b": tmp_path / "a" / "."}, tmp_path / "out"),
            options(weights="uniform"),
        )


def test_zero_weight_site_is_ignored(tmp_path):
    inputs = [random_tensors(seed) for seed in (6, 7)]
    models = {
        "a": write_checkpoint(tmp_path / "a", inputs[0]),
        "b": write_checkpoint(tmp_path / "b", inputs[1]),
    }
    aggregate(AggregateJob(models, tmp_path / "out"), options(weights={"a": 0, "b": 3}))
    merged = read_output(tmp_path / "out")
    assert all(torch.equal(merged[n], inputs[1][n]) for n in inputs[1])


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("1.5KB") == 1500
    with pytest.raises(AggregateError, match="max-shard-size"):
        parse_size("5 gigs")


def test_cli(tmp_path, capsys, monkeypatch):
    from fedtune.core.offline import OFFLINE_VARIABLES

    for name in OFFLINE_VARIABLES:  # main() sets them; monkeypatch restores them afterwards
        monkeypatch.setenv(name, "0")
    models = [write_checkpoint(tmp_path / s, random_tensors(i)) for i, s in enumerate(("a", "b"))]
    manifests = [write_manifest(tmp_path / f"{s}.json", s, 10) for s in ("a", "b")]
    argv = [
        "--out",
        str(tmp_path / "out"),
        "--model",
        f"a={models[0]}",
        f"b={models[1]}",
        "--options",
        options(dtype="float16").to_json(),
    ]
    argv += ["--manifest", f"a={manifests[0]}", f"b={manifests[1]}"]
    assert main(argv) == 0
    record = json.loads((tmp_path / "out" / "aggregate.json").read_text())
    assert record["weights"]["normalised"] == {"a": 0.5, "b": 0.5}
    assert {t.dtype for t in read_output(tmp_path / "out").values()} == {torch.float16}
    uniform = options(weights="uniform").to_json()
    assert main(["--out", str(tmp_path / "x"), "--model", "a", "--options", uniform]) == 2
    assert "fedtune.aggregate: error: --model: 'a' is not SITE=PATH" in capsys.readouterr().err
    assert main(["--out", str(tmp_path / "x"), "--model", "a=b", "--options", '{"method": "mean"}']) == 2
    assert "--options: aggregate.method: 'mean' is not one of" in capsys.readouterr().err


def test_write_error_stops_the_merge_and_leaves_nothing(tmp_path, monkeypatch):
    from fedtune.core import safetensors_stream as module

    big = {f"model.layers.{i}.weight": torch.randn(64, 64) for i in range(6)}
    models = {s: write_checkpoint(tmp_path / s, big) for s in ("a", "b")}

    def disk_full(self, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module.ShardWriter, "_put", disk_full)
    with pytest.raises(OSError, match="No space left"):
        aggregate(AggregateJob(models, tmp_path / "out"), options(weights="uniform", max_shard_size="20KB"))
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_refuses_a_site_trained_from_another_download_of_the_base(tmp_path):
    """Two clusters download the base separately (issue 37): a site whose round-1 model names another
    base than the start model (the downloaded base) is refused, both hashes named, before any write."""
    from fedtune.core.checksums import folder_digests, folder_identity

    tensors = random_tensors(0)
    start = write_checkpoint(tmp_path / "base", tensors)
    digests = folder_digests(start)
    here = {"identity": folder_identity(digests), "commit": "a" * 40}
    (start / "fedtune-source.json").write_text(json.dumps({"source": "hf", "file_sha256": digests, **here}))
    moved = {"identity": "f" * 64, "commit": "b" * 40}
    for site, base in (("a", here), ("b", moved)):
        write_checkpoint(tmp_path / site, tensors)
        (tmp_path / site / "training.json").write_text(json.dumps({"site": site, "round": 1, "base": base}))
    models = {"a": tmp_path / "a", "b": tmp_path / "b"}
    with pytest.raises(AggregateError) as error:
        aggregate(AggregateJob(models, tmp_path / "out", start=start), options(weights="uniform"))
    message = str(error.value)
    assert f"site b ({tmp_path / 'b'}): base {'f' * 64} (hub commit {'b' * 40})" in message, message
    assert f"the start model {start}: base {here['identity']} (hub commit {'a' * 40})" in message, message
    assert "site a" not in message and not (tmp_path / "out").exists()
    # The same base everywhere merges; so do folders that record none (a later round's models).
    (tmp_path / "b" / "training.json").write_text(json.dumps({"site": "b", "round": 1, "base": here}))
    aggregate(AggregateJob(models, tmp_path / "out", start=start), options(weights="uniform"))
    (tmp_path / "b" / "training.json").write_text(json.dumps({"site": "b", "round": 2, "base": None}))
    aggregate(AggregateJob(models, tmp_path / "out2", start=start), options(weights="uniform"))
