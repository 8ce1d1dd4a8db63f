"""A real SSH server on this machine for the multi-cluster tests: fedtune.tools.local_sshd's sshd on a
free local port, with a host key and two user keys made for the session (a pull key and a push key, each
with its Host alias). rsync then reaches `127.0.0.1:/path` through it (RSYNC_RSH), as it reaches another
cluster's login node. RSYNC_RSH carries the ports, the keys and the host-key settings only: BatchMode and
the time limits come from fedtune.core.transfer, as on the clusters. `restrict` confines the two keys to
the run's exchange folder with scripts/fedtune-rsync-gate or rsync's rrsync, as docs/transfers.md tells
an admin to: the pull key (Host `server.host`) read-only on outbox/, the push key (Host
`server.push_host`) write-only on inbox/; `revoke` and `allow` take the keys away and put them back.
Skips (with the reason) only where sshd cannot be had; in CI (CI=true, root) it must run
(tests/conftest.py turns the skip into a failure), and as root it installs Debian's openssh-server first
(the one apt-get: the rehearsal installs nothing)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from fedtune.tools import local_sshd
from fedtune.tools.local_sshd import (  # noqa: F401 (the tests' names)
    GATE,
    SSHServer,
    authorized_key_lines,
    find_sshd,
    stop_sshd,
)


def _sshd() -> str | None:
    """This machine's sshd; as root with apt-get (CI), Debian's openssh-server installed first."""
    found = find_sshd()
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(
            ["apt-get", "install", "-y", "openssh-server"],
            capture_output=True,
            timeout=600,
            env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"),
        )
        found = find_sshd()
    return found


def start_sshd(folder: Path, *, passwords: bool = False) -> SSHServer:
    """fedtune.tools.local_sshd's server, or a skip where no sshd can be had (see the module's docstring)."""
    sshd = _sshd()
    if sshd is None:
        pytest.skip(
            "no sshd here, and `apt-get install -y openssh-server` could not provide one (needs root)"
        )
    return local_sshd.start_sshd(folder, sshd, passwords=passwords)


def restrict(server: SSHServer, directory: Path, tool: str = "gate") -> None:
    """Confine the session's two keys to the run's exchange folder `directory`, one direction each (sshd
    reads authorized_keys at every login): authorized_key_lines."""
    if tool != "gate" and not (shutil.which("rrsync") or Path("/usr/bin/rrsync").is_file()):
        pytest.skip("no rrsync here (Debian's rsync package ships it as /usr/bin/rrsync)")
    (server.folder / "authorized_keys").write_text(authorized_key_lines(server, directory, tool))


def revoke(server: SSHServer) -> str:
    """Take the key away; returns the authorized_keys text, for `allow`."""
    path = server.folder / "authorized_keys"
    text = path.read_text()
    path.write_text("")
    return text


def allow(server: SSHServer, text: str) -> None:
    (server.folder / "authorized_keys").write_text(text)
