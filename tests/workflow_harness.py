"""Running the real Snakefile on a config in a scratch working directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = str(Path(sys.executable).parent)


def demo_config(**overrides) -> dict:
    """The demo config with data paths made absolute, so it runs from any working directory."""
    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    for site in config["sites"].values():
        files = site["dataset"]["data_files"]
        for split, path in files.items():
            files[split] = str(ROOT / path)
    for key, value in overrides.items():
        config[key] = value
    return config


def write_config(workdir: Path, config: dict) -> Path:
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def snakemake(workdir: Path, *args: str, profile: str = "local", check: bool = True, timeout: int = 1500):
    env = dict(os.environ, PATH=f"{VENV_BIN}:{os.environ['PATH']}")
    command = [
        f"{VENV_BIN}/snakemake",
        "--snakefile", str(ROOT / "Snakefile"),
        "--directory", str(workdir),
        "--configfile", str(workdir / "config.yaml"),
        "--profile", str(ROOT / "profiles" / profile),
        *args,
    ]  # fmt: skip
    result = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(
            f"snakemake {' '.join(args)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
        )
    return result


def job_counts(output: str) -> dict[str, int]:
    """The 'Job stats' table of a dry run as {rule: count}."""
    counts, in_table = {}, False
    for line in output.splitlines():
        if line.startswith("job ") and "count" in line:
            in_table = True
            continue
        if in_table:
            parts = line.split()
            if not parts or parts[0] == "total":
                break
            if parts[0].startswith("-"):
                continue
            counts[parts[0]] = int(parts[1])
    return counts
