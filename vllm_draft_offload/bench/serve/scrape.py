"""A server's ``/metrics`` over time: a scraper thread writing one file, and its reader.

The file is plain Prometheus text exposition, one block per scrape, each block after a
comment line ``# scrape_time_unix <seconds>``. Every block is a valid exposition on its
own (Prometheus' parser skips other comments), so ``grep`` and ``promtool`` read it too.
Only ``vllm:`` families are kept, without their ``_created`` samples: the rest (Python
GC, process stats) and the creation times would triple the file for no panel.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

HEADER = "# scrape_time_unix "
KEEP_PREFIX = "vllm:"

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs


def labels_key(labels: dict[str, str]) -> Labels:
    return tuple(sorted(labels.items()))


def keep_lines(text: str) -> Iterator[str]:
    """The lines of one exposition that the file keeps: ``vllm:`` samples and their
    HELP/TYPE lines, no ``_created`` samples."""
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            name = line.split(" ", 3)[2]
            if name.startswith(KEEP_PREFIX) and not name.endswith("_created"):
                yield line
            continue
        if not line.startswith(KEEP_PREFIX):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if not name.endswith("_created"):
            yield line


def write_block(out: TextIO, when: float, text: str) -> None:
    out.write(f"{HEADER}{when:.3f}\n")
    for line in keep_lines(text):
        out.write(line + "\n")
    out.flush()


class Scraper(threading.Thread):
    """Fetches ``url`` every ``interval_s`` into ``path`` until ``stop()``.

    A failed fetch (server busy, a timeout) is counted and skipped: the file then has
    a gap, as a Prometheus server's would, and the run goes on.
    """

    def __init__(self, url: str, path: Path, interval_s: float = 1.0) -> None:
        super().__init__(name="metrics-scraper", daemon=True)
        self.url, self.path, self.interval_s = url, path, interval_s
        self.scrapes = 0
        self.errors: list[str] = []
        self._stop_event = threading.Event()
        self._lock = threading.Lock()  # scrape_once may also be called from outside
        self._last_stamp = 0.0
        self._out = path.open("w")

    def scrape_once(self) -> None:
        try:
            with urllib.request.urlopen(self.url, timeout=max(5.0, self.interval_s)) as resp:
                text = resp.read().decode()
        except (urllib.error.URLError, OSError) as e:
            self.errors.append(f"{time.time():.3f} {e}")
            return
        with self._lock:
            # stamps are written in ms and must increase: two scrapes in one ms get 1 ms apart
            stamp = max(round(time.time(), 3), self._last_stamp + 0.001)
            self._last_stamp = stamp
            write_block(self._out, stamp, text)
            self.scrapes += 1

    def run(self) -> None:
        next_at = time.monotonic()
        while not self._stop_event.is_set():
            self.scrape_once()
            next_at += self.interval_s
            self._stop_event.wait(max(0.0, next_at - time.monotonic()))

    def stop(self) -> None:
        """Stop, after one last scrape (counters at the end of the run)."""
        self._stop_event.set()
        self.join()
        self.scrape_once()
        self._out.close()


@dataclass
class Series:
    times: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def window(self, start: float, end: float) -> tuple[list[float], list[float]]:
        """Samples with ``start < t <= end`` (a PromQL range selector's window)."""
        lo, hi = bisect_right(self.times, start), bisect_right(self.times, end)
        return self.times[lo:hi], self.values[lo:hi]

    def last_at(self, t: float) -> float | None:
        i = bisect_right(self.times, t)
        return self.values[i - 1] if i else None


@dataclass
class Scrapes:
    """Every series of a scrape file: ``series[sample name][labels]``."""

    times: list[float] = field(default_factory=list)
    series: dict[str, dict[Labels, Series]] = field(default_factory=dict)

    def add(self, when: float, name: str, labels: dict[str, str], value: float) -> None:
        s = self.series.setdefault(name, {}).setdefault(labels_key(labels), Series())
        s.times.append(when)
        s.values.append(value)

    def delta(self, name: str, **match: str) -> float:
        """Increase of the counter samples ``name`` (summed over the series whose labels
        include ``match``) from the first scrape to the last; 0 if never scraped."""
        total = 0.0
        for labels, s in self.series.get(name, {}).items():
            if s.values and all((k, v) in labels for k, v in match.items()):
                total += s.values[-1] - s.values[0]
        return total

    def delta_by(self, name: str, label: str) -> dict[str, float]:
        """``delta`` per value of ``label``."""
        out: dict[str, float] = {}
        for labels, s in self.series.get(name, {}).items():
            value = dict(labels).get(label)
            if s.values and value is not None:
                out[value] = out.get(value, 0.0) + s.values[-1] - s.values[0]
        return out


def parse_scrapes(text: str) -> Scrapes:
    """The series of a scrape file (``Scraper``'s output, or any text in its format)."""
    from prometheus_client.parser import text_string_to_metric_families

    scrapes = Scrapes()
    blocks = text.split(HEADER)
    if blocks[0].strip():
        raise ValueError(f"scrape file must start with '{HEADER.strip()} <seconds>'")
    for block in blocks[1:]:
        stamp, _, body = block.partition("\n")
        when = float(stamp)
        if scrapes.times and when <= scrapes.times[-1]:
            raise ValueError(f"scrape times must increase: {when} after {scrapes.times[-1]}")
        scrapes.times.append(when)
        for family in text_string_to_metric_families(body):
            for sample in family.samples:
                if not sample.name.endswith("_created"):
                    scrapes.add(when, sample.name, sample.labels, float(sample.value))
    return scrapes


def read_scrapes(path: Path) -> Scrapes:
    return parse_scrapes(path.read_text())
