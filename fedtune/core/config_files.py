"""Config files as fedtune and Snakemake read them: a config file as a dict (a YAML error as one line that
names the file, line and column), and the --configfile names of a Snakemake command line, checked before
Snakemake reads them itself (the profiles call refuse_broken_configfiles)."""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from fedtune.core.options import ConfigError, _load_yaml


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
