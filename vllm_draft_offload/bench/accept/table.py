"""Baseline tables from acceptance runs (``scripts/gpu/accept_runs.sh`` output).

Reads every ``accept_<drafter>-<connector>.json`` (an :class:`AcceptCheckResult`) in DIR
and prints markdown: table A, KV sensitivity (the ``corrupt`` runs; the
``corrupt_window`` runs, the target's sliding-window KV zeroed, when there are any), and table B,
restored/fresh acceptance per drafter and connector (``ours_l3``: the
``--restart-from-storage`` runs).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

from vllm_draft_offload.bench.accept.plans import (
    EXTENDED_CORRUPT,
    EXTENDED_CORRUPT_WINDOW,
    RESTORED_STORAGE,
)
from vllm_draft_offload.bench.accept.schema import AcceptCheckResult, Comparison
from vllm_draft_offload.bench.markdown import table as markdown_table
from vllm_draft_offload.bench.options import command_parser

Results = dict[tuple[str, str], AcceptCheckResult]  # (drafter, connector) -> result

DRAFTERS = {
    "self": "self-draft (draft_model)",
    "small": "small-draft (draft_model)",
    "eagle": "eagle (eagle)",
    "eagle3": "eagle3 (eagle3)",
    "glm-mtp": "glm-mtp (mtp, GLM-4-MoE)",
    "glm-mtp2": "glm-mtp2 (mtp, 2 modules)",
    "dsv3-mla-mtp": "dsv3-mla-mtp (mtp, DeepSeek-V3 MLA)",
}
# Column order: the no-connector control, ours from the CPU tier, ours from storage
# after an engine restart (`accept --restart-from-storage`), then the others.
CONNECTORS = {
    "none": "none",
    "ours": "ours, CPU tier (DraftOffloadConnector)",
    "ours_l3": "ours, storage after restart (ours_l3)",
    "native": "native (OffloadingConnector)",
    "lmcache": "lmcache (LMCacheConnectorV1)",
}
# runs of the sensitivity tables (not connectors): run name -> the corrupted phase
SENSITIVITY_RUNS = {"corrupt": EXTENDED_CORRUPT, "corrupt_window": EXTENDED_CORRUPT_WINDOW}
MISSING = "–"
LEGEND_B = (
    "Cell: ratio (AL restored / AL fresh), outputs equal to fresh, "
    "mean cached tokens per request in the restored phase. ours_l3: restored by a "
    "new engine process from what the first one wrote to storage (fs://); "
    '"from storage" when every request hit and every unit it restored had been '
    "fetched from storage."
)
_NAME = re.compile(r"accept_(?P<drafter>.+)-(?P<connector>[^-]+)\.json")
_EXC = re.compile(r"^\s*(?:[\w.]+\.)?(?P<type>\w+(?:Error|Exception)): (?P<msg>.*)$")


# ------------------------------------------------------------------ pure functions


def parse_name(filename: str) -> tuple[str, str] | None:
    """``accept_eagle3-native.json`` -> ("eagle3", "native")."""
    m = _NAME.fullmatch(filename)
    return (m["drafter"], m["connector"]) if m else None


def crash_cause(error: str, max_len: int = 100) -> str:
    """Short root cause of a crash: the last exception line that is not the client-side
    EngineDeadError (the engine's own traceback, when the output tail was recorded);
    else EngineDeadError; else the error's first line."""
    causes = [m for line in error.splitlines() if (m := _EXC.match(line))]
    root = [m for m in causes if m["type"] != "EngineDeadError"]
    if root:
        text = f"{root[-1]['type']}: {root[-1]['msg'].strip()}"
    elif causes:
        text = "EngineDeadError"
    else:
        text = error.strip().splitlines()[0] if error.strip() else "unknown error"
    return text if len(text) <= max_len else text[: max_len - 1] + "…"


def comparison(result: AcceptCheckResult, phase: str) -> Comparison | None:
    return next((c for c in result.summary.comparisons if c.phase == phase), None)


def _f(value: float | None, fmt: str = ".2f") -> str:
    return MISSING if value is None else format(value, fmt)


def sensitivity_row(
    drafter: str, result: AcceptCheckResult | None, phase: str = EXTENDED_CORRUPT
) -> list[str]:
    """drafter, AL intact, AL corrupted, drop, pass, outputs equal."""
    label = DRAFTERS.get(drafter, drafter)
    if result is None:
        return [label] + [MISSING] * 5
    if result.error:
        return [label, "crash: " + crash_cause(result.error)] + [MISSING] * 4
    c = comparison(result, phase)
    if c is None:
        return [label] + [MISSING] * 5
    s = result.summary
    passed = MISSING if s.sensitivity_pass is None else ("yes" if s.sensitivity_pass else "no")
    return [
        label,
        _f(c.reference_acceptance_length),
        _f(c.acceptance_length),
        _f(None if s.corruption_drop is None else 100 * s.corruption_drop, ".1f") + "%",
        passed,
        f"{c.outputs_match}/{c.outputs_compared}",
    ]


def acceptance_cell(result: AcceptCheckResult | None) -> str:
    """'ratio (AL restored / AL fresh), n/m, mean cached' or 'crash: cause'."""
    if result is None:
        return MISSING
    if result.error:
        return "crash: " + crash_cause(result.error)
    cases = [c for c in result.summary.comparisons if c.expected_cached_tokens is not None]
    if cases:  # the divergent-successor plan: one ratio per successor position
        ratios = " / ".join(f"{c.phase.removeprefix('diverge_')} {_f(c.ratio)}" for c in cases)
        match = f"{sum(c.outputs_match for c in cases)}/{sum(c.outputs_compared for c in cases)}"
        hits = "as expected" if result.summary.hits_as_expected else "NOT as expected"
        return f"{ratios}, {match}, hits {hits}"
    # the default plan (a connector's restore), the prefix-cache-hit plan, or the
    # restart plan (restored from storage by a new engine)
    c = comparison(result, "restored") or comparison(result, "cached")
    c = c or comparison(result, RESTORED_STORAGE)
    if c is None:
        return MISSING
    cell = (
        f"{_f(c.ratio)} ({_f(c.acceptance_length)} / {_f(c.reference_acceptance_length)}), "
        f"{c.outputs_match}/{c.outputs_compared}, {_f(c.mean_cached_tokens, '.0f')}"
    )
    reads = result.summary.storage_reads
    if reads is None:
        return cell
    if reads.from_storage:
        return cell + " from storage"
    return f"{cell}, NOT from storage ({reads.requests_hit}/{reads.requests} requests hit)"


def env_line(results: Results) -> str:
    """GPU and versions; distinct values joined when the runs disagree."""

    def vals(get: Callable[[AcceptCheckResult], object]) -> str:
        return " / ".join(sorted({str(get(r)) for r in results.values()})) or MISSING

    gpu = vals(lambda r: r.env.gpu)
    versions = ", ".join(
        f"{d} {vals(lambda r, d=d: r.env.versions.get(d))}" for d in ("vllm", "torch", "lmcache")
    )
    return f"GPU: {gpu}; {versions}"


def _ordered(found: set[str], known: dict[str, str]) -> list[str]:
    return [k for k in known if k in found] + sorted(found - known.keys())


def render(results: Results) -> str:
    drafters = _ordered({d for d, _ in results}, DRAFTERS)
    # the known connectors always get a column (missing runs show as "–")
    found = {c for _, c in results if c not in SENSITIVITY_RUNS}
    connectors = _ordered(found | CONNECTORS.keys(), CONNECTORS)
    out = [env_line(results), "", "### A. Sensitivity (draft KV of the cached prefix zeroed)", ""]
    out += markdown_table(
        ["drafter", "AL intact", "AL corrupted", "drop", "pass (≥ 30%)", "outputs equal"],
        [sensitivity_row(d, results.get((d, "corrupt"))) for d in drafters],
    )
    if any(c == "corrupt_window" for _, c in results):
        out += ["", "### A2. Sensitivity (target's sliding-window KV of the cached prefix zeroed)"]
        out += ["", "Pass: some output changed, or acceptance moved by ≥ 30%.", ""]
        out += markdown_table(
            ["drafter", "AL intact", "AL corrupted", "drop", "pass", "outputs equal"],
            [
                sensitivity_row(d, results.get((d, "corrupt_window")), EXTENDED_CORRUPT_WINDOW)
                for d in drafters
            ],
        )
    out += ["", "### B. Restored/fresh acceptance", "", LEGEND_B, ""]
    out += markdown_table(
        ["drafter"] + [CONNECTORS.get(c, c) for c in connectors],
        [
            [DRAFTERS.get(d, d)] + [acceptance_cell(results.get((d, c))) for c in connectors]
            for d in drafters
        ],
    )
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------ I/O


def load_results(directory: Path) -> Results:
    return {
        key: AcceptCheckResult.model_validate_json(path.read_text())
        for path in sorted(directory.glob("accept_*.json"))
        if (key := parse_name(path.name)) is not None
    }


EXAMPLES = """examples:
  vllm-draft-offload table results/gpu/accept_h200
  vllm-draft-offload table results/gpu/accept_h200 --out /tmp/tables.md
"""


def main(argv: list[str] | None = None) -> int:
    ap = command_parser("table", __doc__, EXAMPLES)
    ap.add_argument("dir", type=Path, help="directory with accept_<drafter>-<connector>.json")
    ap.add_argument("--out", type=Path, help="also write the markdown here")
    args = ap.parse_args(argv)
    results = load_results(args.dir)
    if not results:
        print(f"no accept_*.json in {args.dir}", file=sys.stderr)
        return 1
    text = render(results)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
