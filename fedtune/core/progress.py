"""Progress of a long stage: a tqdm bar on a terminal, and in a job's log (not a terminal) a plain line
every `every_s` seconds plus one at the end, which `tail -f` and fedtune.report.status-style readers can use:

    evaluate alpha on beta (test): 120/480 batch (25%), 40.1 batch/s, 0:00:09 left

A bar in a log file would be one line of carriage returns, rewritten thousands of times.

    with progress.Progress(total=len(batches), desc="evaluate alpha", unit="window") as bar:
        for batch in batches:
            ...
            bar.update(len(batch))

or `for item in progress.track(items, desc=..., unit=...)`."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TextIO, TypeVar

T = TypeVar("T")
# Seconds between two plain lines in a log: a line per half minute keeps a 24 h job's log short.
DEFAULT_EVERY_S = 30.0


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """Counts work done; shows it as a tqdm bar on a TTY, as periodic plain lines elsewhere."""

    def __init__(
        self,
        total: int | None = None,
        *,
        desc: str,
        unit: str = "it",
        every_s: float = DEFAULT_EVERY_S,
        stream: TextIO | None = None,
        tty: bool | None = None,
    ):
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.stream = stream if stream is not None else sys.stderr
        self.n = 0
        self.started = self.last_line = time.monotonic()
        is_tty = self.stream.isatty() if tty is None else tty
        self.bar, self.closed = None, False
        if is_tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream, mininterval=0.5)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        if now - self.last_line >= self.every_s:
            self.last_line = now
            self._line(now)

    def _line(self, now: float, done: bool = False) -> None:
        elapsed = max(now - self.started, 1e-9)
        rate = self.n / elapsed
        count = f"{self.n}/{self.total}" if self.total is not None else str(self.n)
        parts = [f"{self.desc}: {count} {self.unit}"]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        parts.append(f"{rate:,.1f} {self.unit}/s")
        if done:
            parts.append(f"done in {_duration(elapsed)}")
        elif self.total and rate > 0:
            parts.append(f"{_duration((self.total - self.n) / rate)} left")
        self.stream.write(", ".join(parts) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.bar is not None:
            self.bar.close()
        else:
            self._line(time.monotonic(), done=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def track(
    items: Iterable[T], *, desc: str, unit: str = "it", total: int | None = None, **kwargs
) -> Iterator[T]:
    """Yield `items`, counting each one (total: len(items) when it has one)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)
    with Progress(total, desc=desc, unit=unit, **kwargs) as bar:
        for item in items:
            yield item
            bar.update()


class Heartbeat:
    """A plain line every `every_s` seconds while one long call runs (a download, a merge) that has no
    progress of its own to report in a log: elapsed time, plus `measure()` (e.g. bytes so far) when
    given. On a terminal it stays silent: the libraries' own bars show there."""

    def __init__(
        self,
        desc: str,
        *,
        measure=None,
        every_s: float = DEFAULT_EVERY_S,
        stream: TextIO | None = None,
        tty: bool | None = None,
    ):
        import threading

        self.desc, self.measure, self.every_s = desc, measure, every_s
        self.stream = stream if stream is not None else sys.stderr
        self.active = not (self.stream.isatty() if tty is None else tty)
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fedtune-heartbeat")

    def _line(self, state: str) -> None:
        parts = [f"{self.desc}: {state} {_duration(time.monotonic() - self.started)}"]
        if self.measure is not None:
            try:
                parts.append(str(self.measure()))
            except OSError:  # a folder renamed under us: the next line will say
                pass
        self.stream.write(", ".join(parts) + "\n")
        self.stream.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._line("running for")

    def __enter__(self) -> Heartbeat:
        if self.active:
            self._thread.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self.active:
            self._stop.set()
            self._thread.join()
            if exc_type is None:
                self._line("done in")


def folder_size(path: str | Path) -> str:
    """Bytes under `path` so far, for Heartbeat's measure: how far a download into it has come."""
    total = sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
    return f"{total / 2**20:,.1f} MiB in {path}"


def quiet_library_bars(stream: TextIO | None = None) -> None:
    """Turn off Hugging Face's tqdm bars when not on a terminal: in a log they are carriage-return noise."""
    stream = stream if stream is not None else sys.stderr
    if stream.isatty():
        return
    from datasets.utils.logging import disable_progress_bar
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()
    disable_progress_bar()
