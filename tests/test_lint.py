"""ruff, snakefmt and snakemake --lint are part of the suite, so CI keeps the code clean."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .conftest import ROOT

BIN = Path(sys.executable).parent


def run(*command):
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}")
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_ruff_check_and_format():
    check = run(str(BIN / "ruff"), "check", ".")
    assert check.returncode == 0, check.stdout
    fmt = run(str(BIN / "ruff"), "format", "--check", ".")
    assert fmt.returncode == 0, fmt.stdout


def test_snakefmt():
    result = run(str(BIN / "snakefmt"), "--check", "Snakefile", "workflow")
    assert result.returncode == 0, result.stdout + result.stderr


def test_snakemake_lint():
    result = run(str(BIN / "snakemake"), "--lint", "-n")
    assert result.returncode == 0, result.stdout + result.stderr
