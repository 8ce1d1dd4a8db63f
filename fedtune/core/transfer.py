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
item: a copy of its files (a reflink where the file system has them, never a hard link: the other cluster
must not reach a live file) under <run>/exchange/outbox/<item>, its marker last. Everything another
cluster reads or writes is under <run>/exchange (outbox/ and inbox/), so an ssh key confined there
(scripts/fedtune-rsync-gate, or rsync's rrsync -ro / -wo; docs/transfers.md) is all a remote login needs.

What arrives is untrusted: only regular files and folders are taken (rsync without links, devices or
special files, and `verify` walks without following links: a link, FIFO or device anywhere is refused by
name), a marker may name only paths inside its item, and a weight index may name only plain files of its
own folder. The sha256 list comes from the same peer: it catches corruption, not tampering.

- fetch (the receiver logs in): waits until the source's marker is there, polling with backoff up to
  --wait, copies the folder under a temporary name, verifies every file against the marker and renames
  the copy into place. A copy that fails verification is deleted and fetched again.
- push (the maker logs in): withdraws the item's old marker from the receiver's inbox (so that a copy
  being replaced is never taken for a complete one), copies the item into the receiver's run folder, under
  exchange/inbox/, has rsync compare every file by checksum (sending again what differs), and sends the
  marker last. It waits (with backoff) while the receiver's run folder cannot be reached.
- receive (the receiver of a push): waits for the marker in its own inbox, copies the item out of it
  (regular files only, opened without following links), verifies the copy and renames it into place. The
  inbox item stays until a new push replaces it, so a deleted received output is received again without
  the sender. A copy that fails verification is deleted; the wait goes on for the next push.

While waiting each prints a line naming the remote, the round, what it waits for and how long it has
waited; at --wait it fails with what to check where, and leaves nothing partial behind.

No transfer can hang: ssh runs with BatchMode (it never prompts for a password or passphrase: nobody
watches a controller in tmux), a connect timeout and a server-alive check; rsync with --timeout (no data
for that long ends it); and every rsync call with a time limit of its own, after which its whole process
group is killed. A failed call is named by its host and its reason (login refused, host key, no
connection, silence) and retried with backoff within --wait, so a key or certificate put back while the
transfer waits is picked up by its next look."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fedtune.core import cli
from fedtune.core.atomic import atomic_dir, remove_stale, write_text
from fedtune.core.checksums import model_identity, sha256_file
from fedtune.core.durations import parse_duration
from fedtune.core.options import UserError

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
# rsync's options for what crosses: recursive, times kept, and nothing but regular files and folders (no
# -a: it implies links, devices and special files, which a peer could use to point at this cluster's own
# files or block a reader).
COPY = ("-rt", "--no-links", "--no-specials", "--no-devices")
# linux/fs.h: FICLONE, a copy-on-write clone of a whole file (btrfs, XFS with reflink, bcachefs, ZFS 2.2).
FICLONE = 0x40049409


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


def clone_or_copy(source: int | str | Path, target: str | Path) -> str:
    """Write a new file `target` with the bytes of `source` (a path or an open descriptor): a reflink
    (FICLONE: shares the blocks until either side writes, so writing one never changes the other) where
    the file system has them, else an in-kernel copy (copy_file_range), else a read-write copy. Never a
    hard link. Returns "reflink" or "copy"."""
    # A path is this cluster's own file (publish); a descriptor was opened without following links.
    src = source if isinstance(source, int) else os.open(source, os.O_RDONLY)
    try:
        dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            try:
                fcntl.ioctl(dst, FICLONE, src)
                return "reflink"
            except OSError:
                pass
            size, done = os.fstat(src).st_size, 0
            os.lseek(src, 0, os.SEEK_SET)
            try:
                while done < size and (n := os.copy_file_range(src, dst, size - done)):
                    done += n
            except OSError as error:  # an old kernel or a file system without it: copy by hand
                if error.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                os.lseek(src, done, os.SEEK_SET)
                while chunk := os.read(src, 16 << 20):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(dst, view) :]
            return "copy"
        finally:
            os.close(dst)
    finally:
        if not isinstance(source, int):
            os.close(src)


def publish(path: Path, outbox: Path, text: str) -> None:
    """Put a copy of `path` at `outbox` (clone_or_copy: a reflink where the file system allows, never a
    hard link, so that nothing the other cluster does to the outbox reaches the live item), written under
    a temporary name and renamed, then its marker. The old marker goes first, so a remote never takes a
    half-replaced item for a complete one."""
    marker_path(outbox).unlink(missing_ok=True)
    if path.is_dir():
        with atomic_dir(outbox) as tmp:
            for source in sorted(path.rglob("*")):
                target = tmp / source.relative_to(path)
                if source.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    clone_or_copy(source, target)
    else:
        outbox.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(outbox)
        tmp = outbox.with_name(f".{outbox.name}.tmp-copy")
        tmp.unlink(missing_ok=True)
        clone_or_copy(path, tmp)
        tmp.replace(outbox)
    write_text(marker_path(outbox), text)


def parse_marker(text: str, where: str) -> dict[str, str]:
    """{path: sha256} of a marker. Each path must lie inside the item: relative, without `..` or empty
    parts (a peer's marker is untrusted)."""
    sums = {}
    for line in text.splitlines():
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise TransferError(f"{where}: not a sha256 list (line {line!r})")
        parts = name.split("/")
        if name.startswith("/") or any(part in ("", ".", "..") for part in parts) or "\\" in name:
            raise TransferError(f"{where}: names {name!r}, which is not a path inside the item: refused")
        sums[name] = digest
    return sums


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def _not_regular(path: Path, shown: str, mode: int) -> str:
    kind = _kind(mode)
    if stat.S_ISLNK(mode):
        kind += f" to {os.readlink(path)}"
    return f"{shown}: {kind}, not a regular file or folder: refused"


def regular_files(path: Path, name: str) -> tuple[dict[str, Path], str | None]:
    """The regular files of `path` (a folder or a file, standing for `name`), keyed as a marker names
    them, walked without following any link; or why not: the first entry that is a link, FIFO, socket or
    device, named."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return {}, None
    if stat.S_ISREG(mode):
        return {name: path}, None
    if not stat.S_ISDIR(mode):
        return {}, _not_regular(path, name, mode)
    found: dict[str, Path] = {}
    folders = [(path, name)]
    while folders:
        folder, shown = folders.pop()
        with os.scandir(folder) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                mode = entry.stat(follow_symlinks=False).st_mode
                here = f"{shown}/{entry.name}"
                if stat.S_ISDIR(mode):
                    folders.append((Path(entry.path), here))
                elif stat.S_ISREG(mode):
                    found[here] = Path(entry.path)
                else:
                    return {}, _not_regular(Path(entry.path), here, mode)
    return found, None


def _index_problem(found: dict[str, Path]) -> str | None:
    """A weight index (`*.index.json`, weight_map) may name only plain files of its own folder, that are
    there: a peer's `../../it/model/model.safetensors` would make the merge read this cluster's own model."""
    for relative, file in found.items():
        if not relative.endswith(".index.json"):
            continue
        folder = relative.rpartition("/")[0]
        try:
            names = set(json.loads(file.read_text()).get("weight_map", {}).values())
        except (ValueError, UnicodeDecodeError, AttributeError) as error:
            return f"{relative}: not a weight index ({error})"
        for value in sorted(map(str, names)):
            if "/" in value or "\\" in value or value in ("", ".", "..") or f"{folder}/{value}" not in found:
                return (
                    f"{relative}: weight_map names {value!r}, which is not a file of its own folder: refused"
                )
    return None


def _file_set_problem(found: dict[str, Path], sums: dict[str, str]) -> str | None:
    """Why the files found differ from the marker's list (some missing, some not in it), or None."""
    missing = sorted(set(sums) - set(found))
    extra = sorted(set(found) - set(sums))
    if missing or extra:
        return f"files missing {missing[:3]} or not in the marker {extra[:3]}"
    return None


def verify(path: Path, sums: dict[str, str], name: str) -> str | None:
    """Why the copy at `path` (standing for `name`, as the marker names it) differs from the marker's
    list, or None when every file is there with its sha256 and there is nothing else. Only regular files
    and folders are taken: a link (to a file or a folder), a FIFO or a device anywhere is refused by name."""
    found, problem = regular_files(path, name)
    if problem := problem or _file_set_problem(found, sums):
        return problem
    for relative, digest in sums.items():
        if sha256_file(found[relative]) != digest:
            return f"{relative}: sha256 differs from the marker's"
    return _index_problem(found)


def _recorded_start(folder: Path) -> str | None:
    """The start identity a model folder says it was made from: a site model's training.json `start`, an
    aggregate's aggregate.json `start_identity` (fedtune.core.exchange.origin, aggregate.merge)."""
    for name, get in (
        ("training.json", lambda r: (r.get("start") or {}).get("identity")),
        ("aggregate.json", lambda r: r.get("start_identity")),
    ):
        try:
            record = json.loads((folder / name).read_text())
            value = get(record) if isinstance(record, dict) else None
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, str):
            return value
    return None


def stale(copy: Path, start: Path | None) -> str | None:
    """Why the model at `copy` is not its round's current one: it says it was made from another start
    than `start`, the round's start model here (a copy left from before its maker re-made the round's
    start, or its own round). None when it matches, or says nothing (an older fedtune)."""
    if start is None or not copy.is_dir() or not Path(start).is_dir():
        return None
    recorded = _recorded_start(copy)
    if recorded is None:
        return None
    expected = model_identity(start)
    if recorded == expected:
        return None
    return (
        f"a stale copy: made from start model {recorded[:12]}, but this round's start here ({start}) is "
        f"{expected[:12]}; waiting for its maker to publish the one made from this start"
    )


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
        ("restricted directory does not exist", "the folder this key is confined to does not exist"),
        "the folder its key is confined to (rrsync, fedtune-rsync-gate) is not there yet: the run's "
        "exchange/outbox or exchange/inbox folder, which that cluster's controller makes with its first "
        "transfer job",
    ),
    (
        ("fedtune-rsync-gate",),
        "the restricted key (fedtune-rsync-gate) refused the request: is it a path under the run's "
        "exchange/outbox (to pull) or exchange/inbox (to push)?",
    ),
    (
        ("rrsync",),
        "the restricted key (rrsync) refused the request: does its folder exist, and is it the run's "
        "exchange folder?",
    ),
)


def _missing_behind_rrsync(result: Outcome) -> bool:
    """A missing source seen through a restricted key: rrsync stops before rsync would say 23, and
    fedtune-rsync-gate while the folder it confines the key to is not made yet."""
    text = result.stderr.lower()
    return ("rrsync" in text and "no such file or directory" in text) or (
        "fedtune-rsync-gate: the folder this key is confined to does not exist" in text
    )


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


def _skipped(result: Outcome) -> str | None:
    """What rsync left out because it is not a regular file or folder (a link, a FIFO, a device: COPY
    takes none), as a refusal naming it."""
    for line in (result.stdout + result.stderr).splitlines():
        if line.startswith("skipping non-regular file"):
            return f"the sender's copy holds something that is not a regular file or folder ({line.strip()}): refused"
    return None


@dataclass(frozen=True)
class WaitOptions:
    """How a transfer waits: up to `wait` seconds, polling first after `first` seconds and then at most
    `most` apart (Waiter); `label` names what it waits for, `check` what to check where when the wait
    ends unfulfilled."""

    wait: float = 0
    label: str = ""
    check: str = ""
    first: float = 2.0
    most: float = 300.0


@dataclass(frozen=True)
class FetchJob:
    """One fetch: the rsync `source` (a folder or file another cluster marked complete), the output,
    the round's start model here (a model made from another start is stale), and the rsync command."""

    source: str
    out: str | Path
    start: str | Path | None = None
    rsync: str = "rsync"


@dataclass(frozen=True)
class PushJob:
    """One push: this cluster's run folder, the item (a path inside it), the other cluster's run folder
    as rsync reaches it, and the rsync command."""

    run: str | Path
    item: str
    to: str
    rsync: str = "rsync"


@dataclass(frozen=True)
class ReceiveJob:
    """One receive: this cluster's run folder, the item (a path inside it), the output, the cluster that
    makes it and this one (named in the messages), and the round's start model here (as FetchJob's)."""

    run: str | Path
    item: str
    out: str | Path
    maker: str = ""
    here: str = ""
    start: str | Path | None = None


def fetch(job: FetchJob, waiting: WaitOptions = WaitOptions(), link: Link = Link()) -> Path:
    """Pull `source` (a folder or file another cluster marked complete) into `out`. A call that fails
    (no connection, login refused, a stall) is retried with backoff up to `wait`; a copy that fails
    verification is fetched again at once, at most ATTEMPTS times. With `start` (the round's start model
    here), a model made from another start is stale: deleted, and looked for again (stale)."""
    source, out, start, rsync = job.source, Path(job.out), job.start, job.rsync
    wait, label, check, first, most = waiting.wait, waiting.label, waiting.check, waiting.first, waiting.most
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
            result = _rsync(*COPY, source + MARKER, str(local_marker), rsync=rsync, link=link)
            if result.returncode == 0 and local_marker.is_file() and not local_marker.is_symlink():
                return None
            if result.returncode == 0:
                return f"{source + MARKER} is not a regular file ({_skipped(result) or 'nothing arrived'})"
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
                        result = _rsync(*COPY, f"{source}/", f"{tmp}/", rsync=rsync, link=link)
                        arrived = result.returncode == 0
                        problem = (
                            (_skipped(result) or verify(tmp, sums, _name(source)))
                            if arrived
                            else _said(result, source, link)
                        )
                        if problem is None and (
                            problem := stale(tmp, None if start is None else Path(start))
                        ):
                            arrived = False  # not damaged: not yet the current one; look again later
                        if problem:
                            raise _Retry  # atomic_dir deletes the copy
                except _Retry:
                    pass
                return problem, arrived
            tmp = out.with_name(f".{name}.tmp-file")
            result = _rsync(*COPY, source, str(tmp), rsync=rsync, link=link)
            arrived = result.returncode == 0
            problem = (
                (_skipped(result) or verify(tmp, sums, _name(source)))
                if arrived
                else _said(result, source, link)
            )
            if problem:
                if tmp.is_dir() and not tmp.is_symlink():
                    shutil.rmtree(tmp, ignore_errors=True)
                else:
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


def push(job: PushJob, waiting: WaitOptions = WaitOptions(), link: Link = Link()) -> str:
    """Send run/item (marked complete here, or marked now) into `to`/exchange/inbox/item, marker last. The
    item's old marker there is withdrawn first, so that the receiver never takes a copy being replaced (or
    a stale one) for the current one."""
    run, item, to, rsync = Path(job.run), job.item, job.to, job.rsync
    wait, label, check, first, most = waiting.wait, waiting.label, waiting.check, waiting.first, waiting.most
    local = run / item
    if not local.exists():
        raise TransferError(f"{local} does not exist: nothing to push")
    text = marker_text(local)
    inbox = f"{to.rstrip('/')}/{INBOX}/"
    parent = item.rpartition("/")[0]
    # --relative with /./ recreates item's folders under the inbox (rsync makes only the last level).
    args = [*COPY, "--relative", "--delete", f"{run}/./{item}"]
    if local.is_dir():
        args[-1] += "/"
    waiter = Waiter(wait, label or f"{to} to take {item}", first=first, most=most)
    pushed = ""

    def withdraw() -> Outcome:
        """Delete inbox/<item>.COMPLETE there and nothing else: an empty folder synced with --delete, every
        other name of the item's folder excluded (so kept)."""
        with tempfile.TemporaryDirectory() as scratch:
            (Path(scratch) / parent).mkdir(parents=True, exist_ok=True)
            keep = f"/{parent}/*" if parent else "/*"
            return _rsync("-r", "--relative", "--delete", f"--include=/{item}{MARKER}", f"--exclude={keep}",
                          f"{scratch}/./{parent}{'/' if parent else ''}", inbox, rsync=rsync, link=link)  # fmt: skip

    def send() -> str | None:
        nonlocal pushed
        result = withdraw()
        if result.returncode:
            return _said(result, to, link)
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
            result = _rsync(*COPY, "--relative", f"{scratch}/./{item}{MARKER}", inbox, rsync=rsync, link=link)
        if result.returncode:
            return _said(result, to, link)
        pushed = inbox + item
        return None

    _wait_for(send, waiter, f"could not put {item} into {inbox}", check)
    print(f"[transfer] pushed {local} -> {pushed}, checked, marked complete", file=sys.stderr)
    return pushed


class _NotRegular(Exception):
    """Something on the way to a received file that is not a folder or a regular file."""


def _open_below(base: Path, relative: str) -> int:
    """A descriptor of the regular file base/relative, opened one folder at a time without following any
    link (O_NOFOLLOW at every level: a link swapped in after the walk is refused, not followed) and
    without blocking on a FIFO."""
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    parts = relative.split("/")
    try:
        for part in parts[:-1]:
            try:
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as error:
                if error.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _NotRegular(f"{relative}: {part} is not a folder (a link?): refused") from None
                raise
            os.close(fd)
            fd = child
        try:
            file = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise _NotRegular(f"{relative}: a symbolic link, not a regular file: refused") from None
            raise
        mode = os.fstat(file).st_mode
        if not stat.S_ISREG(mode):
            os.close(file)
            raise _NotRegular(f"{relative}: {_kind(mode)}, not a regular file: refused")
        return file
    finally:
        os.close(fd)


def _read_below(base: Path, relative: str) -> str:
    fd = _open_below(base, relative)
    with os.fdopen(fd, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def _copy_out(
    inbox: Path, item: str, sums: dict[str, str], out: Path, start: Path | None = None
) -> str | None:
    """Copy inbox/item to `out` (regular files only, each opened without following links), verify the
    copy against `sums` (and with `start`, that it is not stale) and rename it into place; or why not
    (nothing is left under `out` then)."""
    staged = inbox / item
    parent = item.rpartition("/")[0]
    below = f"{parent}/" if parent else ""
    found, problem = regular_files(staged, staged.name)
    if problem := problem or _file_set_problem(found, sums):
        return problem
    try:
        if stat.S_ISDIR(os.lstat(staged).st_mode):
            with atomic_dir(out) as tmp:
                for relative in sorted(found):
                    target = tmp / relative.partition("/")[2]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    fd = _open_below(inbox, below + relative)
                    try:
                        clone_or_copy(fd, target)
                    finally:
                        os.close(fd)
                if problem := verify(tmp, sums, staged.name) or stale(tmp, start):
                    raise _Retry
        else:
            tmp = out.with_name(f".{out.name}.tmp-received")
            tmp.unlink(missing_ok=True)
            fd = _open_below(inbox, item)
            try:
                clone_or_copy(fd, tmp)
            finally:
                os.close(fd)
            if problem := verify(tmp, sums, staged.name):
                tmp.unlink(missing_ok=True)
                return problem
            tmp.replace(out)
    except _Retry:
        return problem
    except _NotRegular as error:
        return str(error)
    return None


def receive(job: ReceiveJob, waiting: WaitOptions = WaitOptions()) -> Path:
    """Wait for `item` pushed into run/exchange/inbox by its maker, copy it to `out` and verify the copy.
    The inbox item stays (until a new push replaces it): a deleted `out` is received again from it, without
    the sender. A copy that fails verification is deleted from the inbox; the wait goes on for a new push."""
    run, item, out, maker, here, start = job.run, job.item, job.out, job.maker, job.here, job.start
    wait, label, check, first, most = waiting.wait, waiting.label, waiting.check, waiting.first, waiting.most
    inbox = Path(run) / INBOX
    staged = inbox / item
    # The inbox exists from the first wait on, so that the first push (which makes only the last
    # level of its destination, and through a restricted key nothing outside it) finds it.
    inbox.mkdir(parents=True, exist_ok=True)
    marker = marker_path(staged)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out)
    waiter = Waiter(wait, label or str(staged), first=first, most=most)
    rejected = ""
    receipt = f"{run}/sent/{here or '<this cluster>'}/{item}{MARKER}"
    again = (
        f"If {maker or 'its maker'} pushed it already and the inbox copy is gone, delete the receipt {receipt} "
        f"on {maker or 'its maker'} and run its controller again: its push job sends the item again."
    )
    check = f"{check} {again}".strip()

    def look() -> str | None:
        nonlocal rejected
        try:
            text = _read_below(inbox, f"{item}{MARKER}")
        except FileNotFoundError:
            earlier = (
                f"; an earlier copy failed verification ({rejected}) and was deleted" if rejected else ""
            )
            return f"no {marker} yet{earlier}"
        except _NotRegular as error:
            text, problem = "", str(error)
        else:
            problem = _copy_out(inbox, item, parse_marker(text, str(marker)), out, start and Path(start))
        if problem is None:
            return None
        if problem.startswith("a stale copy"):
            return problem  # complete, but not this round's: its maker's next push replaces it
        try:
            still = _read_below(inbox, f"{item}{MARKER}") == text
        except (OSError, _NotRegular):
            still = not text
        if not still:  # the sender is replacing it (push withdraws the marker first)
            return f"{marker} changed while it was copied: a new push is under way"
        rejected = problem
        _remove(marker)
        _remove(staged)
        return f"the copy failed verification ({problem}); deleted, waiting for it to be sent again"

    _wait_for(look, waiter, f"{marker} never appeared", check)
    print(
        f"[transfer] received {staged} -> {out} (a copy: the inbox keeps it), every file checked against its"
        " sha256",
        file=sys.stderr,
    )
    return out


def _remove(path: Path) -> None:
    """Delete a file, link or folder without following links."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


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
        "--outbox",
        default=None,
        help="also publish it there, as a copy (a reflink where possible), its marker last",
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
    for waiting in (fetching, receiving):
        waiting.add_argument(
            "--here", default="", help="this cluster's name, for the command that brings a lost item back"
        )
        waiting.add_argument(
            "--start",
            default=None,
            help="the round's start model here: a model made from another start is stale, and waited for",
        )
    args = parser.parse_args(argv)

    if args.command == "mark":
        marker = mark(args.path, args.outbox)
        if args.out and Path(args.out) != marker:
            write_text(args.out, marker.read_text())
        return 0
    wait = parse_duration(args.wait, "--wait") if str(args.wait).strip() not in ("0", "") else 0.0
    # Short waits look often (tests, a shared file system); long ones every 5 minutes at most.
    most = args.poll_max if args.poll_max is not None else max(2.0, min(300.0, wait / 100))
    waiting = WaitOptions(wait, _label(args), args.check, first=args.poll, most=most)
    if args.command == "fetch":
        fetch(FetchJob(args.source, args.out, start=args.start), waiting, _link(args))
    elif args.command == "push":
        pushed = push(PushJob(args.run, args.item, args.to), waiting, _link(args))
        if args.receipt:
            write_text(args.receipt, pushed + "\n")
    else:
        job = ReceiveJob(args.run, args.item, args.out, maker=args.remote, here=args.here, start=args.start)
        receive(job, waiting)
    return 0


if __name__ == "__main__":
    sys.exit(main())
