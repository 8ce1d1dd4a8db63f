"""A hostile or broken peer at the boundary between clusters (issue 47, parts 1, 2, 4 and 5 as far as
transfers go): everything that arrives from another cluster is untrusted, and what this cluster publishes
is a copy the other side cannot reach through. Each attack drives the real publish, fetch, push, receive
and verify (no mock of them), with a folder crafted as the other side would; the key's forced command
(scripts/fedtune-rsync-gate) is tried with the server command lines that rsync 3.1 and 3.2+ clients send,
and over a real sshd (tests/ssh_harness.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
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
    marker_path,
    push,
    receive,
)
from fedtune.run.config import build_run_config

from .ssh_harness import GATE, restrict, start_sshd, stop_sshd
from .workflow_harness import ROOT, demo_config, dry_run, write_config

FAST = Link(connect_timeout=5, io_timeout=5, transfer_timeout=30)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def crafted(folder: Path, files: dict[str, bytes], listed: dict[str, str] | None = None) -> Path:
    """A folder as a peer publishes it: `files`, and a marker of the regular files (plus `listed`)."""
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    lines = {f"{folder.name}/{name}": hashlib.sha256(data).hexdigest() for name, data in files.items()}
    lines.update(listed or {})
    marker_path(folder).write_text("".join(f"{digest}  {name}\n" for name, digest in sorted(lines.items())))
    return folder


# 1. Confinement: the outbox holds copies.


def test_rsync_inplace_into_the_outbox_leaves_the_live_file_as_it_was(tmp_path):
    """The peer's `rsync --inplace` into exchange/outbox (as a read-write key allowed) wrote through a hard
    link into the run's own manifest. A copy (a reflink where the file system has them) is a file of its
    own."""
    run = tmp_path / "run"
    live = run / "data" / "cs" / "manifest.json"
    live.parent.mkdir(parents=True)
    live.write_text('{"site": "cs", "splits": {"train": ["data/cs/shards/train-0"]}}')
    mark(live, run / "exchange" / "outbox" / "data" / "cs" / "manifest.json")
    model = run / "round-1" / "cs" / "model"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"cs weights")
    mark(model, run / "exchange" / "outbox" / "round-1" / "cs" / "model")
    evil = tmp_path / "evil.json"
    evil.write_text('{"site": "cs", "splits": {"train": ["/elsewhere/any-data"]}}')
    weights = tmp_path / "weights"
    weights.write_bytes(b"peer's weights")
    for source, target in ((evil, "data/cs/manifest.json"), (weights, "round-1/cs/model/model.safetensors")):
        subprocess.run(
            ["rsync", "--inplace", "-I", str(source), str(run / "exchange" / "outbox" / target)], check=True
        )
    assert json.loads(live.read_text())["splits"]["train"] == ["data/cs/shards/train-0"]
    assert (model / "model.safetensors").read_bytes() == b"cs weights"
    assert live.stat().st_nlink == 1 and (model / "model.safetensors").stat().st_nlink == 1


# 2. Received folders: regular files and folders only.


@pytest.mark.parametrize("kind", ["directory link to /etc", "FIFO", "file link to a local file"])
def test_a_fetched_folder_with_a_link_or_a_fifo_is_refused_naming_it(tmp_path, kind):
    """rsync -a brought links and FIFOs along, and verify looked only at what is_file() saw: the folder
    passed as "every file checked" and was renamed into place."""
    local = tmp_path / "leo" / "run" / "round-1" / "it" / "model" / "model.safetensors"
    local.parent.mkdir(parents=True)
    local.write_bytes(b"it's own weights")
    peer = tmp_path / "karo" / "run" / "exchange" / "outbox" / "round-1" / "cs" / "model"
    peer.mkdir(parents=True)
    listed = {}
    if kind == "directory link to /etc":
        (peer / "etc").symlink_to("/etc")
    elif kind == "FIFO":
        os.mkfifo(peer / "pipe")
    else:
        (peer / "model.safetensors").symlink_to(local)
        listed = {"model/model.safetensors": sha(local)}
    crafted(peer, {"config.json": b"{}"}, listed)
    out = tmp_path / "leo" / "run" / "round-1" / "cs" / "model"
    with pytest.raises(TransferError, match=r"not a regular file|skipping non-regular file") as error:
        fetch(FetchJob(str(peer), out), WaitOptions(label="cs's model of round 1 from karo"))
    name = {"directory link to /etc": "etc", "FIFO": "pipe", "file link to a local file": "model.safetensors"}
    assert name[kind] in str(error.value) and "failed verification 3 times" in str(error.value)
    assert not out.exists()


@pytest.mark.parametrize("kind", ["directory link to /etc", "FIFO", "file link to a local file"])
def test_a_pushed_folder_with_a_link_or_a_fifo_is_refused_naming_it(tmp_path, kind):
    """Push mode: what a peer wrote into this cluster's inbox (with a key that let it write links) was
    verified through the links and renamed into place."""
    run = tmp_path / "leo" / "run"
    local = run / "round-1" / "it" / "model" / "model.safetensors"
    local.parent.mkdir(parents=True)
    local.write_bytes(b"it's own weights")
    staged = run / "exchange" / "inbox" / "round-1" / "cs" / "model"
    staged.mkdir(parents=True)
    listed = {}
    if kind == "directory link to /etc":
        (staged / "etc").symlink_to("/etc")
    elif kind == "FIFO":
        os.mkfifo(staged / "pipe")
    else:
        (staged / "model.safetensors").symlink_to(local)
        listed = {"model/model.safetensors": sha(local)}
    crafted(staged, {"config.json": b"{}"}, listed)
    out = run / "round-1" / "cs" / "model"
    with pytest.raises(TransferError) as error:
        receive(ReceiveJob(run, "round-1/cs/model", out), WaitOptions(0.3, first=0.1, most=0.1))
    message = str(error.value)
    name = {"directory link to /etc": "etc", "FIFO": "pipe", "file link to a local file": "model.safetensors"}
    assert f"model/{name[kind]}: a " in message and "not a regular file" in message, message
    assert not out.exists()
    assert local.read_bytes() == b"it's own weights"


def test_a_weight_index_that_names_a_file_outside_its_folder_is_refused(tmp_path):
    """A `model.safetensors.index.json` entry ../../it/model/model.safetensors made the merge read the
    receiver's own site model as the peer's."""
    peer = tmp_path / "karo" / "outbox" / "model"
    peer.mkdir(parents=True)
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "../../it/model/model.safetensors"}}
    crafted(peer, {"config.json": b"{}", "model.safetensors.index.json": json.dumps(index).encode()})
    out = tmp_path / "leo" / "round-1" / "cs" / "model"
    with pytest.raises(TransferError, match=r"weight_map names '\.\./\.\./it/model/model\.safetensors'"):
        fetch(FetchJob(str(peer), out))
    assert not out.exists()


# 4. Push mode keeps a received item recoverable, and a copy being replaced is never taken.


def test_a_deleted_received_output_is_received_again_without_the_sender(tmp_path):
    """receive moved the item out of the inbox: once its output was deleted (--rerun-incomplete, or by
    hand), the sender, whose receipt existed, never pushed again, and the receiver waited for days."""
    here, there = tmp_path / "leo" / "run", tmp_path / "karo" / "run"
    aggregate = here / "round-1" / "aggregate" / "model"
    aggregate.mkdir(parents=True)
    (aggregate / "model.safetensors").write_bytes(b"aggregate")
    (there / "exchange" / "inbox").mkdir(parents=True)
    push(PushJob(here, "round-1/aggregate/model", str(there)))
    out = there / "round-1" / "aggregate" / "model"
    receive(ReceiveJob(there, "round-1/aggregate/model", out))
    shutil.rmtree(out)
    again = receive(ReceiveJob(there, "round-1/aggregate/model", out), WaitOptions(1, first=0.1, most=0.1))
    assert (again / "model.safetensors").read_bytes() == b"aggregate"


def test_the_command_that_brings_a_lost_pushed_item_back_is_named(tmp_path):
    run = tmp_path / "karo" / "run"
    with pytest.raises(TransferError) as error:
        receive(
            ReceiveJob(
                run, "round-1/aggregate/model", run / "round-1" / "aggregate" / "model", "leo", "karo"
            ),
            WaitOptions(0.2, first=0.1, most=0.1),
        )
    assert f"delete the receipt {run}/sent/karo/round-1/aggregate/model.COMPLETE on leo" in str(error.value)


def test_a_new_push_withdraws_the_old_marker_before_it_sends_a_file(tmp_path, monkeypatch):
    """A re-made item pushed again: while its files are being replaced, the old marker must not stand
    beside them (the receiver would take a half-replaced or stale copy for the current one)."""
    here, there = tmp_path / "leo" / "run", tmp_path / "karo" / "run"
    aggregate = here / "round-1" / "aggregate" / "model"
    aggregate.mkdir(parents=True)
    (aggregate / "model.safetensors").write_bytes(b"attempt 1")
    (there / "exchange" / "inbox").mkdir(parents=True)
    push(PushJob(here, "round-1/aggregate/model", str(there)))
    old_marker = there / "exchange" / "inbox" / "round-1" / "aggregate" / "model.COMPLETE"
    assert old_marker.is_file()
    (aggregate / "model.safetensors").write_bytes(b"attempt 2, re-made")
    real, seen = transfer._rsync, []

    def watching(*args, **kwargs):
        if any(str(a).endswith("round-1/aggregate/model/") for a in args) and "-n" not in args:
            seen.append(old_marker.exists())  # when the files are sent
        return real(*args, **kwargs)

    monkeypatch.setattr(transfer, "_rsync", watching)
    push(PushJob(here, "round-1/aggregate/model", str(there)))
    assert seen == [False]
    out = receive(ReceiveJob(there, "round-1/aggregate/model", there / "round-1" / "aggregate" / "model"))
    assert (out / "model.safetensors").read_bytes() == b"attempt 2, re-made"


def start_model(folder: Path, weights: bytes) -> Path:
    """A round's start model as its writer leaves it: weights and their fedtune-checksums.json."""
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(weights)
    record = {"model.safetensors": {"bytes": len(weights), "sha256": hashlib.sha256(weights).hexdigest()}}
    (folder / "fedtune-checksums.json").write_text(json.dumps(record))
    return folder


def site_model(folder: Path, start: Path, weights: bytes) -> Path:
    """A site model that says which start it trained from (training.json `start`, as training writes it)."""
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(weights)
    start_record = {"identity": transfer.model_identity(start), "model": str(start)}
    (folder / "training.json").write_text(json.dumps({"round": 2, "start": start_record}))
    return folder


def test_a_stale_site_model_in_the_outbox_is_never_taken_for_the_rounds(tmp_path):
    """The aggregating cluster re-made round 1's aggregate (attempt 2); the site's outbox still holds its
    round-2 model trained from attempt 1. The fetch waits for the one trained from this start."""
    here = tmp_path / "leo" / "run"
    start = start_model(here / "round-1" / "aggregate" / "model", b"aggregate, attempt 2")
    old_start = start_model(
        tmp_path / "karo" / "run" / "round-1" / "aggregate" / "model", b"aggregate, attempt 1"
    )
    there = tmp_path / "karo" / "run"
    outbox = there / "exchange" / "outbox" / "round-2" / "cs" / "model"
    old = site_model(there / "round-2" / "cs" / "model", old_start, b"cs trained from attempt 1")
    mark(old, outbox)
    out = here / "round-2" / "cs" / "model"
    with pytest.raises(
        TransferError, match=r"a stale copy: made from start model \w+, but this round's start"
    ):
        fetch(FetchJob(str(outbox), out, start), WaitOptions(0.5, first=0.1, most=0.1))
    assert not out.exists()
    shutil.rmtree(old)
    mark(site_model(old, start, b"cs trained from attempt 2"), outbox)
    assert (
        fetch(FetchJob(str(outbox), out, start)) / "model.safetensors"
    ).read_bytes() == b"cs trained from attempt 2"


def test_a_stale_pushed_aggregate_in_the_inbox_is_never_taken_and_kept_for_the_next_push(tmp_path):
    there = tmp_path / "karo" / "run"
    start = start_model(there / "round-1" / "aggregate" / "model", b"aggregate 1, attempt 2")
    other = start_model(tmp_path / "elsewhere", b"aggregate 1, attempt 1")
    staged = there / "exchange" / "inbox" / "round-2" / "aggregate" / "model"
    start_model(staged, b"aggregate 2 made from attempt 1")
    (staged / "aggregate.json").write_text(json.dumps({"start_identity": transfer.model_identity(other)}))
    (staged.parent / "model.COMPLETE").write_text(transfer.marker_text(staged))
    out = there / "round-2" / "aggregate" / "model"
    with pytest.raises(TransferError, match="a stale copy"):
        receive(
            ReceiveJob(there, "round-2/aggregate/model", out, start=start),
            WaitOptions(0.3, first=0.1, most=0.1),
        )
    assert not out.exists() and (staged.parent / "model.COMPLETE").is_file()


# The key's forced command: scripts/fedtune-rsync-gate.


def gate(command: str, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    """Run the gate as sshd would, with SSH_ORIGINAL_COMMAND set; a stand-in rsync echoes what it got."""
    exchange = tmp_path / "run" / "exchange"
    for folder in ("outbox/round-1/cs/model", "inbox"):
        (exchange / folder).mkdir(parents=True, exist_ok=True)
    fake = tmp_path / "rsync"
    fake.write_text('#!/bin/sh\necho "rsync ran: $*"\n')
    fake.chmod(0o755)
    line = [
        str(GATE),
        "--read",
        str(exchange / "outbox"),
        "--write",
        str(exchange / "inbox"),
        "--rsync",
        str(fake),
    ]
    return subprocess.run(
        ["/bin/sh", "-c", " ".join([*line, *extra])],
        env=dict(os.environ, SSH_ORIGINAL_COMMAND=command.replace("X", str(exchange))),
        capture_output=True,
        text=True,
        timeout=30,
    )


# What rsync clients send as the remote command (rsync 3.1: capabilities .iLsfxC; 3.2 and later .iLsfxCIvu).
ALLOWED = [
    "rsync --server --sender -logDtpre.iLsfxC . X/outbox/round-1/cs/model.COMPLETE",  # 3.1, rsync -a
    "rsync --server --sender -vlogDtpre.iLsfxC --timeout=300 . X/outbox/round-1/cs/model/",
    "rsync --server --sender -tre.iLsfxCIvu --timeout=300 . X/outbox/round-1/cs/model/",  # 3.2, fetch
    "rsync --server --sender -tre.iLsfxC . round-1/cs/model/",  # relative to the outbox
    "rsync --server -trRe.iLsfxC --delete . X/inbox/",  # 3.1, push
    "rsync --server -trRe.iLsfxCIvu --delete . X/inbox/",  # 3.2, push
    "rsync --server -ntrcRe.iLsfxCIvu --log-format=%i --delete . X/inbox/",  # push's checksum compare
    "rsync --server -re.iLsfxCIvu --delete . X/inbox/",  # push's withdrawal of an old marker
]
REFUSED = {
    "id": "only rsync's server mode",
    "sh -c id": "only rsync's server mode",
    "rsync --server --sender -tre.iLsfxC . X/outbox/x; id": "no shell characters",
    "rsync --server --sender -tre.iLsfxC . X/outbox/$(id)": "no shell characters",
    "rsync --server --sender -tre.iLsfxC . X/outbox/../../round-1/cs/model/": "'..'",
    "rsync --server --sender -tre.iLsfxC . X/../data/cs/raw/": "'..'",
    "rsync --server --sender -tre.iLsfxC . /etc/": "outside",
    "rsync --server --sender -tre.iLsfxC . X/inbox/": "outside",  # the inbox is write-only
    "rsync --server -tre.iLsfxC . X/outbox/round-1/cs/model/": "outside",  # the outbox is read-only
    "rsync --server -logDtpre.iLsfxC . X/inbox/": "links, devices",  # rsync -a into the inbox: links
    "rsync --server -tre.iLsfxC --inplace . X/inbox/": "refused option --inplace",
    "rsync --server -tre.iLsfxC --partial-dir .p . X/inbox/": "refused option --partial-dir",
    "rsync --server -tre.iLsfxC --temp-dir=/tmp . X/inbox/": "refused option --temp-dir",
    "rsync --server --sender -tre.iLsfxC --remove-source-files . X/outbox/round-1/": "--remove-source-files",
    "rsync --server --sender -tLre.iLsfxC . X/outbox/": "letters is not allowed",  # --copy-links
    "rsync --server -tKre.iLsfxC . X/inbox/": "letters is not allowed",  # --keep-dirlinks
    "rsync --server --sender -tsre.iLsfxC . X/outbox/": "letters is not allowed",  # names sent later
    "rsync --server --sender -tre.iLsfxC --files-from=- . X/outbox/": "refused option --files-from",
    "rsync --server --sender -tre.iLsfxC . X/outbox/*": "no shell characters",
    "rsync --server --sender -tre.iLsfxC . X/outbox/a\\ b": "no shell characters",
    "rsync --server --daemon .": "refused option --daemon",
    "rsync --server -tre.iLsfxC . X/inbox/ X/inbox/b": "one destination",
}


@pytest.mark.parametrize("command", ALLOWED)
def test_the_gate_runs_the_server_command_lines_of_rsync_3_1_and_later(tmp_path, command):
    result = gate(command, tmp_path)
    assert result.returncode == 0, result.stderr
    assert (
        result.stdout.strip() == "rsync ran: " + command.replace("X", str(tmp_path / "run" / "exchange"))[6:]
    )


@pytest.mark.parametrize("command", sorted(REFUSED))
def test_the_gate_refuses_other_commands_escapes_and_dangerous_options(tmp_path, command):
    result = gate(command, tmp_path)
    assert result.returncode != 0 and "rsync ran" not in result.stdout, result.stdout
    assert result.stderr.startswith("fedtune-rsync-gate: ") and REFUSED[command] in result.stderr, (
        result.stderr
    )
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_key_for_one_direction_only_refuses_the_other(tmp_path):
    exchange = tmp_path / "run" / "exchange"
    (exchange / "outbox").mkdir(parents=True)
    only_read = [str(GATE), "--read", str(exchange / "outbox")]
    result = subprocess.run(
        only_read,
        env=dict(os.environ, SSH_ORIGINAL_COMMAND=f"rsync --server -tre.iLsfxC . {exchange}/inbox/"),
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "this key may not write" in result.stderr


@pytest.mark.sshd
def test_through_the_gate_over_ssh_the_peer_cannot_write_the_outbox_read_the_run_or_plant_links(
    tmp_path, monkeypatch
):
    """The documented key over a real sshd: the transfers work; `rsync --inplace` into the outbox, a pull
    of the run's raw data, a push that carries a symlink, and a shell are refused."""
    server = start_sshd(tmp_path / "sshd")
    try:
        there = tmp_path / "karo" / "run"
        live = there / "data" / "cs" / "manifest.json"
        live.parent.mkdir(parents=True)
        live.write_text('{"site": "cs"}')
        (there / "data" / "cs" / "raw").mkdir()
        (there / "data" / "cs" / "raw" / "text.jsonl").write_text('{"text": "private"}\n')
        mark(live, there / "exchange" / "outbox" / "data" / "cs" / "manifest.json")
        (there / "exchange" / "inbox").mkdir()
        restrict(server, there / "exchange")
        monkeypatch.setenv("RSYNC_RSH", server.rsync_rsh)
        remote = f"{server.host}:{there}"
        got = fetch(
            FetchJob(f"{remote}/exchange/outbox/data/cs/manifest.json", tmp_path / "leo" / "manifest.json"),
            link=FAST,
        )
        assert json.loads(got.read_text()) == {"site": "cs"}

        evil = tmp_path / "evil.json"
        evil.write_text('{"site": "cs", "splits": {"train": ["/elsewhere"]}}')
        for host in (server.host, server.push_host):  # either key
            inplace = transfer._rsync("--inplace", "-I", str(evil),
                                      f"{host}:{there}/exchange/outbox/data/cs/manifest.json", link=FAST)  # fmt: skip
            assert inplace.returncode != 0 and "fedtune-rsync-gate" in inplace.stderr
        assert json.loads(live.read_text()) == {"site": "cs"}
        raw = transfer._rsync(
            "-a", f"{remote}/exchange/../data/cs/raw/", f"{tmp_path / 'stolen'}/", link=FAST
        )
        assert raw.returncode != 0 and not list((tmp_path / "stolen").glob("*"))
        linked = tmp_path / "linked"
        linked.mkdir()
        (linked / "passwd").symlink_to("/etc/passwd")
        # Through the push key, which may write the inbox: not links.
        planted = transfer._rsync(
            "-a", f"{linked}/", f"{server.push_host}:{there}/exchange/inbox/linked/", link=FAST
        )
        assert planted.returncode != 0 and "links, devices and special files" in planted.stderr
        assert not (there / "exchange" / "inbox" / "linked").exists()
        shell = transfer._run(
            [*server.rsync_rsh.split(), "-o", "BatchMode=yes", server.host, "cat /etc/passwd"], 20
        )
        assert shell.returncode != 0 and "root:" not in shell.stdout
    finally:
        stop_sshd(server)


# 5. ssh options that run a command.


@pytest.mark.parametrize(
    "option", ["ProxyCommand=/home/me/evil", "proxycommand=nc", "LocalCommand=id", "PermitLocalCommand=yes"]
)
def test_ssh_options_that_run_a_command_are_refused_unless_meant(option):
    config = demo_config(cluster="leo")
    config["sites"]["alpha"]["cluster"] = "leo"
    config["sites"]["beta"]["cluster"] = "karo"
    karo = {"path": "karo-fedtune:/scratch/run", "ssh_options": [option]}
    config["federation"] = {"rounds": 1, "aggregate_on": "leo", "remotes": {"karo": karo}}
    with pytest.raises(ConfigError, match=r"federation\.remotes\.karo\.ssh_options: .* runs a command"):
        build_run_config(config, base_dir=ROOT)
    karo["allow_command_options"] = True
    assert build_run_config(config, base_dir=ROOT).remotes["karo"].ssh_options == (option,)


def test_the_workflow_compares_each_fetched_model_of_round_2_on_with_the_rounds_start(tmp_path):
    """The fetch and receive rules pass the round's start model (--start): round 2's site model is compared
    with round 1's aggregate here; round 1 (the clusters' own downloads of the base) is not."""
    config = demo_config(cluster="leo")
    config["sites"]["alpha"]["cluster"] = "leo"
    config["sites"]["beta"]["cluster"] = "karo"
    config["federation"] = {"rounds": 2, "aggregate_on": "leo", "remotes": {"karo": "me@karo:/scratch/run"}}
    write_config(tmp_path, config)
    jobs = dry_run(tmp_path, "results/demo/round-2/beta/model")
    fetches = {job.wildcards["round"]: job.shell for job in jobs if job.name == "fetch_site_model"}
    assert "--start results/demo/round-1/aggregate/model " in fetches["2"], fetches["2"]
    assert "--start" not in fetches["1"] and "--here leo " in fetches["1"]
