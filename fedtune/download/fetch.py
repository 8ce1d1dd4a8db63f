"""download: the one stage that may reach the network. It runs on a login node and puts everything the
offline stages need into the run's folder.

    python -m fedtune.download data  --options '<dataset JSON>' --out results/<run>/data/<site>/raw
    python -m fedtune.download model --options '<model JSON>' [--corpora '<JSON list>'] --out results/<run>/model/base
    python -m fedtune.download tasks --tasks ENTRY ... --out results/<run>/tasks

`tasks` is evaluate.tasks (the downstream extra, lm-eval): each task's YAML and local data files copied,
and each hub data set fetched into the folder's datasets cache (fedtune.download.tasks.prepare), for the
evaluate jobs to read offline.

With --task sequence-classification, `data` also checks the label column (integers in
0..--num-labels - 1) and `model` saves the base model with a classification head of model.num_labels
classes (new and seeded with model.seed unless the checkpoint has one of that size).

`--options` is a site's DatasetOptions or the ModelOptions (fedtune.download.options): the config's
`sites.<site>.dataset` or `model` section as build_run_config checked it (a partial section gets the
schema's defaults).
Hub tokens come from the environment (HF_TOKEN), never from the config or the command line."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path, PurePosixPath
from urllib.parse import quote

from fedtune.core import checksums, cli
from fedtune.core import data_files as data_file_checks
from fedtune.core.atomic import atomic_dir, write_json
from fedtune.core.options import (
    CAUSAL_LM,
    CLASSIFICATION,
    TASKS,
    ConfigError,
    UserError,
    label_problem,
    parse_json,
    thaw,
    torch_dtype,
)
from fedtune.download.options import DatasetOptions, ModelOptions

SPLITS = ("train", "test")


class DownloadError(UserError):
    """A dataset that cannot be used: the message names the dataset, split or column."""


# Rows per Arrow batch when a data set is streamed: small enough that a batch of long documents stays in
# megabytes, large enough that Python's per-batch cost is negligible.
STREAM_BATCH = 1000


def load_splits(options: DatasetOptions, num_labels: int | None = None, keep: tuple[str, ...] = SPLITS):
    """The site's documents as a DatasetDict with fedtune's splits `keep` (train and test; a cluster that
    only evaluates the site keeps test). With `num_labels` (classification), every document's label must
    be a class number below it.

    With dataset.max_documents the data set is streamed and only the documents kept are read, the same
    documents in the same order as reading it whole and cutting it; without, it is read whole (all of it
    is kept), and so is a hub data set whose test split is carved from train."""
    from datasets import DatasetDict

    keep = tuple(split for split in SPLITS if split in keep)
    # A test split carved from a hub data set's train split is drawn from all of it, which must then be
    # downloaded anyway: once, into datasets' cache, rather than streamed through twice.
    carved_from_hub = options.source == "hf" and (
        options.splits["test"] is None if options.data_files is None else "test" not in options.data_files
    )
    streamed = options.max_documents is not None and not carved_from_hub
    loaded, names, label = _open(options, streamed)
    if names["test"] is None:
        carve = _carve_streamed if streamed else _carve_whole
        splits = carve(loaded[names["train"]], options, keep)
    else:
        splits = {split: loaded[names[split]] for split in keep}
        if streamed:
            splits = {split: _first_rows(data, options.max_documents) for split, data in splits.items()}
    for split, data in splits.items():
        if options.text_field not in data.column_names:
            raise DownloadError(
                f"{label}: dataset.text_field {options.text_field!r} is not a column of the {split} split; "
                f"columns: {data.column_names}"
            )
        if options.max_documents is not None and len(data) > options.max_documents:
            splits[split] = data.select(range(options.max_documents))
        if len(splits[split]) == 0:
            raise DownloadError(f"{label}: the {split} split holds no documents")
        if num_labels is not None:
            check_labels(splits[split], options.label_field, num_labels, f"{label} ({split} split)")
    return DatasetDict(splits)


def _open(options: DatasetOptions, streaming: bool):
    """The source's splits (streamed or loaded whole), which of them are fedtune's train and test (test
    None: carved from train), and the source's name for messages."""
    from datasets import load_dataset

    if options.source == "local":
        for split, files in options.data_files.items():
            for file in files:
                if Path(file).stat().st_size == 0:
                    raise DownloadError(
                        f"dataset.data_files.{split}: {file} is empty: the {split} split holds no documents"
                    )
        # Files small enough for the dry run were checked there (options.check); the rest here.
        if not data_file_checks.cheap([f for files in options.data_files.values() for f in files]):
            for split, files in options.data_files.items():
                for file in files:
                    problem = data_file_checks.first_problem(file, options.loader, options.max_documents)
                    if problem:
                        raise DownloadError(f"dataset.data_files.{split}: {problem}")
        files = {split: list(paths) for split, paths in options.data_files.items()}
        loaded = load_dataset(options.loader, data_files=files, streaming=streaming)
        return (
            loaded,
            {"train": "train", "test": "test" if "test" in files else None},
            ", ".join(files["train"]),
        )
    if options.data_files is not None:
        return _open_repo_files(options, streaming)
    # datasets caches a local folder's configs by folder name and config name alone, so edited files
    # would load as the old rows: a local folder is always read afresh (it costs one local read; a stream
    # has no cache).
    fresh = {"download_mode": "force_redownload"} if Path(options.name).is_dir() and not streaming else {}
    try:
        loaded = load_dataset(
            options.name, options.config, revision=options.revision, streaming=streaming, **fresh
        )
    except RuntimeError as error:
        if SCRIPT_REFUSED not in str(error):
            raise
        loaded = _open_parquet_export(options, streaming, error)
    names = options.splits
    for split in (names["train"], names["test"]):
        if split is not None and split not in loaded:
            raise DownloadError(
                f"{options.name}: dataset.splits names split {split!r}, but the dataset has {sorted(loaded)}"
            )
    return loaded, names, options.name


# A hub data set read by a loading script (`<name>.py`): datasets 4.0 removed scripts, and 5.x raises this.
SCRIPT_REFUSED = "Dataset scripts are no longer supported"
# The hub's Parquet export of a data set (the refs/convert/parquet branch: <config>/<split>/NNNN.parquet,
# or <config>/partial-<split>/ for a large split the hub converted only in part).
PARQUET_EXPORT = "hf://datasets/{name}@refs%2Fconvert%2Fparquet"
# Data files a script-based repository may hold, named in the error that asks for data_files.
DATA_SUFFIXES = (".json", ".jsonl", ".txt", ".parquet", ".csv")


def _repo_root(options: DatasetOptions) -> str:
    """Where dataset.data_files of a hub data set are: a local folder (a mirror of the repository's
    layout), else the repository at its revision on the hub (hf://, the revision quoted: refs/pr/1)."""
    if Path(options.name).is_dir():
        return str(Path(options.name).resolve())
    return f"hf://datasets/{options.name}@{quote(options.revision or 'main', safe='')}"


def _open_repo_files(options: DatasetOptions, streaming: bool):
    """A hub data set's files named in dataset.data_files (fedtune's splits train and test), read with
    the format's own loader: no loading script, no configs. What a script-based data set needs."""
    from datasets import load_dataset

    root = _repo_root(options)
    files = {split: [f"{root}/{path}" for path in paths] for split, paths in options.data_files.items()}
    try:
        loaded = load_dataset(options.loader, data_files=files, streaming=streaming)
    except FileNotFoundError as error:
        raise DownloadError(
            f"{options.name}: dataset.data_files: no file matches in {root}: {error}"
        ) from None
    label = f"{options.name} ({', '.join(path for paths in options.data_files.values() for path in paths)})"
    return loaded, {"train": "train", "test": "test" if "test" in files else None}, label


def _open_parquet_export(options: DatasetOptions, streaming: bool, refused: Exception):
    """A script-based hub data set from the hub's Parquet export of its config: the splits named in
    dataset.splits. Where the hub has no export of them, a DownloadError naming the repository's data
    files, to be named in dataset.data_files."""
    import fsspec
    from datasets import load_dataset

    config = options.config or "default"
    root = PARQUET_EXPORT.format(name=options.name)
    files, missing, problems = {}, [], []
    for split in dict.fromkeys(name for name in options.splits.values() if name is not None):
        found = []
        for folder in (split, f"partial-{split}"):
            try:
                fs, path = fsspec.core.url_to_fs(f"{root}/{config}/{folder}")
                found = sorted(fs.glob(f"{path}/*.parquet"))
            except FileNotFoundError:
                found = []
            except Exception as error:  # noqa: BLE001 - not there or not reachable: said below
                found, problems = [], [*problems, f"{type(error).__name__}: {error}"]
            if found:
                if folder != split:
                    print(f"{options.name}: the hub converted only part of split {split!r} to Parquet")
                files[split] = [fs.unstrip_protocol(name) for name in found]
                break
        if not found:
            missing.append(split)
    if missing:
        raise DownloadError(
            f"{options.name}: a script-based data set (datasets says: {refused}); the hub has no Parquet "
            f"export of config {config!r}, split(s) {missing}"
            + (f" (or it could not be read: {problems[0]})" if problems else "")
            + ". Name its data files in dataset.data_files "
            f"(files of the repository, glob patterns allowed; config unset){_data_file_hint(options)}"
        ) from None
    print(f"{options.name}: a script-based data set: read from the hub's Parquet export ({root}/{config})")
    return load_dataset("parquet", data_files=files, streaming=streaming)


def _data_file_hint(options: DatasetOptions) -> str:
    """Some of the repository's data files, for the error that asks for data_files ("" where they cannot
    be listed)."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(_repo_root(options))
        names = sorted(
            str(PurePosixPath(name).relative_to(path))
            for name in fs.find(path)
            if any(suffix in PurePosixPath(name).name for suffix in DATA_SUFFIXES)
        )
    except Exception:  # noqa: BLE001 - a hint only: the error above says what to do
        return ""
    if not names:
        return ""
    shown = ", ".join(names[:4]) + (f", ... ({len(names)} files)" if len(names) > 4 else "")
    return f"; the repository holds {shown}"


def _carve_whole(train, options: DatasetOptions, keep: tuple[str, ...]) -> dict:
    carved = train.train_test_split(test_size=options.test_fraction, seed=options.seed, shuffle=True)
    return {split: carved[split] for split in keep}


def _batches(stream):
    """A streamed split as Arrow tables of STREAM_BATCH rows."""
    return stream.with_format("arrow").iter(batch_size=STREAM_BATCH)


def _dataset(tables: list, features):
    """An in-memory Dataset of Arrow tables with the stream's features (empty: no rows, those columns)."""
    import pyarrow as pa
    from datasets import Dataset, Features

    if not tables:
        return Dataset.from_dict({}, features=features or Features())
    data = Dataset(pa.concat_tables(tables))
    return data if features is None or data.features == features else data.cast(features)


def _first_rows(stream, count: int):
    """The first `count` documents of a streamed split: what select(range(count)) keeps of the whole.
    Not stream.take(count): its Arrow path asks the file for one more block after the last it needs
    (datasets 5.2), which for json lines is another 10 MB read and parsed."""
    tables, rows = [], 0
    for table in _batches(stream):
        tables.append(table.slice(0, count - rows))
        rows += len(tables[-1])
        if rows == count:
            break
    return _dataset(tables, stream.features)


def _carve_streamed(stream, options: DatasetOptions, keep: tuple[str, ...]) -> dict:
    """The test split carved from a streamed train split, each split cut to max_documents: the documents
    train_test_split(test_fraction, seed) and then select(range(max_documents)) keep of the whole split.
    The test documents are drawn from all of it, so it is read twice: once to count its documents (for
    the permutation, 8 bytes a document), once to pick the kept ones, a batch at a time."""
    import numpy as np

    total = sum(table.num_rows for table in _batches(stream))
    n_test = math.ceil(options.test_fraction * total)
    if total - n_test <= 0:
        raise DownloadError(
            f"dataset.test_fraction {options.test_fraction}: carving a test split from {total} documents "
            "leaves none to train on"
        )
    # datasets' train_test_split: one permutation of the rows, test first.
    permutation = np.random.default_rng(options.seed).permutation(total)
    wanted = {"test": permutation[:n_test], "train": permutation[n_test:]}
    wanted = {split: wanted[split][: options.max_documents] for split in keep}
    # Each split's wanted rows in file order, with the place each takes in the split.
    order = {split: np.argsort(rows, kind="stable") for split, rows in wanted.items()}
    ordered = {split: wanted[split][order[split]] for split in wanted}
    picked: dict[str, list] = {split: [] for split in wanted}
    offset = 0
    for table in _batches(stream):
        for split, rows in ordered.items():
            lo, hi = np.searchsorted(rows, [offset, offset + table.num_rows])
            if hi > lo:
                picked[split].append(table.take(rows[lo:hi] - offset))
        offset += table.num_rows
    splits = {}
    for split, tables in picked.items():
        data = _dataset(tables, stream.features)
        # Back from file order to the permutation's order.
        splits[split] = data.select(np.argsort(order[split], kind="stable")) if len(data) else data
    return splits


def check_labels(data, field: str, num_labels: int, where: str) -> None:
    """Every value of the label column is a class number in 0..num_labels-1; else DownloadError naming it."""
    if field not in data.column_names:
        raise DownloadError(
            f"{where}: dataset.label_field {field!r} is not a column; columns: {data.column_names}"
        )
    problem = label_problem(data.with_format("numpy")[field], num_labels)
    if problem:
        raise DownloadError(f"{where}: dataset.label_field {field!r}: {problem}")


def download_data(
    options: DatasetOptions, out: str | Path, num_labels: int | None = None, keep: tuple[str, ...] = SPLITS
) -> dict:
    options.check("--options: dataset.")
    splits = load_splits(options, num_labels, keep)
    with atomic_dir(out) as tmp:
        splits.save_to_disk(str(tmp))
    counts = {split: len(data) for split, data in splits.items()}
    print(f"saved {counts} documents to {out}")
    return counts


def _corpus_texts(corpora: list[dict], max_documents: int | None):
    from datasets import load_from_disk

    for corpus in corpora:
        train = load_from_disk(corpus["path"])["train"]
        count = len(train) if max_documents is None else min(len(train), max_documents)
        template = corpus.get("template", "{text}")
        for text in train.select(range(count))[corpus.get("text_field", "text")]:
            yield template.format(text=text)


def _copy_model_dir(source: Path, dest: Path) -> None:
    """Link (or copy) the model's own files: every plain file but the hidden ones. A hidden file in a
    model folder is a tool's, never the model's (transformers reads named files): Snakemake's
    `.snakemake_timestamp` in a directory output, rsync's temporaries, an editor's swap file. Linked,
    Snakemake's marker would be one inode in both runs, and the new run touching its own would make the
    source run's outputs look newer than everything after them there (issue 37). Named files of every
    kind are kept, so that a folder's remote code (`*.py`) and tokenizer files of any format come along.
    """
    for path in source.iterdir():
        if path.is_file() and not path.name.startswith("."):
            try:
                # A hard link costs no space for a 14 GB checkpoint on the same file system.
                (dest / path.name).hardlink_to(path)
            except OSError:
                shutil.copy2(path, dest / path.name)


def _recorded_digests(folder: Path) -> dict[str, str]:
    """The weights' sha256 as fedtune-checksums.json holds them (hashed once, when it was written)."""
    from fedtune.core.models import CHECKSUMS

    path = folder / CHECKSUMS
    if not path.is_file():
        return {}
    return {name: entry["sha256"] for name, entry in json.loads(path.read_text()).items()}


def download_model(
    options: ModelOptions, out: str | Path, corpora: list[dict] | None = None, task: str = CAUSAL_LM
) -> None:
    from fedtune.core import models

    options.check("--options: model.", task=task)
    source = options.source
    record = {"source": source, "task": task}
    classify = task == CLASSIFICATION
    with atomic_dir(out) as tmp:
        if source == "init":
            if not corpora:
                raise ConfigError(
                    "--corpora: a model built from scratch needs text to train its tokenizer on"
                )
            bpe = options.tokenizer
            texts = list(_corpus_texts(corpora, bpe.max_documents))
            tokenizer = models.train_tokenizer(texts, bpe.vocab_size, bpe.min_frequency)
            model = models.build_model(
                thaw(options.architecture),
                tokenizer,
                dtype=options.dtype,
                seed=options.seed,
                task=task,
                num_labels=options.num_labels,
            )
            models.save_model(model, tokenizer, tmp)
            record.update(
                architecture=thaw(options.architecture),
                tokenizer=bpe.to_dict(),
                documents=len(texts),
                seed=options.seed,
            )
        elif source == "gguf":
            from fedtune.download import gguf

            record.update(gguf.convert(options.path, tmp, dtype=options.dtype))
        elif source == "local" and not classify:
            path = Path(options.path)
            models.check_model_dir(path, allow_pickle=options.allow_pickle)
            models.load_tokenizer(path, trust_remote_code=options.trust_remote_code)
            _copy_model_dir(path, tmp)
            record.update(path=str(path.resolve()))
        elif classify:
            # A classifier needs its head saved with the body: a local folder is loaded and saved, not linked.
            name = options.path if source == "local" else options.name
            if source == "local":
                models.check_model_dir(name, allow_pickle=options.allow_pickle)
            revision = options.revision if source == "hf" else None
            tokenizer = models.load_tokenizer(
                name, trust_remote_code=options.trust_remote_code, revision=revision
            )
            model = models.classification_head(
                name,
                tokenizer,
                num_labels=options.num_labels,
                seed=options.seed,
                dtype=torch_dtype(options.dtype),
                use_safetensors=not options.allow_pickle,
                trust_remote_code=options.trust_remote_code,
                revision=revision,
            )
            models.save_model(model, tokenizer, tmp)
            record.update(name=str(name), revision=revision, num_labels=options.num_labels)
        else:
            # Files, not a loaded model: this runs on login nodes (fedtune/download/hub_model.py).
            from fedtune.download import hub_model

            fetched = hub_model.fetch(options, tmp)
            record.update(name=options.name, revision=options.revision, **fetched)
        # What was downloaded, pinned: each file's sha256 and one hash of them all, which every site's
        # training records and the aggregation compares (two clusters download the base separately).
        digests = checksums.folder_digests(tmp, _recorded_digests(tmp))
        record.update(file_sha256=digests, identity=checksums.folder_identity(digests))
        write_json(tmp / checksums.SOURCE_RECORD, record)
    print(f"saved the {source} model to {out}")


def _download_measure(options: ModelOptions):
    """For a hub model, how much of it is in the hub cache so far (a log line every half minute)."""
    if options.source != "hf":
        return None
    from huggingface_hub.constants import HF_HUB_CACHE

    from fedtune.core.progress import folder_size

    folder = Path(HF_HUB_CACHE) / ("models--" + options.name.replace("/", "--"))
    return lambda: folder_size(folder)


@cli.entry("fedtune.download.fetch")
def main(argv=None) -> int:
    parser, sub = cli.subcommands("fedtune.download.fetch", __doc__)
    data = sub.add_parser("data", help="a site's train and test splits, saved with save_to_disk")
    cli.add_options(data, "the site's dataset section (DatasetOptions)")
    data.add_argument("--num-labels", type=int, default=None, help="classification: check the labels")
    data.add_argument(
        "--splits",
        nargs="+",
        choices=SPLITS,
        default=list(SPLITS),
        help="the splits to keep (a cluster that only evaluates the site: test)",
    )
    cli.add_out(data, "the site's raw DatasetDict (save_to_disk)")
    model = sub.add_parser("model", help="the base model and tokenizer (a hub model: its files)")
    cli.add_options(model, "the model section (ModelOptions)")
    model.add_argument(
        "--corpora",
        default="[]",
        help="JSON list of {path, text_field, template}: raw datasets to train a tokenizer on",
    )
    model.add_argument("--task", default=CAUSAL_LM, choices=TASKS)
    cli.add_out(model, "the base model folder")
    tasks = sub.add_parser("tasks", help="downstream tasks' definitions and data sets (evaluate.tasks)")
    tasks.add_argument(
        "--tasks",
        nargs="+",
        required=True,
        help="task YAMLs, tasks shipped in workflow/tasks or lm-eval registry names",
    )
    cli.add_out(tasks, "the tasks folder")
    args = parser.parse_args(argv)
    if args.what == "data":
        # datasets makes every streamed data set a torch IterableDataset where torch is installed, which
        # imports torch (200 MB and seconds) into a job that never uses it; read before datasets loads.
        os.environ.setdefault("USE_TORCH", "0")
    from fedtune.core import progress

    progress.quiet_library_bars()
    try:
        if args.what == "data":
            with progress.Heartbeat(f"download data to {args.out}"):
                options = DatasetOptions.from_json(args.options)
                download_data(options, args.out, args.num_labels, tuple(args.splits))
        elif args.what == "tasks":
            from fedtune.download.tasks import prepare

            with progress.Heartbeat(f"download tasks to {args.out}"):
                record = prepare(args.tasks, args.out)
            print(f"saved {', '.join(t['name'] for t in record['tasks'])} to {args.out}")
        else:
            options = ModelOptions.from_json(args.options)
            with progress.Heartbeat(f"download model to {args.out}", measure=_download_measure(options)):
                download_model(options, args.out, parse_json(args.corpora, "--corpora"), args.task)
    except UserError:
        raise
    except (ValueError, OSError) as error:
        # The hub and the data set libraries say what they could not find or reach: a name, a revision,
        # a file or the network, each for the user to fix.
        raise DownloadError(str(error)) from error
    return 0


if __name__ == "__main__":
    sys.exit(main())
