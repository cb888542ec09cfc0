"""Baseline tables from acceptance runs (`vllm-draft-offload table`).

Checked on the recorded H200 runs in results/gpu/accept_h200 (committed data), and on
synthetic directories with runs missing or crashed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from vllm_draft_offload.bench import cli
from vllm_draft_offload.bench.accept.table import (
    MISSING,
    Results,
    acceptance_cell,
    crash_cause,
    load_results,
    parse_name,
    render,
    sensitivity_row,
)

ROOT = Path(__file__).resolve().parents[1]

H200 = ROOT / "results" / "gpu" / "accept_h200"
DOCS = ROOT / "docs" / "fixtures.md"
BROADCAST = "ValueError: could not broadcast input array from shape (6,) into shape (4,)"


@pytest.fixture(scope="module")
def h200() -> Results:
    return load_results(H200)


def test_parse_name() -> None:
    assert parse_name("accept_eagle3-native.json") == ("eagle3", "native")
    assert parse_name("accept_self-corrupt.json") == ("self", "corrupt")
    assert parse_name("runs.log") is None
    assert parse_name("accept_self.json") is None


def test_crash_cause() -> None:
    engine_tail = (
        "Traceback (most recent call last):\n"
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n"
        "--- engine output (tail) ---\n"
        "ERROR EngineCore failed\nTraceback (most recent call last):\n"
        f'  File "x.py", line 1, in f\n{BROADCAST}\n'
    )
    assert crash_cause(engine_tail) == BROADCAST
    assert crash_cause("x\nvllm.v1.engine.exceptions.EngineDeadError: boom\n") == "EngineDeadError"
    assert crash_cause("engine subprocess exited with -6:\nabort") == (
        "engine subprocess exited with -6:"
    )
    assert crash_cause("RuntimeError: " + "x" * 500).endswith("…")


def test_recorded_runs_all_loaded(h200: Results) -> None:
    assert len(h200) == 20
    drafters = {"self", "small", "eagle", "eagle3"}
    connectors = {"none", "native", "lmcache", "ours", "corrupt"}
    assert set(h200) == {(d, c) for d in drafters for c in connectors}


def test_recorded_sensitivity(h200: Results) -> None:
    assert h200["self", "corrupt"].summary.corruption_drop == pytest.approx(0.75)
    rows = {d: sensitivity_row(d, h200[d, "corrupt"]) for d in ("self", "small", "eagle", "eagle3")}
    assert rows["self"][1:] == ["4.00", "1.00", "75.0%", "yes", "4/4"]
    assert rows["small"][1:] == ["3.75", "1.00", "73.3%", "yes", "4/4"]
    assert rows["eagle"][1:] == ["4.00", "1.03", "74.2%", "yes", "4/4"]
    assert rows["eagle3"][1:] == ["3.68", "1.31", "64.5%", "yes", "4/4"]


def test_recorded_acceptance(h200: Results) -> None:
    cell = {k: acceptance_cell(r) for k, r in h200.items() if k[1] != "corrupt"}
    # LMCache: EAGLE heads restore wrong KV (outputs differ too), draft_model crashes
    assert cell["eagle3", "lmcache"] == "0.50 (1.90 / 3.79), 0/4, 4095"
    assert cell["eagle", "lmcache"] == "0.29 (1.15 / 4.00), 0/4, 4095"
    assert cell["self", "lmcache"] == "crash: EngineDeadError"
    assert cell["small", "lmcache"] == "crash: EngineDeadError"
    # native: full hit with draft_model costs the first draft; EAGLE keeps one block less
    assert cell["self", "native"] == "0.94 (3.77 / 4.00), 4/4, 4096"
    assert cell["small", "native"] == "0.95 (3.59 / 3.79), 4/4, 4096"
    assert cell["eagle", "native"] == "1.00 (4.00 / 4.00), 4/4, 4080"
    for d in ("self", "small", "eagle", "eagle3"):
        assert cell[d, "ours"].startswith("1.00 (")
        assert cell[d, "ours"].endswith(", 4/4, 4094")
        # no connector: only the second prompt of each pair hits the GPU prefix cache
        prefix = 2032 if d in ("self", "small") else 2024
        assert cell[d, "none"].endswith(f", 4/4, {prefix}")


def test_recorded_env_line(h200: Results) -> None:
    first = render(h200).splitlines()[0]
    assert first == "GPU: NVIDIA H200; vllm 0.33.0, torch 2.14.0, lmcache 0.5.6"


def test_docs_hold_the_current_tables(h200: Results) -> None:
    """docs/fixtures.md section 4 shows what the recorded runs give today."""
    docs = DOCS.read_text()
    for line in render(h200).splitlines():
        if line.startswith("|") or line.startswith("GPU:"):
            assert line in docs, line


def test_root_cause_shows_when_recorded(h200: Results) -> None:
    crashed = h200["small", "lmcache"].model_copy(deep=True)
    crashed.error = f"{crashed.error}\n--- engine output (tail) ---\n{BROADCAST}\n"
    assert acceptance_cell(crashed) == "crash: " + BROADCAST
    assert sensitivity_row("small", crashed)[1] == "crash: " + BROADCAST


def test_missing_runs_show_dash(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("accept_eagle-ours.json", "accept_self-corrupt.json"):
        shutil.copy(H200 / name, tmp_path / name)
    out = tmp_path / "table.md"
    assert cli.main(["table", str(tmp_path), "--out", str(out)]) == 0
    text = out.read_text()
    assert capsys.readouterr().out == text
    table_a, table_b = text.split("### B.")
    a_rows, b_rows = (
        {line.split(" | ")[0].lstrip("| "): line for line in t.splitlines()}
        for t in (table_a, table_b)
    )
    # eagle: no corrupt run -> table A row all dashes; self: no connector runs
    assert a_rows["eagle (eagle)"].count(MISSING) == 5
    assert "4.00 | 1.00 | 75.0% | yes | 4/4" in a_rows["self-draft (draft_model)"]
    # five connector columns: none, ours, ours_l3, native, lmcache
    assert b_rows["self-draft (draft_model)"].count(MISSING) == 5
    assert b_rows["eagle (eagle)"].count(MISSING) == 4
    assert "1.00 (4.00 / 4.00), 4/4, 4094" in b_rows["eagle (eagle)"]
    assert "small-draft" not in text


def test_no_runs(tmp_path: Path) -> None:
    assert cli.main(["table", str(tmp_path)]) == 1
    assert sensitivity_row("self", None)[1:] == [MISSING] * 5
    assert acceptance_cell(None) == MISSING


def test_divergent_and_prefix_cache_hit_runs_get_their_own_cells(h200: Results) -> None:
    from vllm_draft_offload.bench.accept.compare import summarize

    ours = h200["eagle", "ours"].model_copy(deep=True)
    fresh, restored = ours.phases[0], ours.phases[1]
    # the same phases, renamed as the prefix-cache-hit plan names them
    restored.spec.name = "cached"
    ours.summary = summarize(ours.phases)
    assert acceptance_cell(ours).startswith("1.00 (4.00 / 4.00), 4/4")
    # ... and as one case of the divergent plan, its hit where (and not where) expected
    restored.spec.name, fresh.spec.name, restored.spec.reference = (
        "diverge_j0",
        "fresh_j0",
        "fresh_j0",
    )
    for expected, verdict in ((4094, "as expected"), (4095, "NOT as expected")):
        restored.spec.expected_cached_tokens = expected
        ours.summary = summarize(ours.phases)
        assert acceptance_cell(ours) == f"j0 1.00, 4/4, hits {verdict}"
