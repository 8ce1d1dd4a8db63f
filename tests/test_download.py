"""download: every dataset and model source kind, on local files (no network here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from datasets import load_from_disk

from fedtune.core.models import ModelError, load_causal_lm, load_tokenizer
from fedtune.core.options import ConfigError, UserError
from fedtune.download.fetch import DownloadError, download_data, download_model
from fedtune.download.options import DatasetOptions, ModelOptions

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from hub_download import hub_cache  # noqa: E402


def write_jsonl(path, texts, field="text"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: t, "label": i % 3}) + "\n" for i, t in enumerate(texts)))
    return path


@pytest.fixture
def files(tmp_path):
    train = write_jsonl(tmp_path / "src" / "train.jsonl", [f"train document {i}" for i in range(30)])
    test = write_jsonl(tmp_path / "src" / "test.jsonl", [f"test document {i}" for i in range(7)])
    return train, test


def test_local_files_become_train_and_test_splits(files, tmp_path):
    train, test = files
    out = tmp_path / "raw"
    spec = {"source": "local", "data_files": {"train": str(train), "test": str(test)}}
    assert download_data(DatasetOptions.from_mapping(spec), out) == {"train": 30, "test": 7}
    saved = load_from_disk(str(out))
    assert saved["train"][0]["text"] == "train document 0"
    assert saved["test"]["text"][-1] == "test document 6"
    # Other columns are kept: the classification task reads its labels from them.
    assert "label" in saved["train"].column_names


def test_max_documents_keeps_the_first_ones(files, tmp_path):
    train, test = files
    spec = {"source": "local", "data_files": {"train": str(train), "test": str(test)}, "max_documents": 5}
    download_data(DatasetOptions.from_mapping(spec), tmp_path / "raw")
    saved = load_from_disk(str(tmp_path / "raw"))
    assert saved["train"]["text"] == [f"train document {i}" for i in range(5)]
    assert len(saved["test"]) == 5


def test_text_files_and_a_carved_test_split(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i}\n" for i in range(100)))
    spec = {"source": "local", "data_files": {"train": str(text)}, "test_fraction": 0.1}
    assert download_data(DatasetOptions.from_mapping(spec), tmp_path / "raw") == {"train": 90, "test": 10}
    saved = load_from_disk(str(tmp_path / "raw"))
    assert set(saved["train"]["text"]).isdisjoint(saved["test"]["text"])
    assert len(set(saved["train"]["text"]) | set(saved["test"]["text"])) == 100


def test_hf_source_loads_a_dataset_folder_by_name(files, tmp_path):
    # The hub branch calls load_dataset(name, config, revision); a local dataset folder is a valid name,
    # which exercises the same code with no network.
    spec = {"source": "hf", "name": str(files[0].parent), "splits": {"train": "train", "test": "test"}}
    assert download_data(DatasetOptions.from_mapping(spec), tmp_path / "raw") == {"train": 30, "test": 7}


def test_hf_source_with_a_missing_split_names_it(files, tmp_path):
    spec = {"source": "hf", "name": str(files[0].parent), "splits": {"train": "train", "test": "validation"}}
    with pytest.raises(DownloadError, match="'validation'.*has \\['test', 'train'\\]"):
        download_data(DatasetOptions.from_mapping(spec), tmp_path / "raw")
    assert not (tmp_path / "raw").exists()


def test_missing_text_field_names_the_column(files, tmp_path):
    spec = {"source": "local", "data_files": {"train": str(files[0])}, "text_field": "content"}
    with pytest.raises(DownloadError, match="'content' is not a column.*\\['text', 'label'\\]"):
        download_data(DatasetOptions.from_mapping(spec), tmp_path / "raw")


def test_empty_dataset_is_refused(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    other = tmp_path / "other.txt"
    other.write_text("one line\n")
    spec = {"source": "local", "data_files": {"train": str(other), "test": str(empty)}}
    with pytest.raises(
        DownloadError, match="data_files.test: .*empty.txt is empty: the test split holds no documents"
    ):
        download_data(DatasetOptions.from_mapping(spec), tmp_path / "raw")


def test_missing_file_and_bad_spec_are_named(tmp_path):
    with pytest.raises(
        ConfigError, match="--options: dataset.data_files.train: file not found: .*nope.jsonl"
    ):
        download_data(
            DatasetOptions.from_mapping(
                {"source": "local", "data_files": {"train": str(tmp_path / "nope.jsonl")}}
            ),
            tmp_path / "r",
        )
    with pytest.raises(ConfigError, match="dataset.max_documents"):
        download_data(
            DatasetOptions.from_mapping(
                {"source": "local", "data_files": {"train": "x"}, "max_documents": 0}
            ),
            tmp_path / "r",
        )


def test_download_failure_keeps_the_previous_output(files, tmp_path):
    out = tmp_path / "raw"
    download_data(
        DatasetOptions.from_mapping({"source": "local", "data_files": {"train": str(files[0])}}), out
    )
    with pytest.raises(DownloadError):
        download_data(
            DatasetOptions.from_mapping(
                {"source": "local", "data_files": {"train": str(files[0])}, "text_field": "x"}
            ),
            out,
        )
    assert len(load_from_disk(str(out))["train"]) + len(load_from_disk(str(out))["test"]) == 30
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".raw")] == []


ARCH = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "max_position_embeddings": 64}  # fmt: skip


def test_init_model_trains_a_tokenizer_on_the_templated_site_text(files, tmp_path):
    raw = tmp_path / "raw"
    download_data(
        DatasetOptions.from_mapping({"source": "local", "data_files": {"train": str(files[0])}}), raw
    )
    out = tmp_path / "base"
    spec = {"source": "init", "architecture": ARCH, "tokenizer": {"vocab_size": 300, "min_frequency": 1}}
    corpora = [{"path": str(raw), "text_field": "text", "template": "Zqx: {text}"}]
    download_model(ModelOptions.from_mapping(spec), out, corpora)
    tokenizer = load_tokenizer(out)
    model = load_causal_lm(out)
    assert model.config.vocab_size == len(tokenizer) <= 300
    assert model.config.eos_token_id == tokenizer.eos_token_id is not None
    # The template's rare prefix was part of the training text, so BPE learned a merge for it.
    assert len(tokenizer("Zqx:", add_special_tokens=False)["input_ids"]) < 4
    record = json.loads((out / "fedtune-source.json").read_text())
    assert record["source"] == "init" and record["documents"] == 28  # 30 minus the carved test split
    assert oct((out / "model.safetensors").stat().st_mode & 0o777) == "0o644"


def test_local_model_is_validated_and_copied(tiny_model_dir, tmp_path):
    out = tmp_path / "base"
    download_model(ModelOptions.from_mapping({"source": "local", "path": str(tiny_model_dir)}), out)
    assert (out / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
    assert load_causal_lm(out).config.num_hidden_layers == 2


def test_a_local_model_from_another_run_shares_no_tool_marker_with_it(tiny_model_dir, tmp_path):
    """model.source local pointing into another run's results (issue 37): the model's files are linked,
    Snakemake's marker of that run's directory output is not, so the new run touching its own marker
    leaves the source run's untouched (and with it that run's "Nothing to be done")."""
    import os
    import shutil

    source = tmp_path / "results" / "first" / "model" / "base"
    shutil.copytree(tiny_model_dir, source)
    marker = source / ".snakemake_timestamp"
    marker.touch()
    os.utime(marker, ns=(1_000_000_000, 1_000_000_000))
    before = marker.stat()
    out = tmp_path / "results" / "second" / "model" / "base"
    download_model(ModelOptions.from_mapping({"source": "local", "path": str(source)}), out)
    assert not (out / ".snakemake_timestamp").exists()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]
    assert {p.name for p in source.iterdir()} - {p.name for p in out.iterdir()} == {".snakemake_timestamp"}
    (out / ".snakemake_timestamp").touch()  # what Snakemake does when the download job ends
    after = marker.stat()
    assert (after.st_ino, after.st_nlink, after.st_mtime_ns) == (before.st_ino, 1, before.st_mtime_ns)
    # The model's own files still come over, linked where the file system allows it.
    assert (out / "model.safetensors").stat().st_ino == (source / "model.safetensors").stat().st_ino


@pytest.fixture
def offline_hub(tiny_model_dir, tmp_path, monkeypatch):
    """The tiny model as the hub model fedtune-test/tiny at a pinned commit, served offline from a local
    cache; instantiating any transformers model meanwhile fails the test."""
    import huggingface_hub.constants
    import transformers.modeling_utils

    revision = "0123456789abcdef0123456789abcdef01234567"
    cache = hub_cache(tmp_path / "hub", tiny_model_dir, "fedtune-test/tiny", revision)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def no_model(self, *args, **kwargs):
        raise AssertionError(f"the download instantiated {type(self).__name__}")

    monkeypatch.setattr(transformers.modeling_utils.PreTrainedModel, "__init__", no_model)
    return revision


def test_hf_model_is_fetched_as_files_without_loading_it(offline_hub, tiny_model_dir, tmp_path, monkeypatch):
    """model.source hf on a login node: the safetensors, config and tokenizer files of the pinned revision,
    checked by their headers, never a model in memory; the dtype is converted where they are loaded."""
    out = tmp_path / "base"
    spec = {"source": "hf", "name": "fedtune-test/tiny", "revision": offline_hub, "dtype": "bfloat16"}
    download_model(ModelOptions.from_mapping(spec), out)
    assert (out / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
    assert {"config.json", "tokenizer.json", "fedtune-checksums.json"} <= {p.name for p in out.iterdir()}
    record = json.loads((out / "fedtune-source.json").read_text())
    assert record["name"] == "fedtune-test/tiny" and record["revision"] == offline_hub, record
    assert record["snapshot"] == offline_hub and record["checkpoint_dtypes"] == {"F32": 21}, record
    monkeypatch.undo()  # models may be built again
    import torch

    assert next(load_causal_lm(out, dtype="bfloat16").parameters()).dtype == torch.bfloat16
    assert next(load_causal_lm(out).parameters()).dtype == torch.float32


def test_a_hub_download_at_a_branch_pins_the_commit_and_every_files_sha256(offline_hub, tmp_path):
    """model.revision main (a branch): the record says which commit the hub resolved it to, and the
    sha256 of every file with one hash of them all, the base's identity that training carries on."""
    from fedtune.core.checksums import folder_identity, sha256_file

    out = tmp_path / "base"
    download_model(ModelOptions.from_mapping({"source": "hf", "name": "fedtune-test/tiny"}), out)
    record = json.loads((out / "fedtune-source.json").read_text())
    assert record["revision"] == "main" and record["commit"] == offline_hub, record
    files = {p.name for p in out.iterdir() if p.name != "fedtune-source.json"}
    assert set(record["file_sha256"]) == files and "model.safetensors" in files
    assert all(record["file_sha256"][name] == sha256_file(out / name) for name in files)
    assert record["identity"] == folder_identity(record["file_sha256"])


def test_a_branch_revision_is_named_with_a_commit_to_pin(offline_hub, tmp_path):
    from fedtune.download.hub_model import revision_advice

    def advice(revision, base=tmp_path / "none"):
        return revision_advice(
            ModelOptions.from_mapping({"source": "hf", "name": "fedtune-test/tiny", **revision}), base
        )

    # The branch as this machine's hub cache resolved it, when no download recorded one yet.
    assert "model.revision 'main' is a branch or tag" in advice({})
    assert f"model.revision: {offline_hub} (what main pointed to" in advice({"revision": "main"})
    assert "huggingface.co/fedtune-test/tiny/commits/v2" in advice({"revision": "v2"})
    assert advice({"revision": offline_hub}) is None
    # The commit this run's base was downloaded at, when there is one.
    base = tmp_path / "base"
    base.mkdir()
    (base / "fedtune-source.json").write_text(json.dumps({"commit": "c" * 40}))
    assert f"model.revision: {'c' * 40} (what {base} was downloaded at)" in advice({}, base)


def test_the_dry_run_warns_about_a_branch_revision(tmp_path, offline_hub, monkeypatch):
    """At parse time, on stderr: the dry run of a config naming a hub model by a branch."""
    import huggingface_hub.constants

    from .workflow_harness import demo_config, snakemake, write_config

    config = demo_config()
    config["model"] = {"source": "hf", "name": "fedtune-test/tiny", "revision": "main", "dtype": "float32"}
    write_config(tmp_path, config)
    monkeypatch.setenv("HF_HUB_CACHE", huggingface_hub.constants.HF_HUB_CACHE)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = snakemake(tmp_path, "-n", "results/demo/data/alpha/manifest.json")
    assert "fedtune: warning: model.revision 'main' is a branch or tag" in result.stderr, result.stderr
    assert f"model.revision: {offline_hub}" in result.stderr
    config["model"]["revision"] = offline_hub
    write_config(tmp_path, config)
    result = snakemake(tmp_path, "-n", "results/demo/data/alpha/manifest.json")
    assert "model.revision" not in result.stderr, result.stderr


def test_a_truncated_hub_download_is_refused_by_name(offline_hub, tmp_path):
    import huggingface_hub.constants

    snapshot = (
        Path(huggingface_hub.constants.HF_HUB_CACHE) / "models--fedtune-test--tiny/snapshots" / offline_hub
    )
    weights = snapshot / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    spec = {"source": "hf", "name": "fedtune-test/tiny", "revision": offline_hub}
    with pytest.raises(UserError, match=r"fedtune-test/tiny@0123.*model.safetensors is \d+ bytes.*truncated"):
        download_model(ModelOptions.from_mapping(spec), tmp_path / "base")
    assert not (tmp_path / "base").exists()


def test_pickle_only_model_is_refused_unless_allowed(tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(ModelError, match="only pickle weights.*allow_pickle"):
        download_model(ModelOptions.from_mapping({"source": "local", "path": str(folder)}), tmp_path / "base")
    assert not (tmp_path / "base").exists()


def test_a_local_dataset_folder_is_read_afresh_after_its_files_change(tmp_path, monkeypatch):
    """datasets caches a folder with `configs:` in its README by folder and config name only; the
    download stage must not hand back the rows of an earlier version of the files."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "reviews"
    (folder / "data").mkdir(parents=True)
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: tiny\n  data_files:\n  - split: train\n    path: data/train.jsonl\n"
        "  - split: test\n    path: data/test.jsonl\n---\n"
    )
    spec = {"source": "hf", "name": str(folder), "config": "tiny"}
    for version in ("old", "new"):
        for split in ("train", "test"):
            (folder / "data" / f"{split}.jsonl").write_text(f'{{"text": "{version} {split}"}}\n')
        download_data(DatasetOptions.from_mapping(spec), tmp_path / version)
        assert load_from_disk(str(tmp_path / version))["train"]["text"] == [f"{version} train"]


def write_formats(folder: Path, rows: int) -> dict[str, Path]:
    """The same documents (text, an int label, a float with gaps) as json lines, text, csv and parquet."""
    import pandas as pd

    folder.mkdir(parents=True, exist_ok=True)
    table = pd.DataFrame(
        {
            "text": [f"document {i} " + "word " * (i % 7) for i in range(rows)],
            "label": [i % 3 for i in range(rows)],
            "score": [None if i % 5 == 0 else i / 2 for i in range(rows)],
        }
    )
    paths = {
        f: folder / f"docs.{s}"
        for f, s in [("json", "jsonl"), ("text", "txt"), ("csv", "csv"), ("parquet", "parquet")]
    }
    table.to_json(paths["json"], orient="records", lines=True)
    paths["text"].write_text("".join(t + "\n" for t in table["text"]))
    table.to_csv(paths["csv"], index=False)
    table.to_parquet(paths["parquet"], row_group_size=700)
    return paths


def whole_then_cut(options: DatasetOptions):
    """What the download kept before it streamed: the data set read whole, carved, then each split cut to
    its first max_documents."""
    import dataclasses

    from fedtune.download.fetch import load_splits

    whole = load_splits(dataclasses.replace(options, max_documents=None))
    return {split: data.select(range(min(len(data), options.max_documents))) for split, data in whole.items()}


@pytest.mark.parametrize("fmt", ["json", "text", "csv", "parquet"])
def test_a_streamed_cut_keeps_the_same_documents_in_the_same_order(fmt, tmp_path, monkeypatch):
    """max_documents streams the data set; the documents kept, their order, their columns and the carved
    test split are those of reading it whole (two files of 3,000 rows, Arrow batches of 1,000)."""
    from fedtune.download.fetch import load_splits

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path = str(write_formats(tmp_path / "src", 3000)[fmt])
    other = str(write_formats(tmp_path / "other", 3000)[fmt])
    cases = [
        ({"train": [path, other], "test": path}, 1234, 0.05),  # given test files
        ({"train": path}, 40, 0.05),  # carved, cut to a few
        ({"train": [path, other]}, 2500, 0.3),  # carved, the test split cut too
        ({"train": path}, 5000, 0.2),  # more than there is
    ]
    for files, count, fraction in cases:
        spec = {
            "source": "local",
            "data_files": files,
            "max_documents": count,
            "test_fraction": fraction,
            "seed": 7,
        }
        options = DatasetOptions.from_mapping(spec)
        expected = whole_then_cut(options)
        for keep in [("train", "test"), ("test",)]:
            streamed = load_splits(options, keep=keep)
            assert list(streamed) == list(keep)
            for split in keep:
                assert streamed[split].features == expected[split].features, (spec, split)
                assert streamed[split].to_list() == expected[split].to_list(), (spec, split)


def test_the_download_reads_only_the_documents_it_keeps(tmp_path, monkeypatch):
    """2,000 documents kept of a 12 MB file whose last line is broken: the streamed download reads its
    first block and stops, never reaching the broken line (reading the file whole fails on it), and
    leaves no Arrow copy of the whole file in the datasets cache."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    source = tmp_path / "big.jsonl"
    line = json.dumps({"text": "filler " * 60}) + "\n"
    with source.open("w") as f:
        f.writelines(json.dumps({"text": f"kept {i}"}) + "\n" for i in range(2000))
        f.writelines([line] * (12_000_000 // len(line)))
        f.write('{"text": "broken\n')
    spec = {
        "source": "local",
        "data_files": {"train": str(source), "test": str(source)},
        "max_documents": 2000,
    }
    assert download_data(DatasetOptions.from_mapping(spec), tmp_path / "raw") == {"train": 2000, "test": 2000}
    assert load_from_disk(str(tmp_path / "raw"))["train"]["text"] == [f"kept {i}" for i in range(2000)]
    assert sum(p.stat().st_size for p in cache.rglob("*") if p.is_file()) < 1_000_000
    # Read whole, the broken line is named (issue 47: one line naming the file and the line).
    broken = 2000 + 12_000_000 // len(line) + 1
    with pytest.raises(ConfigError, match=rf"big\.jsonl: line {broken}: not valid JSON"):
        download_data(DatasetOptions.from_mapping({**spec, "max_documents": None}), tmp_path / "whole")


def test_a_cluster_that_only_evaluates_a_site_reads_its_test_split_only(tmp_path, monkeypatch):
    """--splits test (the aggregating cluster, for another cluster's site): the train split is not read at
    all (here it is unreadable), and the saved folder holds the test split alone."""
    from fedtune.download.fetch import main

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "hub-like"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"text": "unreadable\n')
    write_jsonl(folder / "test.jsonl", [f"test document {i}" for i in range(7)])
    spec = {"source": "hf", "name": str(folder), "max_documents": 5}
    assert (
        main(["data", "--options", json.dumps(spec), "--splits", "test", "--out", str(tmp_path / "raw")]) == 0
    )
    saved = load_from_disk(str(tmp_path / "raw"))
    assert list(saved) == ["test"] and saved["test"]["text"] == [f"test document {i}" for i in range(5)]


def test_a_streamed_data_download_does_not_load_torch(files, tmp_path):
    """datasets would make the stream a torch IterableDataset, importing torch (200 MB, seconds) into the
    download job, which never uses it: the data command turns that off."""
    spec = {"source": "local", "data_files": {"train": str(files[0])}, "max_documents": 3}
    script = (
        "import sys\nfrom fedtune.download.fetch import main\n"
        f"assert main(['data', '--options', {json.dumps(spec)!r}, '--out', {str(tmp_path / 'raw')!r}]) == 0\n"
        "print('torch' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "USE_TORCH"}
    env["HF_DATASETS_CACHE"] = str(tmp_path / "cache")
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip().splitlines()[-1] == "False", result.stderr[-2000:]


def test_a_streamed_hub_data_set_keeps_its_declared_features(tmp_path, monkeypatch):
    """A hub data set's card declares its features (a ClassLabel here): the streamed cut keeps them, and
    the documents, as reading it whole does (a local folder stands in for the hub, as above)."""
    import dataclasses

    from fedtune.download.fetch import load_splits

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "reviews"
    (folder / "data").mkdir(parents=True)
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: tiny\n  data_files:\n  - split: train\n    path: data/train.jsonl\n"
        "  - split: validation\n    path: data/valid.jsonl\ndataset_info:\n  config_name: tiny\n  features:\n"
        "  - name: text\n    dtype: string\n  - name: label\n    dtype:\n      class_label:\n        names:\n"
        "          '0': neg\n          '1': pos\n---\n"
    )
    for split, count in (("train", 3000), ("valid", 500)):
        rows = [json.dumps({"text": f"{split} {i}", "label": i % 2}) + "\n" for i in range(count)]
        (folder / "data" / f"{split}.jsonl").write_text("".join(rows))
    spec = {
        "source": "hf",
        "name": str(folder),
        "config": "tiny",
        "splits": {"train": "train", "test": "validation"},
    }
    options = DatasetOptions.from_mapping({**spec, "max_documents": 300})
    streamed = load_splits(options)
    whole = load_splits(dataclasses.replace(options, max_documents=None))
    for split in ("train", "test"):
        assert streamed[split].features["label"].names == ["neg", "pos"]
        assert streamed[split].features == whole[split].features
        assert streamed[split].to_list() == whole[split].select(range(300)).to_list()


# A script-based hub data set (issue 50): gsarti/clean_mc4_it, as the hub holds it (read 2026-11-28 in the
# hub's file pages: a loading script clean_mc4_it.py at the root, the data in clean-mc4-it/, 1024 train
# shards c4-it.tfrecord-NNNNN-of-01024.json.gz and 8 validation shards c4-it-validation.tfrecord-NNNNN-
# of-00008.json.gz), mirrored in a local folder with a few small shards.

EXAMPLE = Path(__file__).resolve().parent.parent / "config" / "examples" / "llama2-it-cs.yaml"


def mc4_it_mirror(root: Path) -> Path:
    """A folder laid out like the hub repository gsarti/clean_mc4_it: the script, and shards whose rows
    say where they come from. Train shards 00000, 00001 and 00099 are in the tiny config's first 100,
    00100 is not; validation shard 00000 is tiny's, 00001 is not."""
    import gzip

    folder = root / "clean_mc4_it"
    (folder / "clean-mc4-it").mkdir(parents=True)
    (folder / "clean_mc4_it.py").write_text("import datasets  # a loading script, as on the hub\n")
    (folder / "README.md").write_text("---\npretty_name: mC4_it\n---\n# Clean Italian mC4\n")
    shards = [f"c4-it.tfrecord-{i:05d}-of-01024.json.gz" for i in (0, 1, 99, 100)]
    shards += [f"c4-it-validation.tfrecord-{i:05d}-of-00008.json.gz" for i in (0, 1)]
    for shard in shards:
        rows = [{"text": f"{shard} documento {i}", "url": "u", "timestamp": "t"} for i in range(3)]
        lines = "".join(json.dumps(row) + "\n" for row in rows)
        (folder / "clean-mc4-it" / shard).write_bytes(gzip.compress(lines.encode()))
    return folder


def test_a_script_based_data_set_without_a_parquet_export_asks_for_its_data_files(tmp_path, monkeypatch):
    """datasets 5 refuses the loading script; where the hub has no Parquet export of the config either,
    the download stops with a DownloadError that says so and names the repository's data files."""
    import fedtune.download.fetch as fetch

    folder = mc4_it_mirror(tmp_path)
    monkeypatch.setattr(fetch, "PARQUET_EXPORT", str(tmp_path / "no-export" / "{name}"))
    spec = {
        "source": "hf",
        "name": str(folder),
        "config": "tiny",
        "splits": {"train": "train", "test": "validation"},
    }
    with pytest.raises(DownloadError) as refused:
        download_data(DatasetOptions.from_mapping(spec), tmp_path / "raw")
    message = str(refused.value)
    assert "script-based" in message and "Dataset scripts are no longer supported" in message, message
    assert "dataset.data_files" in message and "clean-mc4-it/c4-it-validation.tfrecord-00000" in message, (
        message
    )
    assert not (tmp_path / "raw").exists()


def test_a_script_based_data_set_is_read_from_the_hubs_parquet_export(tmp_path, monkeypatch):
    """Where the hub converted the config to Parquet (refs/convert/parquet: <config>/<split>/, or
    partial-<split>/ for a split converted in part), the download reads that instead of the script."""
    from datasets import Dataset

    import fedtune.download.fetch as fetch

    folder = mc4_it_mirror(tmp_path)
    export = tmp_path / "export" / "clean_mc4_it"
    for split, sub, count in (("train", "train", 5), ("validation", "partial-validation", 2)):
        (export / "tiny" / sub).mkdir(parents=True)
        rows = {"text": [f"parquet {split} {i}" for i in range(count)]}
        Dataset.from_dict(rows).to_parquet(str(export / "tiny" / sub / "0000.parquet"))
    monkeypatch.setattr(fetch, "PARQUET_EXPORT", str(tmp_path / "export" / "clean_mc4_it"))
    spec = {
        "source": "hf",
        "name": str(folder),
        "config": "tiny",
        "splits": {"train": "train", "test": "validation"},
    }
    assert download_data(DatasetOptions.from_mapping(spec), tmp_path / "raw") == {"train": 5, "test": 2}
    assert load_from_disk(str(tmp_path / "raw"))["test"]["text"] == [
        "parquet validation 0",
        "parquet validation 1",
    ]


def test_the_published_examples_italian_data_files_read_the_tiny_shards_of_a_mirror(tmp_path):
    """The llama2 examples name clean_mc4_it's tiny config by its files (no script): on a local mirror of
    the repository's layout they read train shards 00000-00099 and validation shard 00000, nothing else,
    with datasets' json loader (gzipped json lines)."""
    import yaml

    for example in sorted(EXAMPLE.parent.glob("llama2-it-cs*.yaml")):
        dataset = yaml.safe_load(example.read_text())["sites"]["it"]["dataset"]
        assert dataset["name"] == "gsarti/clean_mc4_it" and "config" not in dataset, example.name
        folder = mc4_it_mirror(tmp_path / example.stem)
        options = DatasetOptions.from_mapping({**dataset, "name": str(folder)})
        options.check(f"{example.name}: ")
        assert options.loader == "json"
        out = tmp_path / example.stem / "raw"
        assert download_data(options, out) == {"train": 9, "test": 3}, example.name
        saved = load_from_disk(str(out))
        shards = {text.split(" ")[0] for text in saved["train"]["text"]}
        assert shards == {f"c4-it.tfrecord-{i:05d}-of-01024.json.gz" for i in (0, 1, 99)}, shards
        assert {text.split(" ")[0] for text in saved["test"]["text"]} == {
            "c4-it-validation.tfrecord-00000-of-00008.json.gz"
        }


def test_a_hub_data_sets_files_are_read_from_the_hub_repository_at_its_revision(tmp_path, monkeypatch):
    """Not a local folder: the files are hf://datasets/<name>@<revision, quoted>/<path>, read with the
    format's loader; a pattern that matches nothing is a DownloadError naming the data set."""
    import datasets

    import fedtune.download.fetch as fetch

    seen = {}

    def fake_load(loader, data_files=None, streaming=False):
        seen.update(loader=loader, data_files=data_files)
        raise FileNotFoundError("Unable to find 'x'")

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    spec = {"source": "hf", "name": "gsarti/clean_mc4_it", "revision": "refs/pr/1",
            "data_files": {"train": "clean-mc4-it/c4-it.tfrecord-000??-of-01024.json.gz"}}  # fmt: skip
    with pytest.raises(DownloadError, match="gsarti/clean_mc4_it: dataset.data_files: no file matches"):
        fetch.download_data(DatasetOptions.from_mapping(spec), tmp_path / "raw")
    assert seen == {
        "loader": "json",
        "data_files": {
            "train": [
                "hf://datasets/gsarti/clean_mc4_it@refs%2Fpr%2F1/clean-mc4-it/c4-it.tfrecord-000??-of-01024.json.gz"
            ]
        },
    }


def test_a_hub_data_set_named_by_its_files_takes_no_config(tmp_path):
    spec = {"source": "hf", "name": "gsarti/clean_mc4_it", "config": "tiny",
            "data_files": {"train": "clean-mc4-it/c4-it.tfrecord-00000-of-01024.json.gz"}}  # fmt: skip
    with pytest.raises(ConfigError, match="config: 'tiny' with data_files"):
        DatasetOptions.from_mapping(spec).check("x: dataset.")
