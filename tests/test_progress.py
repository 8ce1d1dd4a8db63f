"""fedtune.core.progress: tqdm bars on a terminal, plain periodic lines in a log, and the stages that use it."""

from __future__ import annotations

import io
import re
import time

from fedtune.core import progress


def test_plain_lines_in_a_log_and_a_final_line():
    log = io.StringIO()
    with progress.Progress(4, desc="evaluate alpha", unit="batch", every_s=0, stream=log, tty=False) as bar:
        for _ in range(4):
            bar.update()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert lines[0].startswith("evaluate alpha: 1/4 batch (25%), ") and lines[0].endswith(" left")
    assert re.fullmatch(r"evaluate alpha: 4/4 batch \(100%\), [\d,.]+ batch/s, done in 0:00:00", lines[-1])
    assert len(lines) == 5


def test_lines_wait_for_the_interval():
    log = io.StringIO()
    items = list(progress.track(range(50), desc="tokenize", unit="doc", every_s=3600, stream=log, tty=False))
    assert items == list(range(50))
    # Nothing until the interval passed, then one line at the end.
    assert log.getvalue().splitlines() == [
        line for line in log.getvalue().splitlines() if line.startswith("tokenize: 50/50 doc (100%)")
    ]
    assert len(log.getvalue().splitlines()) == 1


def test_a_terminal_gets_a_tqdm_bar():
    term = io.StringIO()
    with progress.Progress(10, desc="tokenize train shard 0", unit="doc", stream=term, tty=True) as bar:
        bar.update(10)
    assert "tokenize train shard 0: 100%" in term.getvalue() and "10/10" in term.getvalue()


def test_heartbeat_reports_a_long_call_in_a_log(tmp_path):
    (tmp_path / "part").write_bytes(b"x" * 2**20)
    log = io.StringIO()
    measure = lambda: progress.folder_size(tmp_path)  # noqa: E731
    with progress.Heartbeat("download model", measure=measure, every_s=0.05, stream=log, tty=False):
        time.sleep(0.3)
    lines = log.getvalue().splitlines()
    assert len(lines) >= 3 and lines[0].startswith("download model: running for 0:00:00, 1.0 MiB in ")
    assert lines[-1].startswith("download model: done in 0:00:00, 1.0 MiB")
    term = io.StringIO()
    with progress.Heartbeat("download model", every_s=0.01, stream=term, tty=True):
        time.sleep(0.05)
    assert term.getvalue() == ""


def test_evaluate_reports_its_batches(tiny_model_dir, capsys):
    from fedtune.core.models import load_causal_lm
    from fedtune.evaluate.scores import score

    model = load_causal_lm(tiny_model_dir, dtype="float32")
    score(
        model, list(range(3, 300)), 32, 16, batch_size=4, device="cpu", desc="evaluate base on alpha (test)"
    )
    err = capsys.readouterr().err
    assert re.search(r"^evaluate base on alpha \(test\): 5/5 batch \(100%\), .* done in", err, re.M), err
