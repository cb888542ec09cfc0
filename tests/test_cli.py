"""The `vllm-draft-offload` command: every subcommand's help, the shared options, the
console-script entry point, and the modules the tools start as subprocesses."""

from __future__ import annotations

import importlib
import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from vllm_draft_offload.bench import PACKAGE_PARENT, cli

ROOT = Path(__file__).resolve().parents[1]
FIX, OUT, EAGER = "--fixtures", "--out", "--enforce-eager"
# The shared options each command has: every command writes somewhere, every command
# that starts an engine takes --enforce-eager, every one that runs the fixtures --fixtures.
SHARED = {
    "fixtures": {OUT},
    "accept": {FIX, OUT, EAGER},
    "table": {OUT},
    "bench": {FIX, OUT, EAGER},
    "restore-speed": {OUT, EAGER},
    "copy-speed": {OUT},
    "decode-overhead": {OUT, EAGER},
    "hook-cost": {OUT},
    "l3-speed": {OUT},
    "l3-stages": {OUT},
    "shared-storage": {FIX, OUT, EAGER},
    "pressure": {FIX, OUT, EAGER},
    "soak": {FIX, OUT, EAGER},
    "serve-bench": {FIX, OUT, EAGER},
    "dashboard-render": {OUT},
    "spy-report": {OUT},
}


def _entry_point() -> EntryPoint:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    return EntryPoint("vllm-draft-offload", scripts["vllm-draft-offload"], "console_scripts")


def _help(
    main: Callable[[list[str]], int], argv: list[str], capsys: pytest.CaptureFixture[str]
) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_every_command_is_listed_with_the_shared_options() -> None:
    assert set(SHARED) == set(cli.BY_NAME)
    assert _entry_point().load() is cli.main  # what `pip install` puts on PATH


@pytest.mark.parametrize("command", list(SHARED))
def test_help_of_every_command(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(_entry_point().load(), [command, "--help"], capsys)
    assert text.startswith(f"usage: vllm-draft-offload {command} ")
    options, examples = text.split("\noptions:\n", 1)[1].split("\nexamples:\n", 1)
    assert f"vllm-draft-offload {command} " in examples  # examples run this command
    declared = set(re.findall(r"^  (?:-\w, )?(--[\w-]+)", options, re.M))
    assert declared & {FIX, OUT, EAGER} == SHARED[command]


def test_listing_and_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(cli.main, ["--help"], capsys)
    for name in SHARED:
        assert re.search(rf"^    {re.escape(name)}\b", text, re.M), name
    assert cli.main([]) == 2 and "COMMAND" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        cli.main(["benchmark"])
    assert exit_.value.code == 2
    assert "invalid choice: 'benchmark'" in capsys.readouterr().err


def test_python_dash_m_and_the_installed_script() -> None:
    """Both ways a user starts it, as separate processes."""
    env = {"PYTHONPATH": PACKAGE_PARENT, "PATH": "/usr/bin:/bin"}
    cmds = [[sys.executable, "-m", "vllm_draft_offload.bench", "table", "--help"]]
    # Where `pip install` put the console script of this interpreter's environment,
    # if this package is installed there with it (CI's editable install is).
    script = shutil.which("vllm-draft-offload", path=str(Path(sys.executable).parent))
    if script is not None:
        cmds.append([script, "table", "--help"])
    for cmd in cmds:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.startswith("usage: vllm-draft-offload table ")


def test_tool_failures_reach_the_exit_status(tmp_path: Path) -> None:
    assert cli.main(["table", str(tmp_path)]) == 1  # no results in the directory


def test_subprocess_modules_exist() -> None:
    """The tools start their engine side as `python -m MODULE`: each must resolve."""
    from vllm_draft_offload.bench.accept import check, probe_connector, shared_storage
    from vllm_draft_offload.bench.speed import decode_overhead, restore
    from vllm_draft_offload.bench.stress import jobs
    from vllm_draft_offload.bench.workloads import run

    modules = [
        run.WORKER[1],
        jobs.WORKER[1],
        check.ENGINE_MODULE,
        shared_storage.MODULE,
        restore.MODULE,
        decode_overhead.MODULE,
        probe_connector.MODULE_NAME,  # vLLM imports the probe connector by this name
    ]
    assert run.WORKER[0] == jobs.WORKER[0] == "-m"
    for name in modules:
        assert importlib.util.find_spec(name) is not None, name
    assert shared_storage.__name__ == shared_storage.MODULE
    assert restore.__name__ == restore.MODULE
    assert decode_overhead.__name__ == decode_overhead.MODULE
    assert probe_connector.__name__ == probe_connector.MODULE_NAME
    assert importlib.import_module(check.ENGINE_MODULE).main is not None


def test_eager_is_the_default_of_eager_or_compile() -> None:
    """`--enforce-eager` is the default of the commands that take `--compile` (their help
    says so), and each flag sets what it names."""
    import argparse

    from vllm_draft_offload.bench.options import add_eager_or_compile

    parser = argparse.ArgumentParser()
    add_eager_or_compile(parser)
    assert parser.parse_args([]).compile is False
    assert parser.parse_args(["--enforce-eager"]).compile is False
    assert parser.parse_args(["--compile"]).compile is True
