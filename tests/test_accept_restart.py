"""`accept --restart-from-storage`: parity restored from storage after an engine restart.

The plan's config and engine split, the writes' settle rule and the storage verdict
are checked here; the verdict and the table cell on a recorded CPU run
(tests/data/accept_restart_example.json: self-draft, tiny fixtures, 2 prompts of 256
tokens, chunk_size 32, made with the command in docs/fixtures.md §2). The e2e test runs
both engines for real (vLLM on CPU, two processes, an fs:// directory).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from vllm_draft_offload.bench import cli
from vllm_draft_offload.bench.accept.check import build_config, parse_args
from vllm_draft_offload.bench.accept.compare import summarize
from vllm_draft_offload.bench.accept.plans import RESTORED_STORAGE, plan_restart
from vllm_draft_offload.bench.accept.restart import (
    decision_lines,
    engine_configs,
    merge_results,
    settle_writes,
    storage_dir,
    storage_reads,
    storage_transfer_config,
)
from vllm_draft_offload.bench.accept.schema import AcceptCheckResult, RunConfig
from vllm_draft_offload.bench.accept.table import acceptance_cell, load_results, render
from vllm_draft_offload.bench.speed.l3_dir import unit_files
from vllm_draft_offload.config import parse_config

EXAMPLE = Path(__file__).parent / "data" / "accept_restart_example.json"
OURS = {
    "kv_connector": "DraftOffloadConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"cpu_bytes_to_use": 400_000_000, "chunk_size": 32},
}


@pytest.fixture
def example() -> AcceptCheckResult:
    return AcceptCheckResult.model_validate_json(EXAMPLE.read_text())


def _args(tmp_path: Path, *extra: str) -> list[str]:
    (tmp_path / "fixture_meta.json").write_text(json.dumps({"preset": "tiny"}))
    return ["--model", str(tmp_path), "--spec-method", "draft_model", "--draft", "d", *extra]


# ------------------------------------------------------------------ config


def test_plan_runs_fresh_in_engine_0_and_the_restored_phase_in_a_new_engine(
    tmp_path: Path,
) -> None:
    cfg = build_config(
        parse_args(_args(tmp_path, "--kv-transfer-config", json.dumps(OURS),
                         "--restart-from-storage"))
    )  # fmt: skip
    fresh, restored = cfg.phases
    assert (fresh.name, fresh.engine) == ("fresh", 0)
    assert (restored.name, restored.engine, restored.reference) == (RESTORED_STORAGE, 1, "fresh")
    assert restored.prompts == fresh.prompts == "base" and not restored.reset_before
    assert cfg.prompts_per_group == 1  # no prompt hits another's prefix: hits via storage
    assert cfg.l3_dir is None and cfg.kv_transfer_config == OURS  # storage set at run time
    first, second = engine_configs(cfg)
    assert [p.name for p in first.phases] == ["fresh"] and first.wait_l3_writes
    assert [p.name for p in second.phases] == [RESTORED_STORAGE] and not second.wait_l3_writes
    # any single-engine plan runs as it is
    default = build_config(parse_args(_args(tmp_path)))
    assert engine_configs(default) == [default]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "needs --kv-transfer-config"),
        (["--kv-transfer-config", '{"kv_connector": "OffloadingConnector"}'], "needs --kv"),
        (["--kv-transfer-config", json.dumps(OURS), "--prefix-cache-hit"], "choose one of"),
        (["--l3-dir", "/x"], "--l3-dir goes with --restart-from-storage"),
    ],
)
def test_plan_refuses_what_it_cannot_run(tmp_path: Path, extra: list[str], message: str) -> None:
    plan = [] if "--l3-dir" in extra else ["--restart-from-storage"]
    with pytest.raises(SystemExit, match=message):
        build_config(parse_args(_args(tmp_path, *plan, *extra)))


def test_a_given_l3_dir_must_be_empty(tmp_path: Path) -> None:
    l3 = tmp_path / "l3"
    args = _args(tmp_path, "--kv-transfer-config", json.dumps(OURS), "--restart-from-storage")
    assert build_config(parse_args([*args, "--l3-dir", str(l3)])).l3_dir == str(l3)  # new
    l3.mkdir()
    (l3 / "old.data").write_bytes(b"x")
    with pytest.raises(SystemExit, match="not an empty directory"):
        build_config(parse_args([*args, "--l3-dir", str(l3)]))


def test_storage_config_is_one_the_connector_accepts(tmp_path: Path) -> None:
    kv = storage_transfer_config(OURS, str(tmp_path))
    cfg = parse_config(kv["kv_connector_extra_config"])  # the connector's own parser
    assert cfg.l3.enabled and cfg.l3.hit_policy == "always" and cfg.l3.log_decisions
    assert cfg.l3.lmcache["remote_url"] == f"fs://{tmp_path}"
    assert cfg.cpu_bytes == 400_000_000 and cfg.chunk_size == 32
    assert OURS["kv_connector_extra_config"].get("l3") is None  # the given dict is untouched
    # a policy the user gave is kept; storage the user named is refused (the plan owns it)
    mine = json.loads(json.dumps(OURS))
    mine["kv_connector_extra_config"]["l3"] = {"hit_policy": "cost"}
    assert (
        parse_config(storage_transfer_config(mine, "/d")["kv_connector_extra_config"]).l3.hit_policy
        == "cost"
    )
    for key, value in (("lmcache.remote_url", "fs:///a"), ("l3", {"config_file": "c.yaml"})):
        named = json.loads(json.dumps(OURS))
        named["kv_connector_extra_config"][key] = value
        with pytest.raises(ValueError, match="kv_connector_extra_config.(lmcache.remote_url|l3)"):
            storage_transfer_config(named, "/d")


def test_storage_dir_temporary_or_given(tmp_path: Path) -> None:
    cfg = RunConfig(model="m", kv_transfer_config=OURS, phases=plan_restart())
    with storage_dir(cfg) as (run_cfg, kept):
        temp = Path(run_cfg.l3_dir)
        assert temp.is_dir() and not kept
        url = run_cfg.kv_transfer_config["kv_connector_extra_config"]["lmcache.remote_url"]
        assert url == f"fs://{temp}"
    assert not temp.exists()  # removed after the run
    given = tmp_path / "a" / "l3"
    with storage_dir(cfg.model_copy(update={"l3_dir": str(given)})) as (run_cfg, kept):
        assert kept and run_cfg.l3_dir == str(given.resolve())
    assert given.is_dir()  # a given directory is kept
    plain = RunConfig(model="m")
    with storage_dir(plain) as (run_cfg, kept):
        assert run_cfg is plain and not kept


# ------------------------------------------------------------------ engine 0: writes


def test_settle_waits_until_files_and_counters_stop_changing(tmp_path: Path) -> None:
    """Each step lands one more unit file and bumps the write counter, three times:
    settled only once neither changed for settle_s."""
    counters = {"vllm:draft_offload_stored_chunks{tier=l3}": 0.0}
    steps = []

    def step() -> None:
        steps.append(1)
        if len(steps) <= 3:
            (tmp_path / f"u{len(steps)}.data").write_bytes(b"unit")
            counters["vllm:draft_offload_stored_chunks{tier=l3}"] += 1

    writes = settle_writes(tmp_path, step, lambda: dict(counters), settle_s=0.5, limit_s=30)
    assert writes.settled and writes.stored_chunks == 3 and writes.write_dropped == 0
    assert len(steps) > 3 and writes.settle_s >= 0.5


def test_settle_gives_up_at_its_limit(tmp_path: Path) -> None:
    n = iter(range(10**6))

    def step() -> None:  # writes never stop
        (tmp_path / f"u{next(n)}.data").write_bytes(b"unit")

    writes = settle_writes(tmp_path, step, dict, settle_s=0.5, limit_s=1.0)
    assert not writes.settled and 1.0 <= writes.settle_s < 3


# ------------------------------------------------------------------ engine 1: reads


def test_recorded_run_restored_everything_from_storage(example: AcceptCheckResult) -> None:
    assert example.error is None and example.env.versions["vllm"] == "0.33.0"
    fresh, restored = example.phases
    assert (fresh.spec.engine, restored.spec.engine) == (0, 1)
    assert [r.num_cached_tokens for r in fresh.requests] == [0, 0]  # engine 0 ran fresh
    writes = example.storage.writes
    assert writes.settled and writes.units_in_storage == writes.stored_chunks == 16
    reads = example.summary.storage_reads
    assert reads.from_storage and reads.hit_tokens == 2 * 254 and reads.prompt_tokens == 512
    assert reads.fetched_chunks == reads.restored_chunks == reads.lookup_hit_chunks == 16
    assert reads.fetched_bytes["draft"] > 0  # the drafter's KV came back from storage too
    assert example.summary.acceptance_ratio == pytest.approx(1.0)
    assert example.summary.all_outputs_match and fresh.acceptance_length > 3.5
    assert any("fetched" in line for line in example.storage.decisions)
    # the recorded summary is what summarize() gives, and the JSON round-trips
    assert summarize(example.phases) == example.summary
    assert json.loads(example.model_dump_json()) == json.loads(EXAMPLE.read_text())


def test_hits_not_from_storage_are_told_apart(example: AcceptCheckResult) -> None:
    phase = example.phases[1].model_copy(deep=True)
    # a request that recomputed (storage declined, say): not every request hit
    phase.requests[1].num_cached_tokens = 0
    phase.connector_counters["vllm:draft_offload_l3_declined_chunks{cause=fetch_too_slow}"] = 8
    reads = storage_reads(phase)
    assert not reads.from_storage and reads.requests_hit == 1
    assert reads.declined_chunks == {"fetch_too_slow": 8}
    # units restored that no fetch brought (they came from elsewhere)
    phase = example.phases[1].model_copy(deep=True)
    phase.connector_counters["vllm:draft_offload_loaded_chunks{tier=l3}"] = 8
    assert not storage_reads(phase).from_storage
    # a run with no storage counters at all (another connector)
    phase.connector_counters = {}
    assert not storage_reads(phase).from_storage


def test_merge_names_the_engine_that_failed(example: AcceptCheckResult) -> None:
    cfg = RunConfig.model_validate(example.config["run"])
    first = example.model_copy(deep=True, update={"phases": example.phases[:1]})
    second = example.model_copy(deep=True, update={"phases": example.phases[1:], "storage": None})
    second.init_s, second.error = 7.5, "Traceback ...\nRuntimeError: boom"
    line = "INFO [l3_decisions.py:79] L3 decision req=0 policy=always: ... -> fetched"
    merged = merge_results(cfg, [first, second], ["", f"noise\n{line}\nmore"], kept=True)
    assert [p.spec.name for p in merged.phases] == ["fresh", RESTORED_STORAGE]
    assert merged.error.startswith("engine 1 (restarted): Traceback")
    assert merged.storage.restart_init_s == 7.5 and merged.storage.l3_dir_kept
    assert merged.storage.decisions == [line] == decision_lines(f"x\n  {line}  \n")
    assert merged.storage.writes == example.storage.writes
    # engine 0 failed: engine 1 never ran
    first.error = "engine subprocess exited with -9"
    assert merge_results(cfg, [first], [""], kept=False).error.startswith("engine 0: ")


# ------------------------------------------------------------------ table


def test_table_column_ours_storage_restart(example: AcceptCheckResult, tmp_path: Path) -> None:
    assert acceptance_cell(example) == "1.00 (4.00 / 4.00), 2/2, 254 from storage"
    bad = example.model_copy(deep=True)
    bad.phases[1].requests[0].num_cached_tokens = 0
    bad.summary = summarize(bad.phases)
    assert acceptance_cell(bad) == (
        "1.00 (4.00 / 4.00), 2/2, 127, NOT from storage (1/2 requests hit)"
    )
    shutil.copy(EXAMPLE, tmp_path / "accept_self-ours_l3.json")
    results = load_results(tmp_path)
    assert set(results) == {("self", "ours_l3")}
    header, _, row = render(results).split("### B.")[1].strip().splitlines()[-3:]
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns == [
        "drafter",
        "none",
        "ours, CPU tier (DraftOffloadConnector)",
        "ours, storage after restart (ours_l3)",
        "native (OffloadingConnector)",
        "lmcache (LMCacheConnectorV1)",
    ]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3] == "1.00 (4.00 / 4.00), 2/2, 254 from storage"
    assert cells[1] == cells[2] == cells[4] == cells[5] == "–"


# ------------------------------------------------------------------ end to end (CPU vLLM)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_draft_offload.bench.fixtures.build import FIXTURES, build_fixtures

    out = tmp_path_factory.mktemp("tiny_fixtures")
    build_fixtures(out, seed=0, preset_name="tiny", max_steps=3, log=lambda _s: None, only=FIXTURES)
    return out


@pytest.mark.e2e
def test_e2e_restarted_engine_restores_from_storage(tiny: Path, tmp_path: Path) -> None:
    """Two real engine processes on one fs:// directory. self-draft: the drafter is the
    target, so with right draft KV nearly every draft is accepted (a wrong one would
    show as lower acceptance in the restarted engine)."""
    out, l3 = tmp_path / "restart.json", tmp_path / "l3"
    rc = cli.main(
        ["accept", "--fixtures", str(tiny), "--spec-method", "draft_model",
         "--draft", str(tiny / "self-draft"), "--num-prompts", "2", "--max-tokens", "24",
         "--kv-transfer-config", json.dumps(OURS), "--restart-from-storage",
         "--l3-dir", str(l3), "--out", str(out)]
    )  # fmt: skip
    res = AcceptCheckResult.model_validate_json(out.read_text())
    assert rc == 0 and res.error is None, res.error
    fresh, restored = res.phases
    assert [r.num_cached_tokens for r in fresh.requests] == [0, 0]
    writes = res.storage.writes
    units = unit_files(l3)
    assert writes.settled and writes.units_in_storage == len(units) == writes.stored_chunks
    assert writes.write_dropped == writes.store_failed == 0 and res.storage.l3_dir_kept
    # every prompt token but the two the connector leaves to compute came from storage
    assert [r.num_cached_tokens for r in restored.requests] == [
        r.prompt_len - 2 for r in restored.requests
    ]
    reads = res.summary.storage_reads
    assert reads.from_storage and reads.fetched_chunks == len(units)
    assert reads.device_cached_tokens == 0 and not reads.fallbacks and not reads.refusals
    assert fresh.acceptance_length > 3.5
    assert res.summary.acceptance_ratio == pytest.approx(1.0)
    assert res.summary.all_outputs_match
