"""download: the one stage that may reach the network. It runs on a login node and puts everything the
offline stages need into the run's folder.

    python -m fedtune.download data  --options '<dataset JSON>' --out results/<run>/data/<site>/raw
    python -m fedtune.download model --options '<model JSON>' [--corpora '<JSON list>'] --out results/<run>/model/base
    python -m fedtune.download tasks --tasks ENTRY ... --out results/<run>/tasks

`tasks` is evaluate.tasks (the downstream extra, lm-eval): each task's YAML and local data files copied,
and each hub data set fetched into the folder's datasets cache (fedtune.evaluate.downstream.prepare), for the
evaluate jobs to read offline.

With --task sequence-classification, `data` also checks the label column (integers in
0..--num-labels - 1) and `model` saves the base model with a classification head of model.num_labels
classes (new and seeded with model.seed unless the checkpoint has one of that size).

`--options` is a site's DatasetOptions or the ModelOptions (fedtune.core.config): the config's
`sites.<site>.dataset` or `model` section as build_run_config checked it (a partial section gets the
schema's defaults).
Hub tokens come from the environment (HF_TOKEN), never from the config or the command line."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from fedtune.core import checksums, cli
from fedtune.core.atomic import atomic_dir, write_json
from fedtune.core.config import (
    CAUSAL_LM,
    CLASSIFICATION,
    TASKS,
    ConfigError,
    DatasetOptions,
    ModelOptions,
    UserError,
    label_problem,
    parse_json,
    thaw,
    torch_dtype,
)

SPLITS = ("train", "test")


class DownloadError(UserError):
    """A dataset that cannot be used: the message names the dataset, split or column."""


def load_splits(options: DatasetOptions, num_labels: int | None = None):
    """The site's documents as a DatasetDict with exactly the splits train and test. With `num_labels`
    (classification), every document's label must be a class number below it."""
    from datasets import DatasetDict, load_dataset

    if options.source == "local":
        for split, files in options.data_files.items():
            for file in files:
                if Path(file).stat().st_size == 0:
                    raise DownloadError(
                        f"dataset.data_files.{split}: {file} is empty: the {split} split holds no documents"
                    )
        files = {split: list(paths) for split, paths in options.data_files.items()}
        loaded = load_dataset(options.loader, data_files=files)
        names = {"train": "train", "test": "test" if "test" in files else None}
        label = ", ".join(files["train"])
    else:
        # datasets caches a local folder's configs by folder name and config name alone, so edited files
        # would load as the old rows: a local folder is always read afresh (it costs one local read).
        fresh = {"download_mode": "force_redownload"} if Path(options.name).is_dir() else {}
        loaded = load_dataset(options.name, options.config, revision=options.revision, **fresh)
        names = options.splits
        label = options.name
        for split in (names["train"], names["test"]):
            if split is not None and split not in loaded:
                raise DownloadError(
                    f"{label}: dataset.splits names split {split!r}, but the dataset has {sorted(loaded)}"
                )
    train = loaded[names["train"]]
    if names["test"] is None:
        carved = train.train_test_split(test_size=options.test_fraction, seed=options.seed, shuffle=True)
        splits = {"train": carved["train"], "test": carved["test"]}
    else:
        splits = {"train": train, "test": loaded[names["test"]]}
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


def check_labels(data, field: str, num_labels: int, where: str) -> None:
    """Every value of the label column is a class number in 0..num_labels-1; else DownloadError naming it."""
    if field not in data.column_names:
        raise DownloadError(
            f"{where}: dataset.label_field {field!r} is not a column; columns: {data.column_names}"
        )
    problem = label_problem(data.with_format("numpy")[field], num_labels)
    if problem:
        raise DownloadError(f"{where}: dataset.label_field {field!r}: {problem}")


def download_data(options: DatasetOptions, out: str | Path, num_labels: int | None = None) -> dict:
    options.check("--options: dataset.")
    splits = load_splits(options, num_labels)
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
    from fedtune.core import progress

    progress.quiet_library_bars()
    try:
        if args.what == "data":
            with progress.Heartbeat(f"download data to {args.out}"):
                download_data(DatasetOptions.from_json(args.options), args.out, args.num_labels)
        elif args.what == "tasks":
            from fedtune.evaluate.downstream import prepare

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
