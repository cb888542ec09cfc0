"""`soak --idle-seconds` / `--baseline-first` (vllm_draft_offload.bench.stress.phases):
the request options by phase, the faults' schedule, and the phase split of the report on
synthetic runs (the CPU end to end run is in test_pressure_soak.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_draft_offload.bench.stress import phases as ph
from vllm_draft_offload.bench.stress import soak
from vllm_draft_offload.bench.stress.engine import StreamDriver
from vllm_draft_offload.bench.stress.faults import schedule
from vllm_draft_offload.request_options import RequestOptions, request_options

LEASE = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "lease.sh"


def test_idle_params_before_the_switch_plain_after() -> None:
    params_for = ph.idle_params(90.0)
    first, second = params_for(0.0), params_for(89.99)
    assert first == second == ph.IDLE_PARAMS
    assert first is not second and first["draft_offload"] is not second["draft_offload"]
    assert params_for(90.0) is None and params_for(200.0) is None
    # what the connector reads from them: neither stored nor restored
    assert request_options(first) == RequestOptions(store=False, load=False)
    assert ph.is_idle({"kv_transfer_params": first}) and not ph.is_idle({})
    assert not ph.is_idle({"kv_transfer_params": {"draft_offload": {}}})
    assert not ph.is_idle({"kv_transfer_params": {"draft_offload": {"store": True}}})


def test_idle_off_load_alone_keeps_stores_and_turns_restores_off() -> None:
    """``--idle-off load``: the idle phase stores and never restores, so the active
    phase's extra step time in the same engine is the restores'."""
    params = ph.idle_params(90.0, ("load",))(0.0)
    assert params == {"draft_offload": {"load": False}}
    assert request_options(params) == RequestOptions(store=True, load=False)
    assert ph.is_idle({"kv_transfer_params": params})
    note = ph.idle_note({"idle_seconds": 90.0, "idle_off": ["load"]})
    assert note == "Ours idle (requests sent `load: false`) for its first 90 s."
    # runs from before --idle-off turned both off
    assert "`store: false, load: false`" in ph.idle_note({"idle_seconds": 90.0})


class _FakeEngine:
    """``LLM.llm_engine``'s add_request/step: each request finishes at the next step."""

    def __init__(self) -> None:
        self.sent: dict[str, Any] = {}
        self.pending: list[str] = []
        self.clock = 0.0

    def add_request(self, rid: str, prompt: Any, params: Any) -> None:
        self.sent[rid] = params
        self.pending.append(rid)

    def step(self) -> list[Any]:
        done, self.pending = self.pending, []
        return [
            SimpleNamespace(
                request_id=rid,
                finished=True,
                outputs=[SimpleNamespace(token_ids=[1, 2], logprobs=None)],
                prompt_token_ids=[5, 6, 7],
                num_cached_tokens=0,
                metrics=None,
            )
            for rid in done
        ]


def test_stream_driver_sends_each_request_the_params_of_its_submit_time() -> None:
    engine = _FakeEngine()
    clock = iter(range(1000))
    submits: list[float] = []

    def params_for(t: float) -> dict[str, Any] | None:
        submits.append(t)
        # by submission, not by wall time: the first 5 requests are idle
        return ph.idle_params(5)(next(clock))

    def stream(_last: list[int] | None) -> tuple[str, list[int], int]:
        return ("system", [5, 6, 7], 2)

    res = StreamDriver(
        SimpleNamespace(llm_engine=engine), [stream, stream], max_requests=9, params_for=params_for
    ).run()
    assert res.stopped_by == "max_requests" and len(res.finished) == 9 == len(submits)
    sent = [engine.sent[f"s{f.stream}-{f.seq}"] for f in res.finished]
    kv = [(p.extra_args or {}).get("kv_transfer_params") for p in sent]
    assert kv == [ph.IDLE_PARAMS] * 5 + [None] * 4
    # the finished records say what each request was sent with
    assert [f.kv_params for f in res.finished] == kv
    # without params_for, nothing is sent (the baseline engine)
    engine = _FakeEngine()
    StreamDriver(SimpleNamespace(llm_engine=engine), [stream], max_requests=2).run()
    assert all(p.extra_args is None for p in engine.sent.values())


def test_faults_fall_in_the_active_phase_only() -> None:
    plan = ph.active_schedule(210.0, 90.0, ("outage", "corrupt"), None)
    assert plan and all(t >= 90.0 and t + hold <= 210.0 for t, _, hold in plan)
    assert [f for _, f, _ in plan][:2] == ["outage", "corrupt"]
    assert ph.active_schedule(60.0, 0.0, ("outage",), 10.0) == schedule(60.0, ("outage",), 10.0)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--seconds", "60", "--idle-seconds", "60"], "--idle-seconds"),
        (["--seconds", "60", "--idle-seconds", "-1"], "--idle-seconds"),
        (["--baseline-first", "--baseline-seconds", "0"], "--baseline-first"),
        (["--phase-margin", "-1"], "--phase-margin"),
        (["--idle-off", "store,copy"], "--idle-off"),
        (["--idle-off", ""], "--idle-off"),
        (["--l3-switch-interval-ms", "fast"], "--l3-switch-interval-ms"),
    ],
)
def test_soak_refuses_bad_phase_flags_by_name(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        soak.parse_args(["--out", "/tmp/never", *flags])
    assert message in capsys.readouterr().err


def test_the_lease_scripts_soak_order_phase_parses() -> None:
    """scripts/gpu/lease.sh's soak-order command: the flags exist, with these values."""
    text = LEASE.read_text()
    m = re.search(r'\[soak-order\]="([^"]*)"', text)
    assert m, "no soak-order phase in lease.sh"
    argv = shlex.split(m.group(1).replace("\\\n", " "))
    assert argv[:2] == ["vllm-draft-offload", "soak"]
    args = soak.parse_args(argv[2:])
    assert (args.baseline_first, args.no_faults) == (True, True)
    assert (args.idle_seconds, args.seconds, args.baseline_seconds) == (90.0, 210.0, 90.0)
    assert args.phase_margin == ph.DEFAULT_MARGIN_S and args.replay_n == 8
    assert str(args.out) == "/root/soak-order"
    assert "for d in soak-order soak-order-stores" in text  # collect brings both back
    assert '"/root/$d/soak.json"' in text
    assert soak.parse_args(["--out", "/tmp/x"]).idle_seconds == 0.0


def test_margin_is_at_most_a_quarter_of_the_shortest_window() -> None:
    assert ph.margin(20.0, [90.0, 90.0, 120.0]) == 20.0
    assert ph.margin(20.0, [4.0, 4.0, 6.0]) == 1.0
    assert ph.margin(20.0, [0.0, 120.0]) == 20.0  # no idle phase: not a window


# ----------------------------------------------------------------------------- split


def _req(submit: float, end: float, idle: bool, step_ms: float, steps: int = 10) -> dict:
    """A 31-token request: ``steps`` spec steps of ``step_ms`` between first and last token."""
    q: dict[str, Any] = {
        "kind": "chat",
        "submit_t": submit,
        "end_t": end,
        "prompt_len": 100,
        "cached": 40,
        "out_len": 31,
        "first_ts": 1000.0 + end - steps * step_ms / 1e3,
        "last_ts": 1000.0 + end,
        "ttft_s": 0.5,
        "spec": {"steps": steps, "accepted": 20, "drafted": 30},
    }
    if idle:
        q["kv_transfer_params"] = {"draft_offload": {"store": False, "load": False}}
    return q


def _samples(until: int, per_s: dict[str, float], after: float, per_s_after: dict) -> list:
    """One sample a second; counters grow by ``per_s`` a second (``per_s_after`` after)."""
    out, acc = [], dict.fromkeys({*per_s, *per_s_after}, 0.0)
    for t in range(until + 1):
        out.append({"t": float(t), "counters": {k: v for k, v in acc.items() if v}})
        for k in acc:
            acc[k] += (per_s_after if t >= after else per_s).get(k, 0.0)
    return out


def _run(requests: list[dict], samples: list[dict], wall: float) -> dict:
    engine = {"async_scheduling": True, "max_num_batched_tokens": 16384}
    return {
        "status": "ok",
        "engine": engine,
        "requests": requests,
        "samples": samples,
        "wall_s": wall,
    }


def _data() -> dict[str, Any]:
    steps = "vllm:iteration_tokens_total_count"
    stored = "vllm:draft_offload_stored_chunks_total{tier=cpu}"
    # ours: idle for 40 s (20 ms steps, nothing stored), then 25 ms steps, 7 stores/s
    ours_reqs = [_req(t - 1.5, t, t - 1.5 < 40, 20 if t - 1.5 < 40 else 25) for t in range(2, 101)]
    ours_reqs.append(_req(39.0, 45.0, True, 20))  # an idle one ending after the switch
    ours_reqs.append(_req(98.0, 103.0, False, 25))  # in the drain: no window
    ours = _run(
        ours_reqs,
        _samples(
            102,
            {steps: 50, "vllm:spec_decode_num_drafts_total": 400},
            40,
            {
                steps: 40,
                "vllm:spec_decode_num_drafts_total": 360,
                stored: 7,
                "vllm:num_preemptions_total": 0.5,
            },
        ),  # fmt: skip
        103.0,
    )
    base_reqs = [_req(t - 1, t, False, 16) for t in range(1, 41)] * 2  # 2 requests a second
    base = _run(base_reqs, _samples(41, {steps: 62.5}, 1e9, {}), 41.0)
    return {
        "seconds": 100.0,
        "idle_seconds": 40.0,
        "phase_margin_s": 5.0,
        "engine_order": ["baseline", "ours", "replay"],
        "runs": {"ours": ours, "baseline": {**base, "seconds": 40.0}},
    }


def test_phase_split_reads_idle_active_and_baseline_from_one_run() -> None:
    p = ph.phase_summary(_data())
    assert p["margin_s"] == 5.0 and p["engine_order"] == ["baseline", "ours", "replay"]
    f = p["figures"]
    assert {k: v["window_s"] for k, v in f.items()} == {
        "baseline": [5.0, 40.0],
        "idle": [5.0, 40.0],
        "active": [45.0, 100.0],
    }
    idle, active, base = f["idle"], f["active"], f["baseline"]
    # requests by end: idle (5, 40] = 35, all sent idle; active (45, 100] = 55 plain (the
    # idle one ending at 45 falls in the margin; the one ending at 103 in the drain)
    assert idle["requests"] == idle["idle_requests"] == 35
    assert (active["requests"], active["idle_requests"]) == (55, 0)
    assert base["requests"] == 70 and base["idle_requests"] == 0
    assert idle["output_tokens_per_s"] == pytest.approx(35 * 31 / 35)
    assert active["output_tokens_per_s"] == pytest.approx(55 * 31 / 55)
    assert base["output_tokens_per_s"] == pytest.approx(70 * 31 / 35)
    assert idle["ms_per_spec_step_mean"] == pytest.approx(20)
    assert active["ms_per_spec_step_mean"] == pytest.approx(25)
    assert base["ms_per_spec_step_mean"] == pytest.approx(16)
    assert active["ms_per_output_token_mean"] == pytest.approx(250 / 30)
    assert idle["acceptance_length"] == pytest.approx(3.0)
    assert idle["cached_share"] == pytest.approx(0.4)
    # the sampled counters: steps, ms a step, drafts a step, preemptions, stores
    assert idle["counters"]["engine_steps"] == 35 * 50
    assert idle["ms_per_engine_step"] == pytest.approx(20.0)
    assert idle["drafts_per_engine_step"] == pytest.approx(8.0)
    assert idle["counters"]["stored_chunks"] == {"cpu": 0, "l3": 0}
    assert idle["preemptions"] == 0
    assert active["ms_per_engine_step"] == pytest.approx(25.0)
    assert active["drafts_per_engine_step"] == pytest.approx(9.0)
    assert active["counters"]["stored_chunks"]["cpu"] == 55 * 7
    assert active["preemptions"] == 27  # int(55 * 0.5)
    assert base["ms_per_engine_step"] == pytest.approx(16.0)
    vs = p["vs_baseline"]
    assert vs["idle"]["output_tokens_per_s"] == pytest.approx(0.5)
    assert vs["idle"]["ms_per_engine_step"] == pytest.approx(20 / 16)
    assert vs["active"]["ms_per_spec_step_mean"] == pytest.approx(25 / 16)
    # the same engine's phases against each other: its own speed divided out
    inside = p["active_vs_idle"]
    assert inside["ms_per_engine_step"] == pytest.approx(25 / 20)
    assert inside["output_tokens_per_s"] == pytest.approx(1.0)  # 31 tok/s in both
    e = p["engines"]
    assert e["ours"]["order"] == 1 and e["baseline"]["order"] == 0
    assert e["ours"]["async_scheduling"] is True
    assert e["ours"]["engine_steps"] == 40 * 50 + 62 * 40
    assert e["ours"]["preemptions"] == 31
    assert e["baseline"]["ms_per_engine_step"] == pytest.approx(16.0)
    md = "\n".join(ph.phase_markdown(p))
    assert "Engine order: baseline → ours → replay" in md and "first 40 s" in md
    assert "| idle | 5–40 | 35 (35) | 31 (0.500) |" in md
    assert "async scheduling on" in md
    assert "Active over idle, one engine: output tok/s 1.000" in md
    assert "ms / engine step 1.250" in md


def test_phase_split_of_a_run_without_idle_phase_or_step_counters() -> None:
    data = _data()
    data.pop("idle_seconds")
    data.pop("engine_order")
    for run in data["runs"].values():
        run["engine"] = {}
        for s in run["samples"]:
            s["counters"].pop("vllm:iteration_tokens_total_count", None)
    p = ph.phase_summary(data)
    assert set(p["figures"]) == {"baseline", "active"} and "idle" not in p["vs_baseline"]
    assert p["figures"]["active"]["window_s"] == [5.0, 100.0]
    assert p["engine_order"] == ["ours", "baseline"]
    # not recorded: None, not 0
    assert p["figures"]["active"]["counters"]["engine_steps"] is None
    assert p["figures"]["active"]["preemptions"] is None
    assert p["engines"]["ours"]["engine_steps"] is None
    assert p["engines"]["ours"]["async_scheduling"] is None
    assert p["active_vs_idle"] is None  # no idle phase: nothing to divide by
    assert "async scheduling not recorded" in "\n".join(ph.phase_markdown(p))


def test_the_lease_scripts_soak_order_stores_phase_parses() -> None:
    text = LEASE.read_text()
    m = re.search(r'\[soak-order-stores\]="([^"]*)"', text)
    assert m, "no soak-order-stores phase in lease.sh"
    args = soak.parse_args(shlex.split(m.group(1).replace("\\\n", " "))[2:])
    assert args.idle_off == ("load",) and args.baseline_seconds == 0 and args.idle_seconds == 90


def test_the_lease_scripts_soak_final_phase_is_issue_10s_soak() -> None:
    """Ten minutes with all three faults, an idle phase and the baseline first."""
    m = re.search(r'\[soak-final\]="([^"]*)"', LEASE.read_text())
    assert m, "no soak-final phase in lease.sh"
    args = soak.parse_args(shlex.split(m.group(1).replace("\\\n", " "))[2:])
    assert args.seconds == 600 and args.baseline_first and 0 < args.idle_seconds < 600
    assert set(args.faults.split(",")) == {"disk_full", "outage", "corrupt"}
    assert not args.no_faults


def test_the_lease_scripts_soak_null_phase_runs_the_null_connector_after_a_baseline() -> None:
    text = LEASE.read_text()
    m = re.search(r'\[soak-null\]="([^"]*)"', text)
    assert m, "no soak-null phase in lease.sh"
    args = soak.parse_args(shlex.split(m.group(1).replace("\\\n", " "))[2:])
    assert args.ours_connector == "null" and args.baseline_first and args.idle_seconds == 0
    assert soak.parse_args(["--out", "/tmp/x"]).ours_connector == "draft_offload"


def test_null_connector_run_says_so_in_the_phase_table() -> None:
    data = _data()
    data["ours_connector"] = "null"
    text = "\n".join(ph.phase_markdown(ph.phase_summary(data)))
    assert "NullConnector" in text
    assert "NullConnector" not in "\n".join(ph.phase_markdown(ph.phase_summary(_data())))


def test_the_lease_scripts_soak_switch_phase_keeps_pythons_switch_interval() -> None:
    """soak-switch sends l3.switch_interval_ms null to the connector engine."""
    from vllm_draft_offload.bench.stress.jobs import EngineShape, build_kwargs
    from vllm_draft_offload.bench.workloads.specs import Drafter

    text = LEASE.read_text()
    m = re.search(r'\[soak-switch\]="([^"]*)"', text)
    assert m, "no soak-switch phase in lease.sh"
    args = soak.parse_args(shlex.split(m.group(1).replace("\\\n", " "))[2:])
    assert args.l3_switch_interval_ms == "none" and args.baseline_first
    shape = EngineShape(
        model="/m",
        drafter=Drafter("eagle3", "/d"),
        block_size=16,
        chunk_size=256,
        num_spec_tokens=3,
        dtype="bfloat16",
        enforce_eager=True,
        gpu_memory_utilization=0.5,
        max_num_seqs=64,
        max_num_batched_tokens=None,
        max_model_len=4096,
        gpu_blocks=100,
    )
    l3 = {}
    for value, wanted in (("none", None), (2.5, 2.5), (None, "absent")):
        kw = build_kwargs("ours_disk", shape, l3_url="fs:///tmp/x", l3_switch_interval_ms=value)
        l3 = kw["kv_transfer_config"]["kv_connector_extra_config"]["l3"]
        assert l3.get("switch_interval_ms", "absent") == wanted


def test_the_lease_scripts_soak_spy_phase_samples_the_pair_under_py_spy() -> None:
    """soak-spy runs a soak the parser accepts (baseline first, an idle phase) under
    py-spy, idle samples included, and keeps the raw stacks even if the soak fails."""
    m = re.search(r'\[soak-spy\]="([^"]*)"', LEASE.read_text())
    assert m, "no soak-spy phase in lease.sh"
    words = shlex.split(m.group(1).replace("\\\n", " "))
    spy = words[words.index("record") :]
    assert {"--subprocesses", "--idle", "--threads", "--nonblocking"} <= set(spy)
    soak_words = words[words.index("soak") + 1 : words.index("gzip")]
    args = soak.parse_args([w.rstrip(";") for w in soak_words])
    assert args.baseline_first and args.no_faults and 0 < args.idle_seconds < args.seconds
    assert m.group(1).rstrip().endswith("gzip -f /root/soak-spy/spy.raw")
