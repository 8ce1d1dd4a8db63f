"""The clusters: which there are, the groups of rules whose resources a cluster profile gives, and the
helpers every cluster profile imports in its `__definitions__` (docs/design.md, "Adding a cluster").

A cluster is one file, `scripts/clusters/<name>.sh` (the environment every job of it sources), plus its
profile, `profiles/<name>/config.yaml`. The Slurm sites with GPUs are the cluster files that source
`_common.sh` (their shared GPU settings); `slurm-local.sh`, the local test cluster, does not. Every list
of clusters (scripts/setup-env, workflow/rules/common.smk, the tests) is read from those files.

The profiles give Slurm resources per group of rules (`RULE_GROUPS`), not per rule, and expand a group
into Snakemake's `set-resources` with yte (`?for rule in rules("train"): ?rule: ...`): a new rule of a
group needs no profile edit. The profiles import it before the workflow loads: it imports only the
--configfile check of fedtune (refuse_broken_configfiles, re-exported here), and no torch.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from fedtune.core.config_files import refuse_broken_configfiles

__all__ = [
    "CLUSTER_FILES",
    "RULE_GROUPS",
    "TRAIN_RULES",
    "account",
    "choice",
    "clusters",
    "refuse_broken_configfiles",
    "rule_group",
    "rules",
    "scratch_results",
    "site_clusters",
    "smoke",
    "smoke_test",
]

# Each rule that becomes a Slurm job, by the kind of job it is. A profile places a group once; the workflow's
# rules are checked against this (tests/test_site_audit.py), so a rule added to the workflow fails there
# until it joins a group here.
RULE_GROUPS: dict[str, tuple[str, ...]] = {
    # Downloads: local rules on the login node (workflow/rules/download.smk) unless a profile places them
    # (Leonardo: serial jobs, since its login nodes kill a process after 10 minutes of CPU time).
    "download": ("download_data", "download_model", "download_tasks"),
    "tokenize": ("tokenize",),
    # The exchange (federation.exchange): a site's update compressed after its training, CPU work.
    "compress": ("compress_update",),
    # Training jobs: a site's, the scaling sweep's (sweep.smk), the pooled baseline and its lr sweep, and
    # the trainings that first merge their start model (train_merging, adapters.smk) or first score the
    # previous round's models on their site's text (train_scoring, train.smk).
    "train": ("train", "train_sweep", "train_pooled", "train_pooled_sweep", "train_merging", "train_scoring"),
    # The evaluations (one GPU): the base model, a round's models (in the round's group job), a site's
    # model on its own text (evaluate.cross_site none), the pooled baseline, the downstream tasks.
    "evaluate": (
        "evaluate_base",
        "evaluate_round",
        "evaluate_round_own",
        "evaluate_pooled",
        "evaluate_pooled_sweep",
        "evaluate_tasks_base",
        "evaluate_tasks_round",
    ),
    # What joins a round's evaluations in one Slurm job (group round-<r>): the merges, and the exchange's
    # decoding and the aggregate's compression.
    "round": (
        "aggregate",
        "aggregate_compare",
        "aggregate_adapters",
        "merge_adapter",
        "decode_site_model",
        "compress_aggregate",
        "decode_aggregate",
    ),
}

# The training rules (fedtune.report.plan counts their jobs apart).
TRAIN_RULES = RULE_GROUPS["train"]


def rules(*groups: str) -> tuple[str, ...]:
    """The rules of these groups, in order: what a profile's `?for rule in rules(...)` places."""
    unknown = [group for group in groups if group not in RULE_GROUPS]
    if unknown:
        raise KeyError(f"no rule group {', '.join(unknown)}: the groups are {', '.join(RULE_GROUPS)}")
    return tuple(rule for group in groups for rule in RULE_GROUPS[group])


def rule_group(rule: str) -> str | None:
    """The group of a rule, or None for one in no group (a local rule)."""
    return next((group for group, names in RULE_GROUPS.items() if rule in names), None)


# ---------------------------------------------------------------------------------------------- the files

# The repository's cluster files (an installed package without the repository has none).
CLUSTER_FILES = Path(__file__).resolve().parents[2] / "scripts" / "clusters"
# A GPU site's file sources the shared GPU settings: `source "${BASH_SOURCE[0]%/*}/_common.sh"`.
_SOURCES_COMMON = re.compile(r"^[ \t]*(?:source|\.)[ \t]+\S*/_common\.sh\"?[ \t]*(?:#.*)?$", re.M)


def clusters(directory: Path | str = CLUSTER_FILES) -> list[str]:
    """Every cluster with a file (`<name>.sh`; `_common.sh` and other `_` files are shared parts), sorted."""
    return sorted(path.stem for path in Path(directory).glob("*.sh") if not path.name.startswith("_"))


def site_clusters(directory: Path | str = CLUSTER_FILES) -> list[str]:
    """The Slurm sites with GPUs, sorted: the cluster files that source `_common.sh` (not slurm-local)."""
    return [
        name
        for name in clusters(directory)
        if _SOURCES_COMMON.search((Path(directory) / f"{name}.sh").read_text())
    ]


# ------------------------------------------------------------------------------- what the profiles import
# Besides these: refuse_broken_configfiles (fedtune.core.config_files), which every profile calls first.


def account(cluster: str, required: bool = True) -> str | None:
    """The Slurm account: $FEDTUNE_<CLUSTER>_ACCOUNT, else $FEDTUNE_ACCOUNT. When neither is set: None if
    not `required` (Slurm then charges the user's default account), else one line and exit 2 (an exception
    here would come after Snakemake's 100 lines of usage)."""
    specific = f"FEDTUNE_{cluster.upper()}_ACCOUNT"
    value = os.environ.get(specific) or os.environ.get("FEDTUNE_ACCOUNT")
    if not value and required:
        print(
            f"error: no Slurm account for {cluster}: set FEDTUNE_ACCOUNT (or {specific}) to your "
            "project account, e.g. `export FEDTUNE_ACCOUNT=<project>`",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return value


def smoke_test() -> bool:
    """FEDTUNE_SMOKE=1: the smoke test (config key smoke: 2 nodes, 10 steps, 10 minutes, in <run>-smoke)."""
    return os.environ.get("FEDTUNE_SMOKE") == "1"


def smoke(debug, normal):
    """The setting for the smoke test (`debug`, the site's debug queue) or for a real run (`normal`)."""
    return debug if smoke_test() else normal


def scratch_results(*variables: str, project: str | None = None) -> str | None:
    """The runs' folder on scratch: $FEDTUNE_SCRATCH/results; else `<the first of these variables that is
    set>/fedtune/results` (e.g. "SCRATCH", "CINECA_SCRATCH"); else `<project>/fedtune/results` where that
    project folder exists; None when there is none (then `results` as the config says)."""
    if os.environ.get("FEDTUNE_SCRATCH"):
        return os.environ["FEDTUNE_SCRATCH"] + "/results"
    root = next((os.environ[name] for name in variables if os.environ.get(name)), None)
    if root:
        return f"{root}/fedtune/results"
    if project is not None and os.path.isdir(project):
        return f"{project}/fedtune/results"
    return None


def choice(variable: str, default: str, *others: str) -> str:
    """A site's switch: the environment variable's value, `default` when it is unset or empty, and an error
    that names the choices for a value that is none of them (e.g. FEDTUNE_KAROLINA_CPU_PARTITION)."""
    value = os.environ.get(variable) or default
    if value not in (default, *others):
        raise ValueError(f"{variable}={value}: use {default} (the default) or {' or '.join(others)}")
    return value
