"""`vllm-draft-offload decode-overhead`: its bookkeeping on CPU (the engines need a GPU)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from vllm_draft_offload.bench import cli
from vllm_draft_offload.bench import machine_state as ms
from vllm_draft_offload.bench.speed import decode_batches, decode_configs, decode_engine
from vllm_draft_offload.bench.speed import decode_overhead as dec
from vllm_draft_offload.bench.speed import decode_report as rep


def test_store_config_stores_decode_and_none_has_no_connector() -> None:
    assert decode_configs.connector_config("none", 24, 256) is None
    store = decode_configs.connector_config("store", 1.5, 128)
    assert store is not None and store["kv_connector"] == "DraftOffloadConnector"
    assert store["kv_connector_extra_config"] == {
        "cpu_bytes_to_use": int(1.5 * 2**30),
        "chunk_size": 128,
        "store_decode": True,
    }
    # idle: the connector's hooks run every step, but no request is long enough to store.
    idle = decode_configs.connector_config("idle", 1.5, 128, max_request_tokens=1600)
    assert idle is not None and idle["kv_connector"] == "DraftOffloadConnector"
    assert idle["kv_connector_extra_config"]["min_store_tokens"] == 1601
    assert "copy_path" not in idle["kv_connector_extra_config"]
    memcpy = decode_configs.connector_config("store", 1.5, 128, copy_path="memcpy")
    assert memcpy is not None and memcpy["kv_connector_extra_config"]["copy_path"] == "memcpy"
    with pytest.raises(ValueError, match="unknown config"):
        decode_configs.connector_config("bogus", 1, 256)


def test_null_and_native_configs_name_their_connectors() -> None:
    from vllm_draft_offload.bench.speed import null_connector

    null = decode_configs.connector_config("null", 1.5, 128)
    assert null is not None and null["kv_connector"] == "NullConnector"
    # vLLM imports the class from this module path: it must be where the config says.
    module = __import__(null["kv_connector_module_path"], fromlist=["x"])
    assert getattr(module, null["kv_connector"]) is null_connector.NullConnector
    native = decode_configs.connector_config("native", 1.5, 128)
    assert native is not None and native["kv_connector"] == "OffloadingConnector"
    assert native["kv_connector_extra_config"] == {"cpu_bytes_to_use": int(1.5 * 2**30)}


def test_forced_store_configs_pin_the_copy_path_whatever_the_flag_says() -> None:
    """store_dma / store_kernel are `store` with every copy on one path, so one run
    compares them side by side; the connector's own config parser accepts them."""
    from vllm_draft_offload.config import parse_config

    store = decode_configs.connector_config("store", 1.5, 128, copy_path="kernel")
    assert store is not None
    for config, path in (("store_dma", "memcpy"), ("store_kernel", "kernel")):
        for flag in (None, "auto", "memcpy", "kernel"):
            forced = decode_configs.connector_config(config, 1.5, 128, copy_path=flag)
            assert forced is not None
            extra = forced["kv_connector_extra_config"]
            assert extra == {**store["kv_connector_extra_config"], "copy_path": path}
            assert parse_config(extra).copy_path == path
    rates = {"none": [100.0], "store_dma": [98.0], "store_kernel": [80.0]}
    report = {
        "batch": 2, "prompt_tokens": 256, "decode_tokens": 64, "chunk_size": 128,
        "configs": {
            name: [{"reps": [{"decode_tok_s": v} for v in values]}]
            for name, values in rates.items()
        },
    }  # fmt: skip
    rep.summarize(report)
    assert report["summary"]["store_dma_vs_none"] == pytest.approx(0.98)
    assert report["summary"]["store_kernel_vs_none"] == pytest.approx(0.80)


def test_prompts_are_new_to_every_batch_and_the_same_in_every_engine() -> None:
    batches = [decode_batches.batch_prompts(rep, 4, 300) for rep in (-1, 0, 1)]
    firsts = {tuple(p[:16]) for batch in batches for p in batch}
    assert len(firsts) == 12  # no two prompts share a first block: no prefix hits
    assert decode_batches.batch_prompts(0, 4, 300) == batches[1]  # none and store see the same
    assert all(len(p) == 300 and min(p) >= decode_batches.FIRST_TOKEN for b in batches for p in b)


def test_whole_chunks_count_every_token_a_verified_draft_may_end_with() -> None:
    assert rep.whole_chunks(1024, 512, 256) == 6  # the last token may be a verified draft
    assert rep.whole_chunks(1024, 257, 256) == 5
    assert rep.whole_chunks(1024, 255, 256) == 4
    # The default turn 1 answer is long enough for decode KV to be stored and reused.
    args = dec.build_parser().parse_args(["--out", "x"])
    reused = rep.whole_chunks(args.prompt_tokens, args.turn_decode_tokens, args.chunk_size)
    assert reused * args.chunk_size > args.prompt_tokens


def test_decode_rate_spans_last_first_token_to_last_token() -> None:
    records = [
        {"out_len": 101, "first_ts": 10.0, "last_ts": 12.0},
        {"out_len": 101, "first_ts": 10.5, "last_ts": 12.5},
    ]
    assert rep.decode_rate(records) == {
        "decode_tokens": 200,
        "decode_s": 2.0,
        "decode_tok_s": 100.0,
    }
    # No engine timestamps (metrics off): no rate rather than a wrong one.
    assert rep.decode_rate([{"out_len": 5}])["decode_tok_s"] is None


def _rep(rate: float, stored: float = 96.0) -> dict:
    return {"decode_tok_s": rate, "stored_chunks": stored, "hit_tokens": 0}


def _turns(restored_hits: list[int], same: bool = True) -> dict:
    return {
        "prompt_tokens": 1024,
        "answer_tokens": 384,
        "turn2_tokens": [1472, 1472],
        "fresh": {"outputs": [[1, 2]], "hit_tokens": [0, 0], "acceptance_length": 2.0},
        "restored": {
            "outputs": [[1, 2]] if same else [[1, 3]],
            "hit_tokens": restored_hits,
            "acceptance_length": 1.9,
        },
    }


def _report(**configs: list) -> dict:
    return {
        "batch": 16, "prompt_tokens": 1024, "decode_tokens": 512, "chunk_size": 256,
        "configs": configs,
    }  # fmt: skip


def test_summary_compares_medians_over_rounds_and_counts_stored_chunks() -> None:
    report = _report(
        none=[{"reps": [_rep(1000.0), _rep(1010.0)]}, {"reps": [_rep(990.0)]}],
        idle=[{"reps": [_rep(995.0, stored=0.0)]}],
        store=[
            {"reps": [_rep(980.0), _rep(985.0, stored=95.0)], "turns": _turns([1280, 1280])},
            {"reps": [_rep(975.0)]},
        ],
    )
    rep.summarize(report)
    summary = report["summary"]
    assert summary["decode_tok_s"] == {"none": 1000.0, "idle": 995.0, "store": 980.0}
    assert summary["store_vs_none"] == 0.98 and summary["goal_0.97_met"] is True
    assert summary["idle_vs_none"] == 0.995
    # The fastest batch of each config, and the spread the medians hide.
    assert summary["decode_tok_s_best"] == {"none": 1010.0, "idle": 995.0, "store": 985.0}
    assert summary["decode_tok_s_range"]["none"] == [990.0, 1010.0]
    assert summary["store_vs_none_best"] == 985.0 / 1010.0
    assert summary["idle_vs_none_best"] == 995.0 / 1010.0
    assert summary["null_vs_none"] is None and summary["idle_vs_null"] is None  # not run
    assert summary["expected_chunks_per_batch"] == 16 * 6
    assert summary["stored_fraction"] == 95.0 / 96.0  # the worst batch
    turns = summary["turns"]
    assert turns["expected_hit_tokens"] == 1280 and turns["decode_kv_reused"] is True
    assert turns["outputs_match"] is True and turns["acceptance_ratio"] == 1.9 / 2.0
    row = rep.table_row("small", report)
    assert row == {
        "shape": "small", "decode_tok_s_none": 1000.0, "decode_tok_s_store": 980.0,
        "store_vs_none": 0.98, "idle_vs_none": 0.995, "store_on_vs_off_paired": None,
        "none_on_vs_off_paired": None, "paired_by_config": {}, "store_off_vs_none": None,
        "stored_fraction": 95.0 / 96.0,
        "turn2_decode_kv_reused": True, "turn2_outputs_match": True,
        "turn2_acceptance_ratio": 0.95,
    }  # fmt: skip


def test_null_splits_idle_overhead_into_vllms_plumbing_and_ours() -> None:
    report = _report(
        none=[{"reps": [_rep(1000.0)]}],
        null=[{"reps": [_rep(900.0)]}],
        idle=[{"reps": [_rep(810.0, stored=0.0)]}],
        native=[{"reps": [_rep(850.0)]}],
    )
    rep.summarize(report)
    summary = report["summary"]
    assert summary["null_vs_none"] == 0.9 and summary["idle_vs_null"] == 0.9
    assert summary["decode_tok_s_best"]["idle"] == 810.0
    assert summary["idle_vs_none"] == 0.81 and summary["native_vs_none"] == 0.85
    assert summary["store_vs_none"] is None and summary["goal_0.97_met"] is None


def test_a_slow_store_a_prompt_only_hit_or_a_failed_engine_show() -> None:
    report = _report(
        none=[{"reps": [_rep(1000.0)]}],
        store=[{"reps": [_rep(960.0)], "turns": _turns([1024, 1280], same=False)}],
    )
    rep.summarize(report)
    summary = report["summary"]
    assert summary["goal_0.97_met"] is False
    # One request hit only its prompt: its answer's decode KV was not reused.
    assert summary["turns"]["decode_kv_reused"] is False
    assert summary["turns"]["outputs_match"] is False
    failed = _report(none=[{"error": "engine died"}], store=[{"reps": [_rep(960.0)]}])
    rep.summarize(failed)
    assert failed["summary"]["store_vs_none"] is None
    assert failed["summary"]["goal_0.97_met"] is None
    assert rep.table_row("llama8b", failed)["turn2_outputs_match"] is None


def test_child_gets_every_setting_of_the_parent(tmp_path: Path) -> None:
    parser = dec.build_parser()
    args = parser.parse_args(
        ["--out", "o.json", "--batch", "8", "--prompt-tokens", "512", "--decode-tokens", "300",
         "--reps", "2", "--chunk-size", "128", "--cpu-gib", "3.5", "--gpu-mem", "0.4",
         "--turn-prompts", "2", "--turn-decode-tokens", "200", "--turn-user-tokens", "32",
         "--enforce-eager", "--copy-path", "memcpy"]
    )  # fmt: skip
    cmd = dec.child_command(args, "store", "/t", "/d", tmp_path / "c.json")
    assert cmd[1:3] == ["-m", dec.MODULE]
    child = parser.parse_args(cmd[3:])
    assert (child.child, child.config, child.target, child.draft) == (
        str(tmp_path / "c.json"), "store", "/t", "/d",
    )  # fmt: skip
    for flag in dec.CHILD_FLAGS:
        assert getattr(child, flag) == getattr(args, flag), flag
    assert child.enforce_eager is True and child.copy_path == "memcpy"
    default = dec.child_command(parser.parse_args(["--out", "o"]), "store", "/t", "/d", tmp_path)
    assert parser.parse_args(default[3:]).copy_path is None  # the connector's default
    assert "--draft" not in dec.child_command(args, "none", "/t", None, tmp_path / "n.json")


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--shape", "small,huge"], "--shape"),
        (["--shape", "small,small"], "--shape"),
        (["--configs", "none,bogus"], "--configs"),
        (["--reps", "0"], "--reps"),
        (["--turn-prompts", "-1"], "--turn-prompts"),
    ],
)
def test_bad_options_are_refused_by_name(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        cli.main(["decode-overhead", "--out", "/tmp/never.json", *argv])
    assert flag in capsys.readouterr().err


def test_time_hooks_counts_the_hooks_of_both_halves_only_while_on(
    model_dirs: tuple[Path, Path],
) -> None:
    """--time-hooks on the real Scheduler and both connector halves (tests/kv_sim.py):
    every hook the steps call is timed while the clock is on, nothing while off."""
    from kv_sim import SimEngine, SimSetup, prompt

    eng = SimEngine(*model_dirs, SimSetup())
    clock = decode_engine.hook_clock(eng.scheduler, eng.worker)
    eng.add_request("off", prompt(1, 40), max_tokens=3)
    eng.run_until_done()
    assert clock.take() == {"ms": {}, "calls": {}, "max_ms": {}}
    clock.on = True
    eng.add_request("on", prompt(2, 70), max_tokens=4)
    eng.run_until_done()
    clock.on = False
    taken = clock.take()
    steps = taken["calls"]["schedule"]
    assert steps >= 4  # prefill and three decode steps (and the store's report)
    for name in ("sched.build_connector_meta", "worker.wait_for_save", "worker.start_load_kv"):
        assert taken["calls"][name] == steps, name
    assert taken["calls"]["sched.get_num_new_matched_tokens"] >= 1
    calls = taken["calls"]
    assert calls.get("sched.request_finished", 0) + calls["sched.request_finished_all_groups"] == 1
    assert all(ms >= 0 for ms in taken["ms"].values())
    assert taken["ms"]["worker.wait_for_save"] > 0  # it stored the prompt's chunks
    assert taken["max_ms"].keys() == taken["ms"].keys()
    for name, longest in taken["max_ms"].items():
        # One call's time: within the sum, and at least the mean of the calls.
        assert taken["ms"][name] / calls[name] - 1e-3 <= longest <= taken["ms"][name], name
    assert clock.take() == {"ms": {}, "calls": {}, "max_ms": {}}


def test_each_engine_is_written_out_before_the_next_one_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lease can end mid-run: the output file holds every finished engine's result as
    the next one starts. Each engine here is a real child process (a stand-in for the
    engine, which cannot start fast enough for CI) that checks the file for the engines
    before it, then writes its own result; a failed engine is recorded and the run goes
    on."""
    out = tmp_path / "d.json"
    script = tmp_path / "child.py"
    script.write_text(
        "import json, sys\n"
        "out, child, index = sys.argv[1], sys.argv[2], int(sys.argv[3])\n"
        "if index:\n"
        "    seen = json.load(open(out))\n"
        "    runs = [r for rs in seen['shapes']['small']['configs'].values() for r in rs]\n"
        "    assert seen['complete'] is False and len(runs) == index, seen\n"
        "if index == 1:\n"
        "    sys.exit('engine died')\n"
        "json.dump({'reps': [{'decode_tok_s': 100.0 + index}]}, open(child, 'w'))\n"
    )
    calls: list[str] = []

    def child_command(args, config, target, draft, child_out):  # noqa: ANN001, ANN202
        calls.append(config)
        return [sys.executable, str(script), args.out, str(child_out), str(len(calls) - 1)]

    monkeypatch.setattr(dec, "child_command", child_command)
    monkeypatch.setattr(dec, "summarize", lambda report: report.setdefault("summary", {}))
    monkeypatch.setattr(dec, "table_row", lambda name, report: {"shape": name})
    args = dec.build_parser().parse_args(["--out", str(out), "--shape", "small", "--rounds", "2"])
    args.configs = ["none", "store"]  # main() splits --configs
    report = dec.run_shape(
        args,
        "small",
        tmp_path / "work",
        checkpoint=lambda partial: dec.write_out(out, {"small": partial}, complete=False),
    )
    assert calls == ["none", "store", "none", "store"]
    written = json.loads(out.read_text())
    assert written["complete"] is False and written["table"] == []
    configs = written["shapes"]["small"]["configs"]
    assert [r["reps"][0]["decode_tok_s"] for r in configs["none"]] == [100.0, 102.0]
    assert "engine died" in configs["store"][0]["error"]
    assert configs["store"][1]["reps"][0]["decode_tok_s"] == 103.0
    assert dec.engine_line(configs["store"][0]) == "error: engine died"
    assert dec.engine_line(configs["none"][1]) == "decode tok/s per batch [102]"
    final = dec.write_out(out, {"small": report}, complete=True)
    assert final["complete"] is True and final["table"] == [{"shape": "small"}]


def test_pairs_alternate_their_order_and_only_storing_engines_opt_out() -> None:
    assert decode_batches.batch_arms(3, paired=True) == [
        (0, "on"), (0, "off"), (1, "off"), (1, "on"), (2, "on"), (2, "off"),
    ]  # fmt: skip
    assert decode_batches.batch_arms(2, paired=False) == [(0, "on"), (1, "on")]
    opt_out = {"draft_offload": {"store": False}}
    for config in ("store", "store_dma", "store_kernel"):
        assert decode_batches.arm_params(config, "off") == opt_out
        assert decode_batches.arm_params(config, "on") is None
    for config in ("none", "idle", "null", "native"):
        assert decode_batches.arm_params(config, "off") is None
    # The opt-out is what the connector reads from a request's kv_transfer_params.
    from vllm_draft_offload.request_options import request_options

    assert request_options(opt_out) == request_options(None).model_copy(update={"store": False})
    # On batches keep the prompts every engine shares; off batches get new ones.
    assert decode_batches.arm_prompts(1, "on", 2, 64) == decode_batches.batch_prompts(1, 2, 64)
    on = {tuple(p[:16]) for r in range(3) for p in decode_batches.arm_prompts(r, "on", 4, 64)}
    off = {tuple(p[:16]) for r in range(3) for p in decode_batches.arm_prompts(r, "off", 4, 64)}
    assert len(on) == len(off) == 12 and not on & off


def _pair(rep_index: int, on: float, off: float) -> list[dict]:
    return [
        {"rep": rep_index, "arm": "on", **_rep(on)},
        {"rep": rep_index, "arm": "off", **_rep(off, stored=0.0)},
    ]


def test_paired_ratios_divide_out_each_engines_speed() -> None:
    """Two store engines, one 30 % faster than the other: across engines the medians
    mix their speeds; per pair, both show the stores' 2 % cost. none's pairs are the
    noise floor."""
    report = _report(
        none=[{"reps": _pair(0, 1000.0, 1010.0) + _pair(1, 990.0, 980.0)}],
        store=[
            {"reps": _pair(0, 980.0, 1000.0) + _pair(1, 1274.0, 1300.0)},
            {"reps": _pair(0, 1078.0, 1100.0)},
        ],
    )
    rep.summarize(report)
    summary = report["summary"]
    store = summary["paired"]["store"]
    assert store["pairs"] == 3 and store["on_vs_off"] == pytest.approx(0.98)
    assert store["range"] == [pytest.approx(0.98), pytest.approx(0.98)]
    none = summary["paired"]["none"]
    assert none["pairs"] == 2 and none["range"] == [1000.0 / 1010.0, 990.0 / 980.0]
    # Unpaired figures use on batches only; off batches of storing engines vs none.
    assert summary["decode_tok_s"]["store"] == 1078.0
    assert summary["stored_chunks_per_batch"] == [96.0, 96.0, 96.0]
    assert summary["store_off_vs_none"] == pytest.approx(1100.0 / 995.0)
    row = rep.table_row("llama8b", report)
    assert row["store_on_vs_off_paired"] == pytest.approx(0.98)
    assert row["none_on_vs_off_paired"] == none["on_vs_off"]
    assert row["paired_by_config"] == {
        name: {"on_vs_off": p["on_vs_off"], "ci95": p["ci95"], "pairs": p["pairs"]}
        for name, p in (("none", none), ("store", store))
    }
    # Reps without wall and decode seconds have no prefill figures.
    assert summary["paired_prefill"] == {"none": None, "store": None}
    # A report from before pairs (no arms) has no paired figures.
    old = _report(none=[{"reps": [_rep(1000.0)]}], store=[{"reps": [_rep(990.0)]}])
    rep.summarize(old)
    assert old["summary"]["paired"] == {"none": None, "store": None}
    assert rep.table_row("llama8b", old)["paired_by_config"] == {}
    assert old["summary"]["store_vs_none"] == 0.99


def test_median_interval_brackets_the_median_and_narrows_with_more_pairs() -> None:
    rng = np.random.default_rng(1)
    few = list(rng.normal(1.0, 0.1, 10))
    many = list(rng.normal(1.0, 0.1, 160))
    for values in (few, many):
        low, high = rep.median_ci(values)
        assert low <= float(np.median(values)) <= high
    assert rep.median_ci(few) == rep.median_ci(few)  # seeded: a report reads the same
    width = [high - low for low, high in (rep.median_ci(few), rep.median_ci(many))]
    assert width[1] < width[0] / 2


def test_rank_correlation() -> None:
    assert rep.rank_correlation([1, 2, 3, 4], [10, 20, 30, 45]) == pytest.approx(1.0)
    assert rep.rank_correlation([1, 2, 3, 4], [9, 7, 3, 1]) == pytest.approx(-1.0)
    assert rep.rank_correlation([1, 2, 3], [5, 5, 5]) is None  # a constant series
    assert rep.rank_correlation([1, 2], [1, 2]) is None  # too few points


def _machine(steal: float, clock: int, reasons: list[str] | None = None) -> dict:
    return {
        "gpu_util_pct": 100 - 1000 * steal,
        "steal_share": steal,
        "busy_share": 0.2,
        "sm_clock_mhz": {"min": clock, "median": clock, "max": clock},
        "clock_reasons": reasons or [],
    }


def test_machine_link_tells_whether_slow_batches_had_stolen_cpu_or_a_low_clock() -> None:
    reps = [
        {**_rep(5000.0), "machine": _machine(0.00, 1980)},
        {**_rep(4000.0), "machine": _machine(0.02, 1980)},
        {**_rep(3000.0), "machine": _machine(0.05, 1980, ["sw_power_cap"])},
        {**_rep(4500.0), "machine": _machine(0.01, 1980)},
    ]
    link = rep.machine_link([{"reps": reps}])
    assert link["batches"] == 4
    assert link["steal_share"]["range"] == [0.0, 0.05]
    assert link["steal_share"]["rank_corr_with_tok_s"] == pytest.approx(-1.0)
    assert link["sm_clock_mhz"]["rank_corr_with_tok_s"] is None  # the clock never moved
    assert link["gpu_util_pct"]["rank_corr_with_tok_s"] == pytest.approx(1.0)
    assert link["clock_reasons"] == ["sw_power_cap"]
    # Batches recorded before the sampler existed: nothing to say.
    assert rep.machine_link([{"reps": [_rep(1000.0)]}]) is None
    report = _report(store=[{"reps": reps}])
    rep.summarize(report)
    assert report["summary"]["machine"]["store"] == link


def test_cpu_shares_leave_guest_time_out_of_the_total() -> None:
    times = type(psutil.cpu_times())
    fields = times._fields
    before = times(*[0.0] * len(fields))
    after = dict.fromkeys(fields, 0.0)
    after.update(user=6.0, system=2.0, idle=10.0, steal=2.0)
    if "guest" in fields:
        after["guest"] = 5.0  # already inside user on Linux
    shares = ms.cpu_shares(before, times(**after))
    assert shares["steal_share"] == pytest.approx(2.0 / 20.0)
    assert shares["busy_share"] == pytest.approx(8.0 / 20.0)
    assert ms.cpu_shares(before, before)["steal_share"] is None
    # nvml.h's bits; idle (0x1) and the application clock setting (0x2) are no limit
    assert ms.reason_names(0x1 | 0x2 | 0x4 | 0x40) == ["sw_power_cap", "hw_thermal_slowdown"]


def test_top_processes_name_where_cpu_time_went() -> None:
    before = {1: ("engine", 10.0), 2: ("front", 5.0), 3: ("idle", 1.0)}
    after = {1: ("engine", 12.5), 2: ("front", 5.5), 3: ("idle", 1.0), 4: ("new", 0.25)}
    assert ms.top_processes(before, after) == [
        {"pid": 1, "name": "engine", "cpu_s": 2.5},
        {"pid": 2, "name": "front", "cpu_s": 0.5},
        {"pid": 4, "name": "new", "cpu_s": 0.25},  # started in the window: from zero
    ]


def test_machine_sampler_sees_this_process_keep_a_core_busy() -> None:
    with ms.MachineSampler(period_s=0.02) as sampler:
        end = time.perf_counter() + 0.4
        while time.perf_counter() < end:
            pass
    summary = sampler.summary
    assert summary["seconds"] >= 0.4 and summary["cpus"] >= 1
    assert summary["busy_share"] * summary["cpus"] >= 0.5  # at least half a core busy
    me = [row for row in summary["top_processes"] if row["pid"] == os.getpid()]
    assert me and me[0]["cpu_s"] >= 0.2
    assert 0.0 <= summary["steal_share"] <= 1.0
    if summary["sm_clock_mhz"] is None:  # no GPU here: its fields say so
        assert summary["power_w"] is None and summary["gpu_util_pct"] is None


def test_machine_sampler_names_the_thread_that_kept_a_core_busy() -> None:
    """A spinning thread of a watched process comes first, under its OS name (read
    while it lives: a thread that has ended has no CPU time to read)."""
    done = threading.Event()

    def spin() -> None:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as comm:
            comm.write("spinner")
        end = time.perf_counter() + 0.4
        while time.perf_counter() < end:
            pass
        done.wait()

    thread = threading.Thread(target=spin)
    with ms.MachineSampler(period_s=0.02, watch=(psutil.Process().name(),)) as sampler:
        thread.start()
        time.sleep(0.5)
    done.set()
    thread.join()
    mine = sampler.summary["threads"][str(os.getpid())]
    assert mine[0]["name"] == "spinner" and mine[0]["cpu_s"] >= 0.2
    assert len(mine) <= ms.TOP_THREADS


def test_gc_pauses_read_vllms_gc_debugger_lines() -> None:
    """Lines the real GC debugger logs for real collections, amid other log lines."""
    import gc
    import io
    import logging

    from vllm.utils import gc_utils

    debugger = gc_utils.GCDebugger(gc_utils.GCDebugConfig("1"))
    sink = io.StringIO()
    handler = logging.StreamHandler(sink)
    level = gc_utils.logger.level
    gc_utils.logger.addHandler(handler)
    gc_utils.logger.setLevel(logging.INFO)  # as an engine logs it (VLLM_LOGGING_LEVEL)
    gc.callbacks.append(debugger.handle)
    try:
        gc.collect(0)
        gc.collect(2)
    finally:
        gc.callbacks.remove(debugger.handle)
        gc_utils.logger.removeHandler(handler)
        gc_utils.logger.setLevel(level)
    log = "INFO engine started\n" + sink.getvalue() + "decode-overhead llama8b none\n"
    pauses = ms.gc_pauses(log)
    assert pauses["0"]["count"] == 1 and pauses["2"]["count"] == 1
    assert pauses["2"]["total_ms"] == pauses["2"]["max_ms"] >= 0
    assert ms.gc_pauses(
        "GC took 2.5ms to complete. Collected 3 objects (out of 9) in GC "
        "generation 1.\nGC took 1.5ms to complete. Collected 0 objects (out "
        "of 4) in GC generation 1."
    ) == {"1": {"count": 2, "total_ms": 4.0, "max_ms": 2.5}}


def test_busy_threads_count_a_new_thread_from_zero() -> None:
    before = {10: ("loop", 4.0), 11: ("zmq", 1.0)}
    after = {10: ("loop", 5.5), 11: ("zmq", 1.0), 12: ("new", 0.5)}
    assert ms.busy_threads(before, after) == [
        {"tid": 10, "name": "loop", "cpu_s": 1.5},
        {"tid": 12, "name": "new", "cpu_s": 0.5},
    ]


def test_pool_reports_joins_every_files_pairs_per_shape_and_config(tmp_path: Path) -> None:
    first = {
        "gpu": "H100",
        "versions": {"vllm": "0.33.0"},
        "shapes": {"llama8b": _report(store=[{"reps": _pair(0, 980.0, 1000.0)}])},
    }
    second = {
        "gpu": "H100",
        "versions": {"vllm": "0.33.0"},
        "shapes": {
            "llama8b": _report(
                store=[{"reps": _pair(0, 1290.0, 1300.0) + _pair(1, 1000.0, 1000.0)}],
                none=[{"reps": _pair(0, 1000.0, 990.0)}],
            )
        },
    }
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, contents in zip(paths, (first, second), strict=True):
        path.write_text(json.dumps(contents))
    out = tmp_path / "pooled.json"
    dec.main(["--pool", *map(str, paths), "--out", str(out)])
    pooled = json.loads(out.read_text())
    assert [source["file"] for source in pooled["pooled_from"]] == list(map(str, paths))
    store = pooled["shapes"]["llama8b"]["summary"]["paired"]["store"]
    assert store["pairs"] == 3
    assert sorted(store["ratios"]) == pytest.approx(sorted([0.98, 1290.0 / 1300.0, 1.0]))
    assert pooled["table"][0]["store_on_vs_off_paired"] == pytest.approx(1290.0 / 1300.0)
    assert pooled["shapes"]["llama8b"]["summary"]["paired"]["none"]["pairs"] == 1


def test_prefill_pairs_time_what_stores_add_before_decoding() -> None:
    """Each batch's prefill seconds (wall less the decode span), storing over opting out
    per pair: session 29's DMA stores added 0.18 s to a 1.62 s prefill, where its decode
    rate did not move; a batch without both times is left out."""

    def pair(index: int, on_prefill: float, off_prefill: float) -> list[dict]:
        reps = _pair(index, 1000.0, 1000.0)
        for batch, prefill in zip(reps, (on_prefill, off_prefill), strict=True):
            batch.update(decode_s=2.0, wall_s=2.0 + prefill)
        return reps

    unmeasured = _pair(9, 1000.0, 1000.0)
    report = _report(
        none=[{"reps": pair(0, 1.61, 1.60) + pair(1, 1.60, 1.61)}],
        store=[{"reps": pair(0, 1.80, 1.62) + pair(1, 1.81, 1.61) + unmeasured}],
    )
    rep.summarize(report)
    store = report["summary"]["paired_prefill"]["store"]
    assert store["pairs"] == 2
    assert store["on_vs_off"] == pytest.approx((1.80 / 1.62 + 1.81 / 1.61) / 2)
    assert report["summary"]["paired"]["store"]["on_vs_off"] == 1.0
    row = rep.table_row("llama8b", report)["paired_by_config"]
    assert row["store"]["prefill_on_vs_off"] == store["on_vs_off"]
    assert row["none"]["prefill_on_vs_off"] == pytest.approx(1.0, abs=0.01)
    assert rep.prefill_s({"wall_s": 1.0, "decode_s": 2.0}) is None


UNSTAGED = {"store_staging_units": 0}


@pytest.mark.parametrize(
    ("config", "settings"),
    [
        ("store_thread", {"store_thread": True}),
        ("store_decode_dma", {"decode_stores_dma": True, **UNSTAGED}),
        ("store_decode_kernel", {"decode_stores_dma": False, **UNSTAGED}),
        ("store_staged", {"store_staging_units": 8}),
        ("store_staged1", {"store_staging_units": 1}),
        ("store_unstaged", UNSTAGED),
    ],
)
def test_a_store_variant_is_store_with_settings_of_its_own(
    config: str, settings: dict[str, bool | int]
) -> None:
    """store_thread: the issuer thread; store_decode_dma / store_decode_kernel: decode
    steps' stores by DMA or not, whatever the pages, with staging off (it would take
    their batches); store_staged / store_staged1 / store_unstaged: staging through 8
    units, 1, or none. Each is `store` (the defaults) with those settings, and its off
    batches opt out of stores."""
    from vllm_draft_offload.config import parse_config

    store = decode_configs.connector_config("store", 1.5, 128)
    variant = decode_configs.connector_config(config, 1.5, 128)
    assert store is not None and variant is not None
    extra = variant["kv_connector_extra_config"]
    assert extra == {**store["kv_connector_extra_config"], **settings}
    default = parse_config(store["kv_connector_extra_config"])
    parsed = parse_config(extra)
    for setting, value in settings.items():
        assert getattr(parsed, setting) == value
        assert getattr(default, setting) != value
    assert config in rep.STORING
