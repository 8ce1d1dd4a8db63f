"""Start checks that need to know how Snakemake was started (workflow/rules/common.smk calls them): a
config of real clusters started without one, and federation.remotes entries that still hold a placeholder."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from fedtune.core.config_files import CONFIG_SUFFIXES
from fedtune.core.remotes import placeholder_remotes
from fedtune.run.config import RunConfig


def profile_clusters(profiles_dir: Path) -> dict[str, str]:
    """{cluster: profile folder} of the profiles that set a `cluster` (profiles/leonardo, ...): the
    real clusters, whose jobs need Slurm and that cluster's nodes."""
    clusters = {}
    for path in sorted(Path(profiles_dir).glob("*/config.yaml")):
        match = re.search(r"^config:\n(?:[ \t]+.*\n|\n)*?[ \t]+cluster:[ \t]*(\S+)", path.read_text(), re.M)
        if match:
            clusters[match.group(1)] = path.parent.name
    return clusters


def twin_command(source: str) -> str:
    """The scripts/twin command that makes a laptop-sized copy of the config `source` (of several config
    files, the first)."""
    source = source.split(" + ")[0]
    stem = Path(source).stem if source.endswith(CONFIG_SUFFIXES) else "my-config"
    name = source if source.endswith(CONFIG_SUFFIXES) else "<config>"
    return (
        f"scripts/twin {name} --assets results/twins --out results/twins/{stem}.yaml && snakemake --profile "
        f"profiles/local --configfile results/twins/{stem}.yaml"
    )


def cluster_profile_problem(run: RunConfig, profiles_dir: Path, source: str) -> str | None:
    """A config whose sites train on real clusters (a cluster with its own profile, which sets `cluster`)
    started without a cluster (profiles/local or another profile that sets none): every job would run on
    this machine, the multi-node trainings and the hub downloads of a 7B model included. One line that
    says what to do, or None."""
    if run.cluster is not None:
        return None
    known = profile_clusters(profiles_dir)
    remote = [(name, site.cluster) for name, site in run.sites.items() if site.cluster in known]
    if not remote:
        return None
    where = ", ".join(f"sites.{name}.cluster: {cluster}" for name, cluster in remote)
    profiles = ", ".join(f"--profile profiles/{known[c]}" for c in sorted({c for _, c in remote}))
    return (
        f"{source}: {where}, but this run names no cluster (a profile such as profiles/local runs every job "
        f"on this machine): on the cluster, run it with {profiles}; on this machine, run its laptop-sized "
        f"twin instead: `{twin_command(source)}`"
    )


def placeholder_problem(run: RunConfig, clusters: Sequence[str], source: str) -> str | None:
    placeholders = placeholder_remotes(run.remotes, clusters)
    if not placeholders:
        return None
    entries = "; ".join(f"federation.remotes.{key} is {path!r}" for key, path in placeholders.items())
    return (
        f"{source}: {entries}: a placeholder, which {run.cluster} logs into to send or fetch files; write your "
        "user, login host and project there (README.md, Quick start, step 2)"
    )
