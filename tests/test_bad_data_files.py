"""A bad local data file (binary, malformed JSON, invalid UTF-8 even inside a JSON string) stops with one
line naming the file and the line: at the dry run, where the file is local and cheap to read, and at
download, where a large one is read anyway (issue 47, §5)."""

from __future__ import annotations

import gzip
import json

import pytest

from fedtune.core import data_files
from fedtune.core.options import ConfigError
from fedtune.download.fetch import DownloadError, download_data
from fedtune.download.options import DatasetOptions

from .workflow_harness import demo_config, snakemake, write_config

GOOD = "".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(5)).encode()


def bad_files(tmp_path):
    """(file, its format, the line and words the error must name)."""
    cases = {
        "binary.jsonl": (b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR", "json", "line 3: a NUL byte"),
        "malformed.jsonl": (GOOD + b'{"text": "unterminated\n', "json", "line 6: not valid JSON"),
        # Passed download and failed only at tokenize before: the bytes sit inside a JSON string.
        "latin1.jsonl": (GOOD + '{"text": "caf\xe9"}\n'.encode("latin-1"), "json", "line 6: not UTF-8"),
        "array-row.jsonl": (GOOD + b"[1, 2]\n", "json", "line 6: a JSON Lines row must be an object"),
        "latin1.txt": (b"one\ntwo\nthr\xe9e\n", "text", "line 3: not UTF-8"),
        "document.json": (b'[\n  {"text": "a"},\n  {"text": "b",}\n]\n', "json", "line 3: not valid JSON"),
    }
    for name, (content, _, _) in cases.items():
        (tmp_path / name).write_bytes(content)
    return {tmp_path / name: (loader, expected) for name, (_, loader, expected) in cases.items()}


def test_each_bad_file_is_named_with_its_line(tmp_path):
    for path, (loader, expected) in bad_files(tmp_path).items():
        problem = data_files.first_problem(path, loader)
        assert problem is not None and problem.startswith(f"{path}: {expected}"), (path, problem)


def test_good_files_pass_whole_json_json_lines_text_and_gzip(tmp_path):
    (tmp_path / "rows.jsonl").write_bytes(GOOD + b"\n")  # a blank last line is allowed
    (tmp_path / "doc.json").write_text(json.dumps([{"text": "città"}, {"text": "b"}], indent=2))
    (tmp_path / "columns.json").write_text('{\n "text": ["a", "b"]\n}\n')
    (tmp_path / "plain.txt").write_text("uno\ndue — tre\n")
    with gzip.open(tmp_path / "rows.json.gz", "wb") as out:
        out.write(GOOD)
    for name, loader in [("rows.jsonl", "json"), ("doc.json", "json"), ("columns.json", "json"),
                         ("plain.txt", "text"), ("rows.json.gz", "json")]:  # fmt: skip
        assert data_files.first_problem(tmp_path / name, loader) is None, name


def test_a_gzipped_bad_file_is_named_too(tmp_path):
    with gzip.open(tmp_path / "rows.jsonl.gz", "wb") as out:
        out.write(GOOD + b"{not json}\n")
    assert "line 6: not valid JSON" in data_files.first_problem(tmp_path / "rows.jsonl.gz", "json")


def test_the_config_check_refuses_a_bad_file_naming_split_file_and_line(tmp_path):
    (tmp_path / "train.jsonl").write_bytes(GOOD + b"\xff\xfe\n")
    options = DatasetOptions.from_mapping({"source": "local", "data_files": {"train": "train.jsonl"}})
    with pytest.raises(
        ConfigError, match=r"sites\.it\.dataset\.data_files\.train: .*train\.jsonl: line 6: not UTF-8"
    ):
        options.check("sites.it.dataset.", base_dir=tmp_path)


def test_download_refuses_a_bad_file_larger_than_the_dry_run_reads(tmp_path, monkeypatch):
    (tmp_path / "train.jsonl").write_bytes(GOOD)
    options = DatasetOptions.from_mapping(
        {"source": "local", "data_files": {"train": str(tmp_path / "train.jsonl")}}
    )
    # The file goes bad after the config was checked (or is over the dry run's budget): download reads it.
    (tmp_path / "train.jsonl").write_bytes(GOOD + b'{"text": "caf\xe9"}\n')
    monkeypatch.setattr(data_files, "CHEAP_BYTES", 0)
    with pytest.raises(DownloadError, match=r"data_files\.train: .*train\.jsonl: line 6: not UTF-8"):
        download_data(options, tmp_path / "raw")
    assert not (tmp_path / "raw").exists()


def test_the_dry_run_stops_at_start_naming_the_file_and_line(tmp_path):
    config = demo_config()
    site = next(iter(config["sites"]))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(GOOD + b'{"text": "half a line\n')
    config["sites"][site]["dataset"]["data_files"]["train"] = str(bad)
    write_config(tmp_path, config)
    result = snakemake(tmp_path, "-n", check=False, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert f"{bad}: line 6: not valid JSON" in output, output[-2000:]
    assert "Traceback" not in output and "Building DAG" not in output
