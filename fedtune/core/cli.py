"""What every stage's command line shares: the parser, the common options (--options, --out) and how
errors end a command. A `UserError` (a config key, an option, a file the user can fix) ends it with one
line, `<command>: error: <message>`, and exit code 2; any other exception is a bug and shows its
traceback. Tokens are redacted from the message (fedtune.core.secrets)."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

from fedtune.core.config import UserError
from fedtune.core.secrets import redact

EXIT_USER_ERROR = 2


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


def command_name(module: str) -> str:
    """`fedtune.train.loop` runs as `fedtune.train` (its package's __main__); others by their module."""
    package, _, name = module.rpartition(".")
    return package if STAGE_MAINS.get(package) == name else module


def add_out(parser: argparse.ArgumentParser, help: str, **kwargs) -> None:
    parser.add_argument("--out", required=True, help=help, **kwargs)


def add_options(parser: argparse.ArgumentParser, what: str, **kwargs) -> None:
    """--options: the stage's settings as one JSON object (the config's section as build_run_config
    checked it), turned back into the same typed object by the stage with `<Options>.from_json`."""
    parser.add_argument("--options", required=True, help=f"{what} as one JSON object", **kwargs)


def entry(module: str) -> Callable:
    """Decorates a stage's `main(argv) -> int | None`: user errors become one line and exit code 2."""
    name = command_name(module)

    def wrap(main: Callable) -> Callable:
        @functools.wraps(main)
        def run(argv=None) -> int:
            try:
                return main(argv) or 0
            except UserError as error:
                print(f"{name}: error: {redact(str(error))}", file=sys.stderr)
                return EXIT_USER_ERROR

        return run

    return wrap
