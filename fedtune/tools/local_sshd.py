"""A real SSH server on this machine: sshd on a free local port, with a host key and two user keys made
for it, so that rsync reaches `127.0.0.1:/path` through it (RSYNC_RSH) as it reaches another cluster's
login node. As docs/transfers.md sets up a cluster that is both pulled from and pushed into, each key has
its own Host alias in an ssh config of the server's folder: `127.0.0.1` (or `fedtune-pull`) logs in with
the pull key, `fedtune-push` with the push key, so that each can be confined to one direction. RSYNC_RSH
is `ssh -F <that config>`: ports, keys and host-key settings only; BatchMode and the time limits come
from fedtune.core.transfer, as on the clusters. scripts/rehearse (fedtune.tools.rehearsal) runs its
two controllers over it; the tests' harness (tests/ssh_harness.py) builds on it. It installs nothing:
`find_sshd` says whether this machine has an sshd."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class SSHServer:
    host: str
    rsync_rsh: str
    process: subprocess.Popen
    folder: Path
    # The Host alias that logs in with the push key (push_key in `folder`); `host` logs in with user_key.
    push_host: str = "fedtune-push"

    def env(self) -> dict[str, str]:
        """The environment under which rsync (and every job started from it) logs in through this server."""
        return dict(os.environ, RSYNC_RSH=self.rsync_rsh)


def find_sshd() -> str | None:
    """This machine's sshd, or None."""
    return shutil.which("sshd") or next((p for p in ("/usr/sbin/sshd",) if Path(p).is_file()), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_sshd(folder: Path, sshd: str, *, passwords: bool = False) -> SSHServer:
    """`sshd` (a path, find_sshd) on a free port that takes the key made in `folder`. passwords=True: it
    also offers password logins, as a login node does, so a client without a usable key is asked for a
    password. RuntimeError when it takes no login within 20 s."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("host_key", "user_key", "push_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / name)], check=True)
    (folder / "authorized_keys").write_text(
        (folder / "user_key.pub").read_text() + (folder / "push_key.pub").read_text()
    )
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
        stderr=open(folder / "sshd.log", "w"),  # noqa: SIM115 (sshd writes it while it runs)
    )
    # One Host block per key (IdentitiesOnly: ssh offers that key alone, so the server's line for it, and
    # its direction, is the one that applies).
    hosts = {"127.0.0.1 fedtune-pull": "user_key", "fedtune-push": "push_key"}
    (folder / "ssh_config").write_text(
        "".join(
            f"Host {names}\n    HostName 127.0.0.1\n    Port {port}\n    IdentityFile {folder / key}\n"
            for names, key in hosts.items()
        )
        + "Host *\n    IdentitiesOnly yes\n    StrictHostKeyChecking no\n    UserKnownHostsFile /dev/null\n"
        "    LogLevel ERROR\n"
    )
    rsh = f"ssh -F {folder / 'ssh_config'}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        probe = [
            subprocess.run(
                [*rsh.split(), "-o", "BatchMode=yes", host, "true"], capture_output=True, text=True
            )
            for host in ("127.0.0.1", "fedtune-push")
        ]
        if all(p.returncode == 0 for p in probe):
            return SSHServer("127.0.0.1", rsh, process, folder)
        if process.poll() is not None:
            break
        time.sleep(0.3)
    process.terminate()
    raise RuntimeError(f"sshd did not take a login: {(folder / 'sshd.log').read_text()[-2000:]}")


def stop_sshd(server: SSHServer) -> None:
    server.process.terminate()
    server.process.wait(timeout=10)


GATE = Path(__file__).resolve().parents[2] / "scripts" / "fedtune-rsync-gate"


def authorized_key_lines(server: SSHServer, exchange: Path, tool: str = "gate") -> str:
    """The two authorized_keys lines of docs/transfers.md ("The restricted key") for a run's exchange
    folder: the pull key (user_key, Host `server.host`) read-only on `exchange`/outbox, the push key
    (push_key, Host `server.push_host`) write-only on `exchange`/inbox. tool "gate" (the default):
    scripts/fedtune-rsync-gate, which lets a key run only rsync's server mode in its one direction and
    folder. "rrsync": rsync's rrsync -ro / -wo, with absolute paths under its folder allowed (-absolute:
    the same remote path works with and without the restriction), no lock (parallel transfers) and links
    munged. restrict: no terminal, no forwarding."""
    rsync = shutil.which("rsync") or "rsync"
    rrsync = shutil.which("rrsync") or "/usr/bin/rrsync"
    lines = []
    for key, side, folder in (("user_key", "read", "outbox"), ("push_key", "write", "inbox")):
        public = (server.folder / f"{key}.pub").read_text().strip()
        if tool == "gate":
            command = f"{GATE} --{side} {exchange / folder} --rsync {rsync}"
        else:
            command = (
                f"{rrsync} {'-ro' if side == 'read' else '-wo'} -absolute -no-lock -munge {exchange / folder}"
            )
        lines.append(f'command="{command}",restrict {public}\n')
    return "".join(lines)
