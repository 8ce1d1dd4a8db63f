"""Transfers that cannot hang and keys that an admin would allow (issue 36, part 3): ssh never prompts,
every rsync call has time limits and ends in an error naming the host and the reason, a key or
certificate put back is picked up by the next look, and a key confined by scripts/fedtune-rsync-gate to the run's
exchange folder is all a transfer needs. Over a real local sshd (tests/ssh_harness.py) where it matters."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest

from fedtune.core import transfer
from fedtune.core.options import ConfigError
from fedtune.core.transfer import (
    FetchJob,
    Link,
    PushJob,
    ReceiveJob,
    TransferError,
    WaitOptions,
    fetch,
    mark,
    push,
    receive,
)
from fedtune.run.config import build_run_config

from .ssh_harness import allow, restrict, revoke, start_sshd, stop_sshd
from .workflow_harness import ROOT, demo_config, dry_run, write_config

FAST = Link(connect_timeout=5, io_timeout=5, transfer_timeout=20)


def test_ssh_never_prompts_and_every_rsync_call_has_time_limits(monkeypatch):
    monkeypatch.setenv("RSYNC_RSH", "ssh -p 2222")
    link = Link(ssh_options=("Port=8822", "ConnectTimeout=90"), connect_timeout=30, io_timeout=300)
    assert link.rsh().split() == [
        "ssh", "-p", "2222",
        "-o", "BatchMode=yes",  # first: ssh takes the first value given, so nothing turns it off
        "-o", "Port=8822", "-o", "ConnectTimeout=90",  # the remote's own: before fedtune's defaults
        "-o", "ConnectTimeout=30", "-o", "ServerAliveInterval=30", "-o", "ServerAliveCountMax=4",
    ]  # fmt: skip
    monkeypatch.delenv("RSYNC_RSH")
    assert Link(io_timeout=8).rsh().startswith("ssh -o BatchMode=yes ")
    assert "ServerAliveInterval=2 " in Link(io_timeout=8).rsh()


@pytest.mark.parametrize(
    "stderr, code, reason",
    [
        ("me@karo: Permission denied (publickey,password).", 255, "login refused (Permission denied)"),
        ("Host key verification failed.", 255, "host key unknown or changed"),
        ("ssh: connect to host karo port 22: Connection timed out", 255, "no connection within the connect"),
        ("ssh: connect to host karo port 22: Connection refused", 255, "connection refused: wrong port"),
        ("ssh: Could not resolve hostname karo: Name or service not known", 255, "unknown host name"),
        ("Timeout, server karo not responding.", 255, "the connection went silent"),
        ("rsync error: timeout in data send/receive (code 30)", 30, "no data moved for 300 s"),
    ],
)
def test_a_failed_call_is_named_by_its_host_and_reason(stderr, code, reason):
    said = transfer._said(transfer.Outcome(code, "", stderr + "\n"), "me@karo:/run/x", Link())
    assert said.startswith(f"me@karo: {reason}") and stderr.strip() in said


def test_a_hung_rsync_is_killed_with_its_children_at_the_transfer_timeout(tmp_path):
    """A call that never ends (here an 'rsync' whose child sleeps, as ssh would at a prompt) is killed with
    its whole process group at transfer_timeout; the error names the host and the setting."""
    pids = tmp_path / "pids"
    hung = tmp_path / "rsync"
    hung.write_text(f"#!/bin/sh\nsleep 120 &\necho $! >> {pids}\nwait\n")
    hung.chmod(0o755)
    started = time.monotonic()
    with pytest.raises(TransferError) as error:
        fetch(
            FetchJob(
                "me@karo:/run/exchange/outbox/round-1/beta/model",
                tmp_path / "here" / "model",
                rsync=str(hung),
            ),
            link=Link(transfer_timeout=1),
        )
    assert time.monotonic() - started < 10
    message = str(error.value)
    assert "me@karo: stopped after 1 s (federation.transfer_timeout)" in message
    time.sleep(0.2)
    for pid in pids.read_text().split():
        assert not _running(int(pid))  # the child went with it: nothing holds the pipes or the connection


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for a parent (here init) to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_mark_publishes_copies_into_the_outbox_its_marker_last(tmp_path):
    item = tmp_path / "run" / "round-1" / "beta" / "model"
    item.mkdir(parents=True)
    (item / "model.safetensors").write_bytes(b"weights")
    outbox = tmp_path / "run" / "exchange" / "outbox" / "round-1" / "beta" / "model"
    marker = mark(item, outbox)
    published = outbox / "model.safetensors"
    # A copy (a reflink where the file system has them), never a hard link to the live file.
    assert published.stat().st_ino != (item / "model.safetensors").stat().st_ino
    assert published.stat().st_nlink == 1 and published.read_bytes() == b"weights"
    assert (outbox.parent / "model.COMPLETE").read_text() == marker.read_text()
    # A retrained item (a new folder renamed into place) is published again, not the old inode.
    shutil.rmtree(item)
    item.mkdir()
    (item / "model.safetensors").write_bytes(b"new weights")
    mark(item, outbox)
    assert published.read_bytes() == b"new weights" and not list(outbox.parent.glob(".model.tmp-*"))


@pytest.fixture
def sshd(tmp_path):
    server = start_sshd(tmp_path / "sshd", passwords=True)
    yield server
    stop_sshd(server)


@pytest.mark.sshd
def test_a_host_that_asks_for_a_password_fails_within_its_timeout_and_the_key_put_back_works(
    tmp_path, sshd, monkeypatch
):
    """The sshd offers passwords; with the key gone, plain ssh asks for one (here an askpass that never
    answers, as nobody answers a terminal in tmux) and hangs. The transfer never asks: it fails at once,
    naming the host and the reason, after its wait; the next attempt with the key back succeeds, and
    so does a transfer that is still waiting when the key comes back."""
    there = tmp_path / "karo" / "run"
    item = there / "round-1" / "beta" / "model"
    item.mkdir(parents=True)
    (item / "model.safetensors").write_bytes(b"beta's weights")
    mark(item, there / "exchange" / "outbox" / "round-1" / "beta" / "model")
    source = f"{sshd.host}:{there}/exchange/outbox/round-1/beta/model"
    asked = tmp_path / "asked"
    askpass = tmp_path / "askpass"
    askpass.write_text(f'#!/bin/sh\necho "$@" >> {asked}\nsleep 120\n')
    askpass.chmod(0o755)
    monkeypatch.setenv("RSYNC_RSH", sshd.rsync_rsh)  # port, key, host keys: no BatchMode of its own
    monkeypatch.setenv("SSH_ASKPASS", str(askpass))
    monkeypatch.setenv("SSH_ASKPASS_REQUIRE", "force")
    monkeypatch.setenv("DISPLAY", ":0")
    key = revoke(sshd)

    # Without BatchMode ssh asks, and waits for the answer: the hang this part of the issue is about.
    plain = transfer._run([*sshd.rsync_rsh.split(), sshd.host, "true"], timeout=3)
    assert plain.timed_out and "password" in asked.read_text()
    asked.unlink()

    started = time.monotonic()
    with pytest.raises(TransferError) as error:
        fetch(
            FetchJob(source, tmp_path / "here" / "model"),
            WaitOptions(2, "beta's model of round 1 from karo", first=0.5, most=1),
            FAST,
        )
    assert time.monotonic() - started < 10
    message = str(error.value)
    assert "gave up waiting for beta's model of round 1 from karo" in message
    assert f"{sshd.host}: login refused (Permission denied)" in message
    assert "BatchMode never asks for a password" in message
    assert not asked.exists()  # never prompted
    assert not (tmp_path / "here" / "model").exists()

    allow(sshd, key)
    out = fetch(FetchJob(source, tmp_path / "here" / "model"), link=FAST)
    assert (out / "model.safetensors").read_bytes() == b"beta's weights"

    # The key taken away and put back while a transfer waits: its next look gets through.
    revoke(sshd)
    threading.Timer(1.5, allow, (sshd, key)).start()
    out = fetch(FetchJob(source, tmp_path / "again" / "model"), WaitOptions(30, first=0.5, most=1), FAST)
    assert (out / "model.safetensors").read_bytes() == b"beta's weights"
    assert not asked.exists()


@pytest.mark.sshd
def test_a_key_confined_by_the_gate_to_the_exchange_folder_moves_everything_and_nothing_else(
    tmp_path, sshd, monkeypatch
):
    """The two authorized_keys lines of docs/transfers.md (scripts/fedtune-rsync-gate: the pull key --read
    <run>/exchange/outbox, the push key --write <run>/exchange/inbox, each key through its own Host
    alias): the same remote path as without them, pull from the outbox with one and push into the inbox
    with the other work; the rest of the account (the run's own folders, writing into the outbox, reading
    the inbox, a push with the pull key, a pull with the push key, a shell) is out of reach."""
    there, here = tmp_path / "karo" / "run", tmp_path / "leo" / "run"
    beta = there / "round-1" / "beta" / "model"
    beta.mkdir(parents=True)
    (beta / "model.safetensors").write_bytes(b"beta")
    mark(beta, there / "exchange" / "outbox" / "round-1" / "beta" / "model")
    aggregate = here / "round-1" / "aggregate" / "model"
    aggregate.mkdir(parents=True)
    (aggregate / "model.safetensors").write_bytes(b"aggregate")
    (there / "exchange" / "inbox").mkdir()
    restrict(sshd, there / "exchange")
    monkeypatch.setenv("RSYNC_RSH", sshd.rsync_rsh)
    remote, push_remote = f"{sshd.host}:{there}", f"{sshd.push_host}:{there}"

    fetched = fetch(
        FetchJob(f"{remote}/exchange/outbox/round-1/beta/model", tmp_path / "got" / "model"), link=FAST
    )
    assert (fetched / "model.safetensors").read_bytes() == b"beta"
    # The pull key may not write, the push key may not read.
    with pytest.raises(TransferError, match="this key may not write"):
        push(PushJob(here, "round-1/aggregate/model", remote), WaitOptions(0.5, first=0.2, most=0.2), FAST)
    with pytest.raises(TransferError, match="this key may not read"):
        fetch(
            FetchJob(f"{push_remote}/exchange/outbox/round-1/beta/model", tmp_path / "got2" / "model"),
            WaitOptions(0.5, first=0.2, most=0.2),
            FAST,
        )
    push(PushJob(here, "round-1/aggregate/model", push_remote), link=FAST)
    received = receive(
        ReceiveJob(there, "round-1/aggregate/model", there / "round-1" / "aggregate" / "model")
    )
    assert (received / "model.safetensors").read_bytes() == b"aggregate"

    # What is not there yet reads as such through the key too (the gate, like rrsync, lets rsync say so).
    with pytest.raises(
        TransferError, match=r"never appeared \(last look: no \S+round-2/beta/model.COMPLETE yet"
    ):
        fetch(
            FetchJob(f"{remote}/exchange/outbox/round-2/beta/model", tmp_path / "r2" / "model"),
            WaitOptions(0.5, first=0.2, most=0.2),
            FAST,
        )

    outside = transfer._rsync("-a", f"{remote}/round-1/beta/model/", f"{tmp_path / 'stolen'}/", link=FAST)
    assert outside.returncode != 0 and not list((tmp_path / "stolen").glob("*"))
    assert "restricted key (fedtune-rsync-gate) refused" in transfer._said(outside, remote)
    # Read-only on the outbox, write-only on the inbox.
    into_outbox = transfer._rsync(*transfer.COPY, str(aggregate / "model.safetensors"),
                                  f"{remote}/exchange/outbox/round-1/beta/model/", link=FAST)  # fmt: skip
    assert into_outbox.returncode != 0 and (beta / "model.safetensors").read_bytes() == b"beta"
    into_outbox = transfer._rsync(*transfer.COPY, str(aggregate / "model.safetensors"),
                                  f"{push_remote}/exchange/outbox/round-1/beta/model/", link=FAST)  # fmt: skip
    assert into_outbox.returncode != 0 and (beta / "model.safetensors").read_bytes() == b"beta"
    for host in (remote, push_remote):
        out_of_inbox = transfer._rsync(
            *transfer.COPY, f"{host}/exchange/inbox/", f"{tmp_path / 'read'}/", link=FAST
        )
        assert out_of_inbox.returncode != 0 and not list((tmp_path / "read").glob("*"))
    for host in (sshd.host, sshd.push_host):
        shell = transfer._run([*sshd.rsync_rsh.split(), "-o", "BatchMode=yes", host, "id"], timeout=20)
        assert shell.returncode != 0 and "uid=" not in shell.stdout


def test_ssh_options_and_time_limits_reach_every_transfer_and_bad_ones_are_refused(tmp_path):
    config = demo_config(cluster="leo")
    config["sites"]["alpha"]["cluster"] = "leo"
    config["sites"]["beta"]["cluster"] = "karo"
    karo = {"path": "karo-fedtune:/scratch/run", "transfer": "push", "ssh_options": ["Port=8822"]}
    config["federation"] = {"rounds": 2, "aggregate_on": "leo", "remotes": {"karo": karo},
                            "connect_timeout": 20, "io_timeout": 120, "transfer_timeout": "2h"}  # fmt: skip
    write_config(tmp_path, config)
    jobs = dry_run(tmp_path, "results/demo/sent/karo/round-1/aggregate/model.COMPLETE",
                   "results/demo/round-1/beta/model")  # fmt: skip
    shells = {job.name: job.shell for job in jobs if job.name in ("push", "fetch_site_model")}
    assert sorted(shells) == ["fetch_site_model", "push"]
    for shell in shells.values():
        assert "--ssh-option Port=8822 --connect-timeout 20 --io-timeout 120 --transfer-timeout 7200" in shell
    assert (
        "--source karo-fedtune:/scratch/run/exchange/outbox/round-1/beta/model " in shells["fetch_site_model"]
    )
    assert "--to karo-fedtune:/scratch/run " in shells["push"]

    karo["ssh_options"] = ["Port 8822"]
    with pytest.raises(ConfigError, match="federation.remotes.karo"):
        build_run_config(config, base_dir=ROOT)


def test_a_push_path_sends_pushes_through_the_push_keys_host_and_pulls_stay_on_path(tmp_path):
    """Two keys for a cluster that is both pulled from and pushed into (docs/transfers.md): the push goes
    through federation.remotes.<c>.push_path, the fetch through its path; a push_path where nothing is
    pushed, or one that names another folder, is refused naming the key."""
    config = demo_config(cluster="leo")
    config["sites"]["alpha"]["cluster"] = "leo"
    config["sites"]["beta"]["cluster"] = "karo"
    karo = {"path": "karo-pull:/scratch/run", "push_path": "me@karo-push:/scratch/run/", "transfer": "push"}
    config["federation"] = {"rounds": 2, "aggregate_on": "leo", "remotes": {"karo": karo}}
    write_config(tmp_path, config)
    jobs = dry_run(tmp_path, "results/demo/sent/karo/round-1/aggregate/model.COMPLETE",
                   "results/demo/round-1/beta/model")  # fmt: skip
    shells = {job.name: job.shell for job in jobs if job.name in ("push", "fetch_site_model")}
    assert "--source karo-pull:/scratch/run/exchange/outbox/round-1/beta/model " in shells["fetch_site_model"]
    assert "--to me@karo-push:/scratch/run " in shells["push"] and "karo-pull" not in shells["push"]

    with pytest.raises(ConfigError, match=r"federation.remotes.karo.push_path: .*another folder"):
        build_run_config({**config, "federation": {**config["federation"], "remotes": {
            "karo": {**karo, "push_path": "me@karo-push:/scratch/other"}}}}, base_dir=ROOT)  # fmt: skip
    with pytest.raises(ConfigError, match=r"federation.remotes.karo.push_path: .*transfer: pull"):
        build_run_config({**config, "federation": {**config["federation"], "remotes": {
            "karo": {**karo, "transfer": "pull"}}}}, base_dir=ROOT)  # fmt: skip
