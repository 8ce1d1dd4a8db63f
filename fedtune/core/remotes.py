"""federation.remotes: each cluster's run folder as rsync names it, how the files it needs reach it (pull or
push) and the ssh options of a login into it (an option that runs a command refused unless the entry
allows it); which remote each cluster needs; and the entries that still hold an example's placeholder."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fedtune.core.options import ConfigError
from fedtune.core.residency import NO_CROSS_SITE


@dataclass(frozen=True)
class Remote:
    """federation.remotes.<cluster>: its run folder as rsync names it, how the files it needs from the
    other clusters reach it (pull: it fetches them; push: their makers send them into its inbox), and
    the ssh options of a login into it."""

    path: str
    transfer: str = "pull"
    ssh_options: tuple[str, ...] = ()
    # transfer push: the same folder through another ssh Host alias, whose key may only write the inbox
    # (the others pull through `path`, with a key that may only read the outbox); None: through `path`.
    push_path: str | None = None

    @property
    def push_to(self) -> str:
        """Where the others push into this cluster's run folder (its exchange/inbox is below it)."""
        return self.push_path or self.path


def _folder(spec: str) -> str:
    """The folder part of an rsync location (`host:folder`, `user@host:folder` or a local path)."""
    return spec.split(":", 1)[1] if re.match(r"^[^/:]+:", spec) else spec


# ssh options that run a command (or load code) on the machine that logs in: the shared config is code
# (yte), and these would make every controller that reads it run what the config says.
COMMAND_SSH_OPTIONS = (
    "proxycommand", "localcommand", "permitlocalcommand", "knownhostscommand", "match",
    "pkcs11provider", "securitykeyprovider",
)  # fmt: skip


def parse_remotes(federation: Mapping) -> dict[str, Remote]:
    """federation.remotes. An ssh option that runs a command (COMMAND_SSH_OPTIONS, in any spelling:
    `Key=value`, `Key value`, `-o Key=value`, any case) is refused unless the entry says
    allow_command_options: true."""
    remotes = {}
    for cluster, entry in federation["remotes"].items():
        if isinstance(entry, str):
            remotes[cluster] = Remote(entry)
            continue
        options = tuple(entry.get("ssh_options", ()))
        if not entry.get("allow_command_options", False):
            for option in options:
                text = re.sub(r"^\s*-o\s*", "", str(option))
                key = re.split(r"[\s=]", text.strip(), maxsplit=1)[0].lower()
                if key in COMMAND_SSH_OPTIONS:
                    raise ConfigError(
                        f"federation.remotes.{cluster}.ssh_options: {option!r} runs a command on every "
                        f"machine that logs into {cluster} ({key}): the shared config is code, and this is "
                        "refused unless you mean it: set federation.remotes."
                        f"{cluster}.allow_command_options: true (docs/transfers.md)"
                    )
        transfer, push_path = entry.get("transfer", "pull"), entry.get("push_path")
        if push_path is not None:
            where = f"federation.remotes.{cluster}.push_path"
            if transfer != "push":
                raise ConfigError(
                    f"{where}: {cluster} takes its files by pull (transfer: {transfer}), so nothing is pushed "
                    f"into it: drop push_path, or set transfer: push"
                )
            if _folder(push_path).rstrip("/") != _folder(entry["path"]).rstrip("/"):
                raise ConfigError(
                    f"{where}: {push_path!r} names another folder than path {entry['path']!r}: it is the same "
                    "run folder reached through another ssh Host alias (the push key's), so only the part "
                    "before the ':' may differ (docs/transfers.md, \"The restricted key\")"
                )
        remotes[cluster] = Remote(entry["path"], transfer, options, push_path)
    return remotes


def check_cluster(
    config: Mapping, sites: Mapping[str, str], aggregate_on: str, remotes: Mapping[str, Remote], source: str
) -> None:
    """`cluster` (set by a cluster's profile) must have work here: a site to train or the aggregate. And
    what it fetches from another cluster (pull, the default) needs that cluster's federation.remotes
    entry. Checked at start, before anything is built (a dry run would otherwise end with nothing to do,
    or deep in the DAG). `sites`: each site's cluster."""
    here = config["cluster"]
    if here is None:
        return  # every site trains here, nothing crosses
    trained = sorted(set(sites.values()))
    known = sorted({*trained, aggregate_on})
    if here not in known:
        raise ConfigError(
            f"{source}: cluster: {here!r} trains no site and does not aggregate (federation.aggregate_on: "
            f"{aggregate_on}): this config's clusters are {', '.join(known)}; check the profile "
            f"(profiles/<cluster>) or --config cluster=..."
        )
    if here in remotes and remotes[here].transfer == "push":
        return  # the others send what it needs into its inbox
    run_dir = Path(config["results"]) / config["run"]
    folder = f"user@host:{run_dir}" if run_dir.is_absolute() else f"user@host:/path/to/{run_dir}"
    if here == aggregate_on:
        # Each other cluster's sites' manifests and models.
        for name, cluster in sites.items():
            if cluster != here and cluster not in remotes:
                raise ConfigError(
                    f"{source}: sites.{name}.cluster: {cluster} has no federation.remotes entry, but "
                    f"{here} (federation.aggregate_on) fetches {name}'s models from it; add under "
                    f"federation.remotes `{cluster}: {folder}` (its run folder, as rsync names it), "
                    f"or `{here}: {{path: ..., transfer: push}}` if {cluster} reaches {here} instead"
                )
    elif aggregate_on not in remotes and (
        config["federation"]["rounds"] > 1 or config["evaluate"]["cross_site"] == NO_CROSS_SITE
    ):
        # Each round's aggregate, which the next round here starts from (and, with evaluate.cross_site
        # none, which this cluster scores on its sites' text: the last round's too).
        mine = ", ".join(name for name, cluster in sites.items() if cluster == here)
        raise ConfigError(
            f"{source}: federation.aggregate_on: {aggregate_on} has no federation.remotes entry, but {here} "
            f"(sites {mine}) fetches each round's aggregate from it; add under federation.remotes "
            f"`{aggregate_on}: {folder}` (its run folder, as rsync names it), or "
            f"`{here}: {{path: ..., transfer: push}}` if {aggregate_on} reaches {here} instead"
        )


# What the examples' federation.remotes hold until they are edited, and what the start checks' advice
# writes (`user@host:/path/to/...`): the IT4I project id dd-00-00, the user `me` on a real login host.
REMOTE_PLACEHOLDERS = (
    re.compile(r"dd-00-00"),
    re.compile(r"^me@[^:/]*\."),
    re.compile(r"^user@host:"),
    re.compile(r"/path/to/"),
    re.compile(r"<[^>]*>"),
)


def placeholder_remotes(remotes: Mapping[str, Remote], clusters: Sequence[str]) -> dict[str, str]:
    """{"<cluster>.path" or "<cluster>.push_path": its value} of the federation.remotes entries of
    `clusters` (those this cluster logs into) that still hold a placeholder."""
    found = {}
    for cluster in clusters:
        if cluster in remotes:
            for key in ("path", "push_path"):
                value = getattr(remotes[cluster], key) or ""
                if any(p.search(value) for p in REMOTE_PLACEHOLDERS):
                    found[f"{cluster}.{key}"] = value
    return found
