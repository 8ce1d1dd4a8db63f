"""transfer: bring a model or manifest made on another cluster into this run's folder, with rsync.

    python -m fedtune.core.transfer --source user@host:/path/results/<run>/round-1/beta/model \\
        --out results/<run>/round-1/beta/model --hint "on karolina: snakemake --profile profiles/karolina ..."

The copy lands under a temporary name and is renamed once complete and checked, so an interrupted
transfer is never taken for a model. `--hint` is what the error tells the user to run where, when the
source is not there (yet)."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from fedtune.core.atomic import atomic_dir


class TransferError(RuntimeError):
    """A transfer that failed or brought something incomplete: the message says what to run where."""


def _rsync(rsync: str, source: str, dest: str, hint: str, *options: str) -> None:
    result = subprocess.run([rsync, *options, source, dest], capture_output=True, text=True)
    if result.returncode != 0:
        said = " | ".join(line for line in result.stderr.splitlines() if line.strip())
        raise TransferError(f"could not fetch {source} (rsync exit {result.returncode}: {said}). {hint}")


def _check_complete(path: Path, source: str, hint: str) -> None:
    if path.is_file():
        return
    # A model folder, or a PEFT adapter folder (train.adapter: what sites send then).
    described = (path / "config.json").is_file() or (path / "adapter_config.json").is_file()
    if not described or not any(path.glob("*.safetensors")):
        raise TransferError(
            f"{source} is not a complete model or adapter folder (config.json or adapter_config.json, "
            "and *.safetensors expected); "
            f"it may still be in training. {hint}"
        )


def fetch(source: str, out: str | Path, *, hint: str = "", rsync: str = "rsync") -> Path:
    out = Path(out)
    if shutil.which(rsync) is None:
        raise TransferError(f"{rsync} not found: install rsync to fetch models from other clusters")
    is_dir = not source.endswith(".json")
    if is_dir:
        with atomic_dir(out) as tmp:
            _rsync(rsync, f"{source.rstrip('/')}/", f"{tmp}/", hint, "-a", "--partial")
            _check_complete(tmp, source, hint)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.transfer")
        try:
            _rsync(rsync, source, str(tmp), hint, "-a")
        except TransferError:
            tmp.unlink(missing_ok=True)
            raise
        tmp.replace(out)
    print(f"fetched {source} -> {out}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fedtune.core.transfer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--source", required=True, help="rsync source: a folder or a .json file")
    parser.add_argument("--out", required=True)
    parser.add_argument("--hint", default="", help="what to run where when the source is missing")
    args = parser.parse_args(argv)
    try:
        fetch(args.source, args.out, hint=args.hint)
    except (TransferError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
