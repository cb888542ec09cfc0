"""Progress bars for the toolkit's loops over engine runs (tqdm, as vLLM's benchmarks).

A bar shows only on a terminal (``disable=None``): logs and CI output stay free of
carriage-return noise, and every tool still prints its own one-line result per run.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")


def progress(items: Iterable[T], desc: str, unit: str = "engine") -> Iterator[T]:
    """``items`` with a progress bar named ``desc`` on stderr (when it is a terminal)."""
    yield from tqdm(items, desc=desc, unit=unit, disable=None, dynamic_ncols=True)
