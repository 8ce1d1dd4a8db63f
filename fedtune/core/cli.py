"""What every stage's command line shares: the parser, the common options (--options, --out) and how
errors end a command. A `UserError` (a config key, an option, a file the user can fix) ends it with one
line, `<command>: error: <message>`, and exit code 2, as does a full disk or quota; any other exception
is a bug and shows its traceback. Tokens are redacted from the message (fedtune.core.secrets)."""

from __future__ import annotations

import argparse
import atexit
import errno
import functools
import gc
import json
import sys
from collections.abc import Callable
from pathlib import Path

from fedtune.core.job_record import JobRecord
from fedtune.core.options import UserError
from fedtune.core.secrets import redact

EXIT_USER_ERROR = 2
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


@functools.cache  # once per process, however many entries run in it
def _skip_the_last_collection() -> None:
    """Freeze every object once the command is done, so that the interpreter's final garbage collection
    has nothing to walk: with torch and transformers loaded that walk took 1.6-1.8 s of every command's
    7-8 s in the demo. Exit handlers run last-registered first, so every handler registered after this
    one (those of the libraries the command imports) has run before it; refcounting still frees what it
    frees."""
    atexit.register(gc.freeze)


def parser(module: str, doc: str | None, **kwargs) -> argparse.ArgumentParser:
    """The parser of `python -m <module>`, with the module's docstring as its description."""
    return argparse.ArgumentParser(
        prog=f"python -m {command_name(module)}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **kwargs,
    )


# The module behind each stage's `python -m fedtune.<stage>` (the package's __main__ calls its main).
STAGE_MAINS = {
    "fedtune.download": "fetch",
    "fedtune.tokenize": "shards",
    "fedtune.train": "loop",
    "fedtune.aggregate": "merge",
    "fedtune.evaluate": "scores",
    "fedtune.report": "build",
}


def subcommands(module: str, doc: str | None) -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The parser of a command with subcommands (`python -m fedtune.download data|model|tasks`); the
    chosen one is `args.what`."""
    parser_ = parser(module, doc)
    return parser_, parser_.add_subparsers(dest="what", required=True)


def command_name(module: str) -> str:
    """`fedtune.train.loop` runs as `fedtune.train` (its package's __main__); others by their module."""
    package, _, name = module.rpartition(".")
    return package if STAGE_MAINS.get(package) == name else module


def add_out(parser: argparse.ArgumentParser, help: str, **kwargs) -> None:
    parser.add_argument("--out", required=True, help=help, **kwargs)


def add_scored_model(parser: argparse.ArgumentParser) -> None:
    """What the evaluation CLIs share: the device, and which model a result belongs to in the report."""
    parser.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    parser.add_argument(
        "--label", default=None, help="name of the model in the report: base, a site, aggregate"
    )
    parser.add_argument("--round", type=int, default=None, help="federation round of the model (base: 0)")


def add_tracking(parser: argparse.ArgumentParser, *, required: bool = False) -> None:
    """--tracking (the config's tracking section as JSON, its dir resolved: TrackingOptions) and
    --run-name, for the tracked run's name. Not --run: torchrun would take it for its own --run-path."""
    parser.add_argument(
        "--tracking", required=required, help="the config's tracking section as JSON (fedtune.core.tracking)"
    )
    parser.add_argument("--run-name", required=required, help="the run's name, for the tracked run's name")


def add_list(
    parser: argparse.ArgumentParser, option: str, metavar: str, help: str, *, required=False
) -> None:
    """An option taking one or more values, repeatable (`--eval a b --eval c`)."""
    parser.add_argument(
        option, nargs="+", action="extend", required=required, default=[], metavar=metavar, help=help
    )


def add_options(parser: argparse.ArgumentParser, what: str, **kwargs) -> None:
    """--options: the stage's settings as one JSON object (the config's section as build_run_config
    checked it), turned back into the same typed object by the stage with `<Options>.from_json`."""
    parser.add_argument("--options", required=True, help=f"{what} as one JSON object", **kwargs)


def entry(module: str, *, offline: bool = False) -> Callable:
    """Decorates a stage's `main(argv) -> int | None`: user errors become one line and exit code 2.
    `offline`: a compute-node stage, which never opens a connection (fedtune.core.offline), set before
    anything imports Hugging Face."""
    name = command_name(module)

    def wrap(main: Callable) -> Callable:
        @functools.wraps(main)
        def run(argv=None) -> int:
            _skip_the_last_collection()
            if offline:
                from fedtune.core.offline import enforce

                enforce()
            # The report's cost table reads when each command ran, and in which Slurm job.
            record = JobRecord(name, list(sys.argv[1:] if argv is None else argv))
            code = 1  # an exception that escapes is a failed command
            try:
                code = main(argv) or 0
                return code
            except UserError as error:
                print(f"{name}: error: {redact(str(error))}", file=sys.stderr)
                code = EXIT_USER_ERROR
                return code
            except OSError as error:
                # A full disk or quota is the user's to fix (the atomic writes left nothing half-written).
                if error.errno not in DISK_FULL:
                    raise
                print(f"{name}: error: {error} (free space, or a larger quota)", file=sys.stderr)
                code = EXIT_USER_ERROR
                return code
            except SystemExit as stop:  # argparse, and a stage that exits with its own code (train: 75)
                code = stop.code if isinstance(stop.code, int) else 1
                raise
            finally:
                record.finish(code)

        return run

    return wrap


def json_file(path, option: str):
    """A JSON file named by an option, or a UserError naming the option and the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise UserError(f"{option}: {path}: {error.strerror or error}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(f"{option}: {path}: not valid JSON: {error}") from None
