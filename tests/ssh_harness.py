"""A real SSH server on this machine for the multi-cluster tests: sshd on a free local port, with a host
key and a user key made for the session. rsync then reaches `127.0.0.1:/path` through it (RSYNC_RSH), as
it reaches another cluster's login node. RSYNC_RSH carries the port, the key and the host-key settings
only: BatchMode and the time limits come from fedtune.core.transfer, as on the clusters. `restrict`
confines the key to the run's exchange folder with scripts/fedtune-rsync-gate (read-only on outbox/,
write-only on inbox/) or rsync's rrsync, as docs/transfers.md tells an admin to; `revoke`
and `allow` take the key away and put it back. Skips (with the reason) only where sshd cannot be had; in
CI (CI=true, root) it must run (tests/conftest.py turns the skip into a failure)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class SSHServer:
    host: str
    rsync_rsh: str
    process: subprocess.Popen
    folder: Path

    def env(self) -> dict[str, str]:
        """The environment under which rsync (and every job started from it) logs in through this server."""
        return dict(os.environ, RSYNC_RSH=self.rsync_rsh)


def _sshd() -> str | None:
    found = shutil.which("sshd") or next((p for p in ("/usr/sbin/sshd",) if Path(p).is_file()), None)
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(
            ["apt-get", "install", "-y", "openssh-server"],
            capture_output=True,
            timeout=600,
            env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"),
        )
        found = shutil.which("sshd") or ("/usr/sbin/sshd" if Path("/usr/sbin/sshd").is_file() else None)
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_sshd(folder: Path, *, passwords: bool = False) -> SSHServer:
    """sshd on a free port that takes the session's key. passwords=True: it also offers password
    logins, as a login node does, so a client without a usable key is asked for a password."""
    sshd = _sshd()
    if sshd is None:
        pytest.skip(
            "no sshd here, and `apt-get install -y openssh-server` could not provide one (needs root)"
        )
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / name)], check=True)
    shutil.copy(folder / "user_key.pub", folder / "authorized_keys")
    port = _free_port()
    config = folder / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {folder / 'host_key'}\nPidFile {folder / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {folder / 'authorized_keys'}\nStrictModes no\nUsePAM no\n"
        f"PasswordAuthentication {'yes' if passwords else 'no'}\nKbdInteractiveAuthentication no\n"
        f"PermitRootLogin {'yes' if passwords else 'prohibit-password'}\n"
    )
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation folder
    process = subprocess.Popen(
        [sshd, "-D", "-e", "-f", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=open(folder / "sshd.log", "w"),
    )
    rsh = (
        f"ssh -p {port} -i {folder / 'user_key'} -o IdentitiesOnly=yes -o StrictHostKeyChecking=no"
        " -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        probe = subprocess.run(
            [*rsh.split(), "-o", "BatchMode=yes", "127.0.0.1", "true"], capture_output=True, text=True
        )
        if probe.returncode == 0:
            return SSHServer("127.0.0.1", rsh, process, folder)
        if process.poll() is not None:
            break
        time.sleep(0.3)
    process.terminate()
    raise RuntimeError(f"sshd did not take a login: {(folder / 'sshd.log').read_text()[-2000:]}")


def stop_sshd(server: SSHServer) -> None:
    server.process.terminate()
    server.process.wait(timeout=10)


GATE = Path(__file__).resolve().parent.parent / "scripts" / "fedtune-rsync-gate"


def authorized_key_line(server: SSHServer, directory: Path, tool: str = "gate") -> str:
    """The authorized_keys line of docs/transfers.md for a run's exchange folder `directory`. tool "gate"
    (the default): scripts/fedtune-rsync-gate, which lets the key run only rsync's server mode, sending
    from `directory`/outbox and receiving into `directory`/inbox, nothing else. "rrsync-ro" / "rrsync-wo":
    rsync's rrsync, read-only on the outbox or write-only on the inbox (a key for one direction), with
    absolute paths under it allowed (-absolute: the same remote path works with and without the
    restriction), no lock (parallel transfers) and links munged. restrict: no terminal, no forwarding."""
    key = (server.folder / "user_key.pub").read_text().strip()
    if tool == "gate":
        rsync = shutil.which("rsync") or "rsync"
        command = f"{GATE} --read {directory / 'outbox'} --write {directory / 'inbox'} --rsync {rsync}"
    else:
        rrsync = shutil.which("rrsync") or "/usr/bin/rrsync"
        side = {"rrsync-ro": "-ro", "rrsync-wo": "-wo"}[tool]
        folder = directory / ("outbox" if tool == "rrsync-ro" else "inbox")
        command = f"{rrsync} {side} -absolute -no-lock -munge {folder}"
    return f'command="{command}",restrict {key}\n'


def restrict(server: SSHServer, directory: Path, tool: str = "gate") -> None:
    """Confine the session's key to the run's exchange folder `directory` (sshd reads authorized_keys at
    every login): authorized_key_line."""
    if tool != "gate" and not (shutil.which("rrsync") or Path("/usr/bin/rrsync").is_file()):
        pytest.skip("no rrsync here (Debian's rsync package ships it as /usr/bin/rrsync)")
    (server.folder / "authorized_keys").write_text(authorized_key_line(server, directory, tool))


def revoke(server: SSHServer) -> str:
    """Take the key away; returns the authorized_keys text, for `allow`."""
    path = server.folder / "authorized_keys"
    text = path.read_text()
    path.write_text("")
    return text


def allow(server: SSHServer, text: str) -> None:
    (server.folder / "authorized_keys").write_text(text)
