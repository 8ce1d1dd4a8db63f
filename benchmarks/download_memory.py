"""Benchmark: peak memory and time of the download stage (`python -m fedtune.download data`) for a local
data set cut to a few thousand documents (dataset.max_documents), as the data set grows from 10k to 1M
documents, against the stage as it was (the data set read whole, then cut).

    .venv/bin/python benchmarks/download_memory.py                 # 10k, 100k and 1M rows, 5,000 kept
    .venv/bin/python benchmarks/download_memory.py --rows 10000 100000 --keep 2000

Each data set is a json lines file of `rows` documents of about 170 bytes (train) and one of a tenth of
that (test); a second layout gives train only, so that the test split is carved (dataset.test_fraction).
Each measured command runs under a small Python parent that reports its child's peak resident set size
(getrusage RUSAGE_CHILDREN ru_maxrss) and wall time, with a fresh datasets cache. Goal (issue 38): the
streamed download's peak memory and, with given test files, its time stay flat as the data set grows;
a carved test split is drawn from the whole train split, so its time grows with it (two streamed
passes), its memory by 8 bytes a document (the permutation)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from hub_download import measured  # beside this script, on its path

ROOT = Path(__file__).resolve().parent.parent

# What the stage did before it streamed (fedtune/download/fetch.py until issue 38): load the files whole
# (datasets writes an Arrow copy into its cache), carve, cut each split to max_documents, save.
BEFORE = """
import json, sys
from datasets import DatasetDict, load_dataset
spec, out = json.loads(sys.argv[1]), sys.argv[2]
files = spec["data_files"]
loaded = load_dataset("json", data_files=files)
if "test" in files:
    splits = {"train": loaded["train"], "test": loaded["test"]}
else:
    carved = loaded["train"].train_test_split(test_size=spec["test_fraction"], seed=0, shuffle=True)
    splits = {"train": carved["train"], "test": carved["test"]}
n = spec["max_documents"]
DatasetDict({k: v.select(range(min(n, len(v)))) for k, v in splits.items()}).save_to_disk(out)
"""


def write_rows(path: Path, rows: int, seed: int) -> None:
    words = [
        "federated",
        "learning",
        "keeps",
        "each",
        "site's",
        "text",
        "at",
        "home",
        "and",
        "moves",
        "models",
    ]
    with path.open("w") as f:
        for i in range(rows):
            text = " ".join(words[(i * 7 + j * seed) % len(words)] for j in range(22))
            f.write(json.dumps({"text": f"{i}: {text}", "label": i % 4}) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--keep", type=int, default=5000, help="dataset.max_documents")
    parser.add_argument("--no-before", action="store_true", help="skip the whole-read comparison")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="download-memory-"))
    report: dict = {"keep": args.keep, "date": time.strftime("%Y-%m-%d"), "runs": []}
    try:
        for rows in args.rows:
            train, test = work / f"train-{rows}.jsonl", work / f"test-{rows}.jsonl"
            write_rows(train, rows, 3)
            write_rows(test, max(rows // 10, args.keep), 5)
            layouts = {
                "test files": {"train": str(train), "test": str(test)},
                "carved": {"train": str(train)},
            }
            for layout, files in layouts.items():
                spec = {
                    "source": "local",
                    "data_files": files,
                    "max_documents": args.keep,
                    "test_fraction": 0.05,
                }
                ways = {
                    "streamed": [sys.executable, "-m", "fedtune.download", "data", "--options", json.dumps(spec),
                                 "--out"],
                    "whole (before)": [sys.executable, "-c", BEFORE, json.dumps(spec)],
                }  # fmt: skip
                if args.no_before:
                    del ways["whole (before)"]
                for way, command in ways.items():
                    out, cache = work / "out", work / "cache"
                    shutil.rmtree(out, ignore_errors=True)
                    shutil.rmtree(cache, ignore_errors=True)
                    env = dict(os.environ, HF_DATASETS_CACHE=str(cache), PYTHONPATH=str(ROOT))
                    result = measured([*command, str(out)], env, quiet=True)
                    cached = (
                        sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
                        if cache.exists()
                        else 0
                    )
                    run = {"rows": rows, "file_mb": round(train.stat().st_size / 1e6), "layout": layout,
                           "way": way, **result, "cache_mb": round(cached / 1e6)}  # fmt: skip
                    report["runs"].append(run)
                    print(json.dumps(run), file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report, indent=2))
    # Flat: with test files, the largest data set's peak within 10% (and 50 MB: the json reader parses
    # 10 MB blocks, so a file under that size costs less than any larger one) of the smallest's.
    peaks = [r["peak_mb"] for r in report["runs"] if r["way"] == "streamed" and r["layout"] == "test files"]
    flat = max(peaks) <= min(peaks) * 1.1 + 50
    return 0 if flat and all(r["rc"] == 0 for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
