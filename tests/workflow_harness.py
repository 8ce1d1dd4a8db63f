"""Running the real Snakefile on a config in a scratch working directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = str(Path(sys.executable).parent)


# The demo on its generated text (data/demo): the tests that check exact figures and the sites alpha and
# beta run it. `make demo` runs config/config.yaml, on real text (tests/test_config.py checks it).
DEMO_GENERATED = ROOT / "tests" / "support" / "demo-generated.yaml"


def demo_config(**overrides) -> dict:
    """The demo config on generated text with data paths made absolute, so it runs from any working
    directory."""
    config = yaml.safe_load(DEMO_GENERATED.read_text())
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


def snakemake(
    workdir: Path,
    *args: str,
    profile: str = "local",
    check: bool = True,
    timeout: int = 1500,
    root: Path = ROOT,
):
    """Snakemake of the checkout `root` (this one unless a test moved a copy elsewhere) on workdir."""
    env = dict(os.environ, PATH=f"{VENV_BIN}:{os.environ['PATH']}")
    command = [
        f"{VENV_BIN}/snakemake",
        "--snakefile", str(root / "Snakefile"),
        "--directory", str(workdir),
        "--configfile", str(workdir / "config.yaml"),
        "--profile", str(root / "profiles" / profile),
        *args,
    ]  # fmt: skip
    result = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(
            f"snakemake {' '.join(args)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
        )
    return result


class JobResources(dict):
    """The resources of a job as the slurm executor plugin reads them: .get() and attribute access."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass
class PlannedJob:
    """One job of a dry run, as Snakemake resolved it."""

    name: str
    resources: JobResources = field(default_factory=JobResources)
    threads: int = 1
    wildcards: dict = field(default_factory=dict)
    shell: str = ""


def _value(text: str):
    return int(text) if re.fullmatch(r"\d+", text) else text


def planned_jobs(output: str) -> list[PlannedJob]:
    """Every job of the output of `snakemake --dry-run --printshellcmds`, in order: rule name, threads,
    wildcards, resolved resources and shell command. The one place that reads Snakemake's dry-run text."""
    jobs: list[PlannedJob] = []
    job = None
    for line in output.splitlines():
        # Members of a group job (Karolina's tokenize) are listed indented under "Group job ...".
        if match := re.match(r"^\s*(?:local)?rule (\w+):$", line):
            job = PlannedJob(match.group(1))
            jobs.append(job)
        elif job is None:
            continue
        elif match := re.match(r"^\s+threads: (\d+)$", line):
            job.threads = int(match.group(1))
        elif match := re.match(r"^\s+wildcards: (.*)$", line):
            job.wildcards = dict(item.split("=", 1) for item in match.group(1).split(", "))
        elif match := re.match(r"^\s+resources: (.*)$", line):
            pairs = (item.split("=", 1) for item in match.group(1).split(", "))
            job.resources = JobResources({key: _value(value) for key, value in pairs})
        elif line.startswith("Shell command: "):
            job.shell = line.removeprefix("Shell command: ")
            job = None
    return jobs


def dry_run(workdir: Path, *args: str, **kwargs) -> list[PlannedJob]:
    """The jobs Snakemake would run now for this working directory's config."""
    return planned_jobs(snakemake(workdir, "--dry-run", "--printshellcmds", *args, **kwargs).stdout)


def job_counts(output: str) -> dict[str, int]:
    """Jobs per rule in a dry run's output (made with --printshellcmds)."""
    return dict(Counter(job.name for job in planned_jobs(output)))


# Rules the workflow marks local (the transfers): a dry run with a Slurm profile lists them as `rule`.
TRANSFER_RULES = ("fetch_site_model", "fetch_manifest", "fetch_aggregate", "fetch_score", "fetch_base_score",
                  "mark_complete", "push")  # fmt: skip


def slurm_jobs_per_round(output: str) -> dict[int, int]:
    """Slurm jobs per round in a dry run's output with a Slurm profile: a group job round-<r> counts once,
    a job of another rule with a round wildcard once, outside a group (the transfers are local)."""
    counts: Counter = Counter()
    rule, in_group = None, False
    for line in output.splitlines():
        if match := re.search(r"Group job round-(\d+) ", line):
            counts[int(match.group(1))] += 1
            in_group = True
        elif match := re.match(r"^(?:local)?rule (\w+):$", line):
            rule, in_group = match.group(1), False
        elif (match := re.match(r"^\s+wildcards: (.*)$", line)) and rule and not in_group:
            wildcards = dict(item.split("=", 1) for item in match.group(1).split(", "))
            if "round" in wildcards and rule not in TRANSFER_RULES:
                counts[int(wildcards["round"])] += 1
            rule = None
    return dict(sorted(counts.items()))
