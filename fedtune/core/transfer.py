"""transfer: models and manifests cross between clusters with rsync, unattended (docs/running.md, "Multi-cluster
federation").

    python -m fedtune.core.transfer mark --path results/<run>/round-1/beta/model \\
        --outbox results/<run>/exchange/outbox/round-1/beta/model
    python -m fedtune.core.transfer fetch --source user@host:/path/results/<run>/exchange/outbox/round-1/beta/model \\
        --out results/<run>/round-1/beta/model --wait 3d --remote karolina --round 1 --what "beta's model"
    python -m fedtune.core.transfer push --run results/<run> --item round-1/aggregate/model \\
        --to user@host:/path/results/<run> --wait 3d --remote karolina --round 1 --what "the aggregate"
    python -m fedtune.core.transfer receive --run results/<run> --item round-1/aggregate/model --wait 3d ...

A folder (or file) is complete when its maker says so: `mark` writes `<name>.COMPLETE` beside it, after
the folder's atomic rename, with the sha256 of each of its files (sha256sum's format: `sha256sum -c` in
the parent folder checks it). Nothing without that marker is taken. With --outbox it also publishes the
item: hard links of its files (a copy where links cannot be made) under <run>/exchange/outbox/<item>, its
marker last. Everything another cluster reads or writes is under <run>/exchange (outbox/ and inbox/), so an
ssh key confined there (rsync's rrsync; docs/transfers.md) is all a remote login needs.

- fetch (the receiver logs in): waits until the source's marker is there, polling with backoff up to
  --wait, copies the folder under a temporary name, verifies every file against the marker and renames
  the copy into place. A copy that fails verification is deleted and fetched again.
- push (the maker logs in): copies the item into the receiver's run folder, under exchange/inbox/, has rsync
  compare every file by checksum (sending again what differs), and sends the marker last. It waits (with
  backoff) while the receiver's run folder cannot be reached.
- receive (the receiver of a push): waits for the marker in its own inbox, verifies, and moves the item
  into place. A copy that fails verification is deleted; the wait goes on for the next push.

While waiting each prints a line naming the remote, the round, what it waits for and how long it has
waited; at --wait it fails with what to check where, and leaves nothing partial behind.

No transfer can hang: ssh runs with BatchMode (it never prompts for a password or passphrase: nobody
watches a controller in tmux), a connect timeout and a server-alive check; rsync with --timeout (no data
for that long ends it); and every rsync call with a time limit of its own, after which its whole process
group is killed. A failed call is named by its host and its reason (login refused, host key, no
connection, silence) and retried with backoff within --wait, so a key or certificate put back while the
transfer waits is picked up by its next look."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fedtune.core import cli
from fedtune.core.atomic import atomic_dir, remove_stale, write_text
from fedtune.core.checksums import sha256_file
from fedtune.core.config import UserError, parse_duration

MARKER = ".COMPLETE"
# What other clusters reach, and nothing else: an ssh key confined to <run>/exchange suffices.
EXCHANGE = "exchange"
INBOX = f"{EXCHANGE}/inbox"
OUTBOX = f"{EXCHANGE}/outbox"
# Exit codes of rsync that mean "the source is not there (yet)": 23 partial transfer (a missing file),
# 24 vanished source files. Everything else (255: ssh could not connect) is retried as well, and named.
NOT_THERE = {23, 24}
# 30: no data sent or received for --timeout seconds.
STALLED = 30
ATTEMPTS = 3


class TransferError(UserError):
    """A transfer that failed or timed out: the message names the remote, the round and what to check."""


def marker_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + MARKER)


def marker_text(path: str | Path) -> str:
    """sha256sum lines for every file of `path` (a folder or a file), named relative to its parent."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return "".join(f"{sha256_file(p)}  {p.relative_to(path.parent).as_posix()}\n" for p in files)


def mark(path: str | Path, outbox: str | Path | None = None) -> Path:
    """Write the marker of a finished folder or file (atomically, after it is in place); with `outbox`,
    publish both there too (publish)."""
    path = Path(path)
    if not path.exists():
        raise TransferError(f"--path: {path} does not exist: nothing to mark complete")
    marker = marker_path(path)
    text = marker_text(path)
    write_text(marker, text)
    if outbox is not None:
        publish(path, Path(outbox), text)
    return marker


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system, or links refused: a copy costs space, not correctness
        shutil.copy2(source, target)


def publish(path: Path, outbox: Path, text: str) -> None:
    """Put `path` at `outbox` as hard links (no second copy of a model on disk), then its marker. The
    old marker goes first, so a remote never takes a half-replaced item for a complete one."""
    marker_path(outbox).unlink(missing_ok=True)
    if path.is_dir():
        with atomic_dir(outbox) as tmp:
            for source in sorted(path.rglob("*")):
                target = tmp / source.relative_to(path)
                if source.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    _link_or_copy(source, target)
    else:
        outbox.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(outbox)
        tmp = outbox.with_name(f".{outbox.name}.tmp-link")
        tmp.unlink(missing_ok=True)
        _link_or_copy(path, tmp)
        tmp.replace(outbox)
    write_text(marker_path(outbox), text)


def parse_marker(text: str, where: str) -> dict[str, str]:
    sums = {}
    for line in text.splitlines():
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64:
            raise TransferError(f"{where}: not a sha256 list (line {line!r})")
        sums[name] = digest
    return sums


def verify(path: Path, sums: dict[str, str], name: str) -> str | None:
    """Why the copy at `path` (standing for `name`, as the marker names it) differs from the marker's
    list, or None when every file is there with its sha256 and there is nothing else."""
    if path.is_dir():
        found = {f"{name}/{p.relative_to(path).as_posix()}": p for p in path.rglob("*") if p.is_file()}
    else:
        found = {name: path} if path.exists() else {}
    missing = sorted(set(sums) - set(found))
    extra = sorted(set(found) - set(sums))
    if missing or extra:
        return f"files missing {missing[:3]} or not in the marker {extra[:3]}"
    for relative, digest in sums.items():
        if sha256_file(found[relative]) != digest:
            return f"{relative}: sha256 differs from the marker's"
    return None


@dataclass(frozen=True)
class Link:
    """How rsync reaches another cluster: its ssh options (federation.remotes.<c>.ssh_options) and the
    time limits (federation.connect_timeout, io_timeout, transfer_timeout)."""

    ssh_options: tuple[str, ...] = ()
    connect_timeout: int = 30
    io_timeout: int = 300
    transfer_timeout: float = 6 * 3600.0

    def rsh(self) -> str:
        """rsync's -e: $RSYNC_RSH (default ssh) with options that keep it from prompting or hanging.
        ssh takes the first value given for an option: BatchMode comes first so nothing turns it off;
        the remote's own options come before the timeouts, so that they may change those. Either beats
        ~/.ssh/config, where ports, users and keys belong (docs/transfers.md)."""
        base = os.environ.get("RSYNC_RSH", "").strip() or "ssh"
        alive = max(1, min(30, self.io_timeout // 4))
        options = [
            "BatchMode=yes",
            *self.ssh_options,
            f"ConnectTimeout={self.connect_timeout}",
            f"ServerAliveInterval={alive}",
            "ServerAliveCountMax=4",
        ]
        return " ".join([base, *(f"-o {option}" for option in options)])


@dataclass(frozen=True)
class Outcome:
    """What one rsync call did: its exit code and output, and whether its time limit ended it."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False


def _run(command: list[str], timeout: float) -> Outcome:
    """Run `command` in a session of its own (no terminal that ssh could prompt on), killing its whole
    process group at `timeout`: killing rsync alone would leave ssh holding the pipes open."""
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        return Outcome(-signal.SIGKILL, out, err, timed_out=True)
    return Outcome(process.returncode, out, err)


def _rsync(*args: str, rsync: str = "rsync", link: Link = Link()) -> Outcome:
    command = [rsync, "-e", link.rsh(), f"--timeout={link.io_timeout}", *args]
    return _run(command, link.transfer_timeout)


def host_of(spec: str) -> str | None:
    """The host of an rsync path (user@host:/path -> user@host), None for a local path (rsync's rule:
    a colon before any slash)."""
    head, sep, _ = spec.partition(":")
    return head if sep and head and "/" not in head else None


# What ssh (and rrsync) print, as lower case, and what it means for the user; the first match wins.
REASONS = (
    (
        ("permission denied",),
        "login refused (Permission denied): no key, agent or certificate that the host accepts, and "
        "BatchMode never asks for a password. Check `ssh-add -l`, the certificate's expiry, the "
        "IdentityFile of its Host block and the authorized_keys line there",
    ),
    (
        ("host key verification failed", "remote host identification has changed"),
        "host key unknown or changed (Host key verification failed): log in once by hand to accept it, "
        "after checking its fingerprint against the site's documentation",
    ),
    (
        ("connection timed out", "operation timed out", "timed out during banner exchange"),
        "no connection within the connect timeout (federation.connect_timeout): is the host up, are "
        "its name and port right?",
    ),
    (
        ("connection refused",),
        "connection refused: wrong port (a Host block's Port: MeluXina listens on 8822) or no sshd",
    ),
    (
        ("could not resolve hostname", "name or service not known"),
        "unknown host name: no such DNS name and no Host block for it in ~/.ssh/config",
    ),
    (
        ("not responding",),
        "the connection went silent (ssh's ServerAliveInterval gave up)",
    ),
    (
        ("restricted directory does not exist",),
        "the folder its key is confined to (rrsync) is not there yet: the run's exchange folder, "
        "which that cluster's controller makes with its first transfer job",
    ),
    (
        ("rrsync",),
        "the restricted key (rrsync) refused the request: does its folder exist, and is it the run's "
        "exchange folder?",
    ),
)


def _missing_behind_rrsync(result: Outcome) -> bool:
    """A missing source seen through a restricted key: rrsync stops before rsync would say 23."""
    text = result.stderr.lower()
    return "rrsync" in text and "no such file or directory" in text


def _said(result: Outcome, spec: str = "", link: Link = Link()) -> str:
    """Why an rsync call to `spec` failed, in a line that names the host and the reason."""
    host = host_of(spec)
    where = f"{host}: " if host else ""
    if result.timed_out:
        return (
            f"{where}stopped after {_duration(link.transfer_timeout)} (federation.transfer_timeout): the "
            "rsync call did not finish"
        )
    lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
    said = f"rsync exit {result.returncode}: {' | '.join(lines[-3:])}"
    if result.returncode == STALLED:
        return f"{where}no data moved for {link.io_timeout} s (federation.io_timeout) ({said})"
    text = result.stderr.lower()
    for needles, reason in REASONS:
        if any(needle in text for needle in needles):
            return f"{where}{reason} ({said})"
    return f"{where}{said}"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Waiter:
    """Polls with backoff (first after `first` seconds, each wait 1.5 times the last, at most `most`) until
    `wait` seconds have passed, printing where it waits."""

    def __init__(self, wait: float, label: str, *, first: float = 2.0, most: float = 300.0):
        self.wait, self.label = wait, label
        self.started = time.monotonic()
        self.pause = min(first, most)
        self.most = most

    @property
    def waited(self) -> float:
        return time.monotonic() - self.started

    def sleep(self, why: str) -> bool:
        """Sleep before the next look; False once the wait is over."""
        left = self.wait - self.waited
        if left <= 0:
            return False
        pause = min(self.pause, left)
        print(
            f"[transfer] waiting for {self.label}: {_duration(self.waited)} of {_duration(self.wait)} waited"
            f" ({why}); next look in {_duration(pause)}",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(pause)
        self.pause = min(self.pause * 1.5, self.most)
        return True


def _timeout(waiter: Waiter, where: str, last: str, check: str) -> TransferError:
    return TransferError(
        f"gave up waiting for {waiter.label} after {_duration(waiter.waited)} (federation.wait): {where} "
        f"(last look: {last}). {check} Then run this command again: finished work is kept."
    )


def _wait_for(look: Callable[[], str | None], waiter: Waiter, where: str, check: str) -> None:
    """Call `look` (None: found; else why not) until it finds, or raise the timeout error."""
    while (why := look()) is not None:
        if not waiter.sleep(why):
            raise _timeout(waiter, where, why, check)


class _Retry(Exception):
    """A copy that failed verification: atomic_dir deletes it, the loop fetches again."""


def _name(source: str) -> str:
    """The last path component of an rsync source (host:/a/b/model -> model)."""
    return source.rsplit("/", 1)[-1].rsplit(":", 1)[-1]


def fetch(
    source: str, out: str | Path, *, wait: float = 0, label: str = "", check: str = "",
    rsync: str = "rsync", first: float = 2.0, most: float = 300.0, link: Link = Link(),
) -> Path:  # fmt: skip
    """Pull `source` (a folder or file another cluster marked complete) into `out`. A call that fails
    (no connection, login refused, a stall) is retried with backoff up to `wait`; a copy that fails
    verification is fetched again at once, at most ATTEMPTS times."""
    out = Path(out)
    if shutil.which(rsync) is None:
        raise TransferError(f"{rsync} not found: install rsync to fetch models from other clusters")
    source = source.rstrip("/")
    name = out.name
    waiter = Waiter(wait, label or source, first=first, most=most)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{name}.tmp-marker-") as scratch:
        local_marker = Path(scratch) / "marker"

        def look_for_marker() -> str | None:
            result = _rsync("-a", source + MARKER, str(local_marker), rsync=rsync, link=link)
            if result.returncode == 0:
                return None
            if result.returncode in NOT_THERE or _missing_behind_rrsync(result):
                return f"no {source + MARKER} yet"
            return _said(result, source, link)

        _wait_for(look_for_marker, waiter, f"{source + MARKER} never appeared", check)
        sums = parse_marker(local_marker.read_text(), source + MARKER)
        is_dir = any("/" in key for key in sums)
        rejected = 0

        def copy_once() -> tuple[str | None, bool]:
            """(why the copy is not in place, whether it arrived and failed verification)."""
            if is_dir:
                problem, arrived = None, False
                try:
                    with atomic_dir(out) as tmp:
                        result = _rsync("-a", f"{source}/", f"{tmp}/", rsync=rsync, link=link)
                        arrived = result.returncode == 0
                        problem = verify(tmp, sums, _name(source)) if arrived else _said(result, source, link)
                        if problem:
                            raise _Retry  # atomic_dir deletes the copy
                except _Retry:
                    pass
                return problem, arrived
            tmp = out.with_name(f".{name}.tmp-file")
            result = _rsync("-a", source, str(tmp), rsync=rsync, link=link)
            arrived = result.returncode == 0
            problem = verify(tmp, sums, _name(source)) if arrived else _said(result, source, link)
            if problem:
                tmp.unlink(missing_ok=True)
            else:
                tmp.replace(out)
            return problem, arrived

        def copy() -> str | None:
            nonlocal rejected
            while True:
                problem, arrived = copy_once()
                if problem is None or not arrived:
                    return problem  # None: done; else the call failed: wait, then try again
                rejected += 1
                if rejected >= ATTEMPTS:
                    raise TransferError(
                        f"{label or source}: the copy failed verification {ATTEMPTS} times ({problem}); "
                        f"deleted. {check}"
                    )

        _wait_for(copy, waiter, f"could not copy {source}", check)
    print(f"[transfer] fetched {source} -> {out}, every file checked against its sha256", file=sys.stderr)
    return out


def push(
    run: str | Path, item: str, to: str, *, wait: float = 0, label: str = "", check: str = "",
    rsync: str = "rsync", first: float = 2.0, most: float = 300.0, link: Link = Link(),
) -> str:  # fmt: skip
    """Send run/item (marked complete here, or marked now) into `to`/exchange/inbox/item, marker last."""
    run = Path(run)
    local = run / item
    if not local.exists():
        raise TransferError(f"{local} does not exist: nothing to push")
    text = marker_text(local)
    inbox = f"{to.rstrip('/')}/{INBOX}/"
    # --relative with /./ recreates item's folders under the inbox (rsync makes only the last level).
    args = ["-a", "--relative", "--delete", f"{run}/./{item}"]
    if local.is_dir():
        args[-1] += "/"
    waiter = Waiter(wait, label or f"{to} to take {item}", first=first, most=most)
    pushed = ""

    def send() -> str | None:
        nonlocal pushed
        result = _rsync(*args, inbox, rsync=rsync, link=link)
        if result.returncode:
            return _said(result, to, link)
        # Every file compared by checksum: what differs is listed (and sent again on the next look).
        check_run = _rsync("-c", "-n", "-i", *args, inbox, rsync=rsync, link=link)
        differs = [line for line in check_run.stdout.splitlines() if line[:1] in "<>ch*"]
        if check_run.returncode or differs:
            return f"copy differs from the original: {differs[:3] or _said(check_run, to, link)}"
        with tempfile.TemporaryDirectory() as scratch:
            marker = Path(scratch) / item
            marker = marker.with_name(marker.name + MARKER)
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(text)
            result = _rsync("-a", "--relative", f"{scratch}/./{item}{MARKER}", inbox, rsync=rsync, link=link)
        if result.returncode:
            return _said(result, to, link)
        pushed = inbox + item
        return None

    _wait_for(send, waiter, f"could not put {item} into {inbox}", check)
    print(f"[transfer] pushed {local} -> {pushed}, checked, marked complete", file=sys.stderr)
    return pushed


def receive(
    run: str | Path, item: str, out: str | Path, *, wait: float = 0, label: str = "", check: str = "",
    first: float = 2.0, most: float = 300.0,
) -> Path:  # fmt: skip
    """Wait for `item` pushed into run/exchange/inbox by its maker, verify it, and move it to `out`."""
    staged = Path(run) / INBOX / item
    # The inbox exists from the first wait on, so that the first push (which makes only the last
    # level of its destination, and through a restricted key nothing outside it) finds it.
    (Path(run) / INBOX).mkdir(parents=True, exist_ok=True)
    marker = marker_path(staged)
    out = Path(out)
    waiter = Waiter(wait, label or str(staged), first=first, most=most)
    rejected = ""

    def look() -> str | None:
        nonlocal rejected
        if not marker.is_file():
            earlier = (
                f"; an earlier copy failed verification ({rejected}) and was deleted" if rejected else ""
            )
            return f"no {marker} yet{earlier}"
        problem = verify(staged, parse_marker(marker.read_text(), str(marker)), staged.name)
        if problem:
            rejected = problem
            marker.unlink(missing_ok=True)
            if staged.is_dir():
                shutil.rmtree(staged, ignore_errors=True)
            else:
                staged.unlink(missing_ok=True)
            return f"the copy failed verification ({problem}); deleted, waiting for it to be sent again"
        return None

    _wait_for(look, waiter, f"{marker} never appeared", check)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.is_dir():
        shutil.rmtree(out)
    os.replace(staged, out)
    marker.unlink()
    print(f"[transfer] received {staged} -> {out}, every file checked against its sha256", file=sys.stderr)
    return out


def _wait_options(parser) -> None:
    parser.add_argument("--wait", default="0", help="how long to wait: seconds, or 90m, 3d (federation.wait)")
    parser.add_argument("--remote", default="", help="the other cluster, for the messages")
    parser.add_argument("--round", default="", help="the federation round, for the messages")
    parser.add_argument("--what", default="", help="what is waited for, for the messages")
    parser.add_argument("--check", default="", help="what to check where, when the wait ends unfulfilled")
    parser.add_argument("--poll", type=float, default=2.0, help="seconds before the first look again (2)")
    parser.add_argument(
        "--poll-max",
        type=float,
        default=None,
        help="most seconds between looks (a hundredth of --wait, 2 to 300)",
    )


def _link_options(parser) -> None:
    defaults = Link()
    parser.add_argument(
        "--ssh-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an ssh -o option for the other cluster (federation.remotes.<c>.ssh_options); repeatable",
    )
    parser.add_argument(
        "--connect-timeout",
        type=int,
        default=defaults.connect_timeout,
        help=f"seconds ssh may take to connect (federation.connect_timeout, {defaults.connect_timeout})",
    )
    parser.add_argument(
        "--io-timeout",
        type=int,
        default=defaults.io_timeout,
        help=f"seconds without data before rsync stops (federation.io_timeout, {defaults.io_timeout})",
    )
    parser.add_argument(
        "--transfer-timeout",
        default=f"{defaults.transfer_timeout:g}",
        help="the longest one rsync call may run: seconds, or 90m, 12h (federation.transfer_timeout)",
    )


def _link(args) -> Link:
    return Link(
        ssh_options=tuple(args.ssh_option),
        connect_timeout=args.connect_timeout,
        io_timeout=args.io_timeout,
        transfer_timeout=parse_duration(args.transfer_timeout, "--transfer-timeout"),
    )


def _label(args) -> str:
    parts = [args.what or "it"]
    if args.round not in ("", "0"):
        parts.append(f"of round {args.round}")
    if args.remote:
        parts.append(f"from {args.remote}" if args.command != "push" else f"to {args.remote}")
    return " ".join(parts)


@cli.entry("fedtune.core.transfer")
def main(argv=None) -> int:
    parser = cli.parser("fedtune.core.transfer", __doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    marking = commands.add_parser("mark", help="write <path>.COMPLETE with the sha256 of its files")
    marking.add_argument("--path", required=True)
    marking.add_argument(
        "--out", default=None, help="the marker's path (the workflow's output); default beside"
    )
    marking.add_argument(
        "--outbox", default=None, help="also publish it there, as hard links, its marker last"
    )
    fetching = commands.add_parser("fetch", help="pull a marked folder or file from another cluster")
    fetching.add_argument("--source", required=True, help="rsync source: a folder or a file")
    cli.add_out(fetching, "the output")
    _wait_options(fetching)
    _link_options(fetching)
    pushing = commands.add_parser("push", help="send a folder or file into another cluster's inbox")
    pushing.add_argument("--run", required=True, help="this cluster's run folder")
    pushing.add_argument("--item", required=True, help="the path inside the run folder")
    pushing.add_argument("--to", required=True, help="the other cluster's run folder, as rsync reaches it")
    pushing.add_argument("--receipt", default=None, help="a file written once the push is complete")
    _wait_options(pushing)
    _link_options(pushing)
    receiving = commands.add_parser("receive", help="wait for a pushed folder or file and take it")
    receiving.add_argument("--run", required=True, help="this cluster's run folder")
    receiving.add_argument("--item", required=True, help="the path inside the run folder")
    cli.add_out(receiving, "the output")
    _wait_options(receiving)
    args = parser.parse_args(argv)

    if args.command == "mark":
        marker = mark(args.path, args.outbox)
        if args.out and Path(args.out) != marker:
            write_text(args.out, marker.read_text())
        return 0
    wait = parse_duration(args.wait, "--wait") if str(args.wait).strip() not in ("0", "") else 0.0
    # Short waits look often (tests, a shared file system); long ones every 5 minutes at most.
    most = args.poll_max if args.poll_max is not None else max(2.0, min(300.0, wait / 100))
    common = dict(wait=wait, label=_label(args), check=args.check, first=args.poll, most=most)
    if args.command == "fetch":
        fetch(args.source, args.out, **common, link=_link(args))
    elif args.command == "push":
        pushed = push(args.run, args.item, args.to, **common, link=_link(args))
        if args.receipt:
            write_text(args.receipt, pushed + "\n")
    else:
        receive(args.run, args.item, args.out, **common)
    return 0


if __name__ == "__main__":
    sys.exit(main())
