"""The connector's INFO lines reach the log of a vLLM process (log_routing.py).

Each case is a fresh interpreter, as a vLLM engine or worker process is: vLLM applies
its logging configuration there (as EngineCore and the workers do before they build a
connector), then a real connector pair starts on the simulated engine with an explicit
staging buffer, whose start-up line is the one a GPU run's logs lacked (session 33).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
STAGING_LINE = "DraftOffloadConnector: stores staged through a GPU buffer of 2 units"

PROCESS = """
import logging, sys, tempfile
from pathlib import Path
sys.path.insert(0, {tests!r})
if {root_handler}:
    # A handler on the root, as a library or an application may add, at the level it
    # gives the root.
    logging.getLogger().addHandler(logging.StreamHandler())
    logging.getLogger().setLevel({root_level!r})
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())
from kv_sim import SimEngine, SimSetup, write_tiny_llama
models = Path(tempfile.mkdtemp())
engine = SimEngine(
    write_tiny_llama(models / "target", 2, 4, 2, 32),
    write_tiny_llama(models / "draft", 1, 4, 2, 32),
    SimSetup(extra_config={{"store_staging_units": 2}}),
)
engine.shutdown()
"""


def _start_lines(level: str, root_level: str | None = None) -> list[str]:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": level}
    code = PROCESS.format(
        tests=str(TESTS), root_handler=root_level is not None, root_level=root_level
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    return [line for line in output.splitlines() if STAGING_LINE in line]


def _in_vllms_format(line: str) -> bool:
    """vLLM's format: the level, then the file and line in brackets."""
    return " INFO " in line and "[worker_side.py:" in line


def test_info_lines_print_through_vllms_handler_once() -> None:
    lines = _start_lines("INFO")
    assert len(lines) == 1 and _in_vllms_format(lines[0]), lines


def test_vllms_level_holds_for_the_connectors_lines() -> None:
    assert _start_lines("WARNING") == []


@pytest.mark.parametrize("root_level", ["WARNING", "INFO"])
def test_a_root_handler_neither_swallows_the_lines_nor_prints_them_twice(root_level: str) -> None:
    """At the root's default level (WARNING) the first form of the routing, which left
    the lines to any root handler, printed none; at INFO it printed them in the root's
    format instead of vLLM's."""
    lines = _start_lines("INFO", root_level)
    assert len(lines) == 1 and _in_vllms_format(lines[0]), lines
