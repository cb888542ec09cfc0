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

TESTS = Path(__file__).resolve().parent
STAGING_LINE = "DraftOffloadConnector: stores staged through a GPU buffer of 2 units"

PROCESS = """
import logging, sys, tempfile
from pathlib import Path
sys.path.insert(0, {tests!r})
if {root_configured}:
    logging.basicConfig(level=logging.INFO)
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


def _start_lines(root_configured: bool, level: str) -> list[str]:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": level}
    code = PROCESS.format(tests=str(TESTS), root_configured=root_configured)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    return [line for line in output.splitlines() if STAGING_LINE in line]


def test_info_lines_print_through_vllms_handler_once() -> None:
    lines = _start_lines(root_configured=False, level="INFO")
    assert len(lines) == 1, lines
    # vLLM's format: level, then the file and line in brackets.
    assert " INFO " in lines[0] and "[worker_side.py:" in lines[0], lines[0]


def test_vllms_level_holds_for_the_connectors_lines() -> None:
    assert _start_lines(root_configured=False, level="WARNING") == []


def test_an_applications_root_handler_keeps_the_lines_without_a_second_copy() -> None:
    lines = _start_lines(root_configured=True, level="INFO")
    assert lines == [f"INFO:vllm_draft_offload.worker_side:{STAGING_LINE} (65536 B)"], lines
