"""The PromQL subset the Grafana dashboard uses, evaluated over recorded scrapes.

Expressions are parsed by ``promql-parser`` (the Rust parser of GreptimeDB, as a
wheel); this module evaluates the parsed tree at one instant, as Prometheus does:

* ``rate`` / ``irate`` of a counter over a range selector ``name{matchers}[range]``
  (Prometheus' extrapolation, counter resets);
* ``sum`` and ``sum by (labels)``;
* ``histogram_quantile(phi, ...)`` over ``le`` buckets (linear within a bucket);
* ``+ - * /`` between numbers and vectors, vector/vector matched one-to-one on all
  labels; number literals and parentheses.

Anything else (other functions or aggregations, ``on``/``ignoring``/``group_left``,
``offset``, ``@``, bare selectors, subqueries) raises ``UnsupportedPromQL`` naming
the piece: a panel that cannot be evaluated fails the render, never draws wrong.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from vllm_draft_offload.bench.serve.scrape import Labels, Scrapes, Series

Vector = dict[Labels, float]
Value = float | Vector

_BINARY: dict[str, Callable[[float, float], float]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: _divide(a, b),
}


class UnsupportedPromQL(ValueError):
    """An expression outside the subset this evaluator implements."""


def _divide(a: float, b: float) -> float:
    if b != 0:
        return a / b
    if a == 0 or math.isnan(a):
        return math.nan
    return math.copysign(math.inf, a) * math.copysign(1.0, b)


def _parser() -> Any:
    try:
        import promql_parser
    except ImportError as e:  # an optional dependency: say which extra brings it
        raise ImportError(
            "dashboard-render needs promql-parser: pip install 'vllm-draft-offload[bench]' "
            "(or pip install promql-parser)"
        ) from e
    return promql_parser


def parse(expr: str) -> Any:
    """The parsed tree of ``expr`` (``promql_parser`` nodes); ValueError if invalid."""
    return _parser().parse(expr)


# ------------------------------------------------------------------- range functions


def extrapolated_rate(times: list[float], values: list[float], t: float, range_s: float) -> float:
    """Prometheus' ``rate``: the counter's increase in ``(t - range_s, t]``, counter
    resets added back, extrapolated to the window's edges (not beyond half a sample
    interval past the first/last sample, and not below zero), per second. NaN with
    fewer than two samples."""
    if len(values) < 2:
        return math.nan
    increase, prev = values[-1] - values[0], values[0]
    for v in values[1:]:
        if v < prev:  # a reset: the counter restarted from 0
            increase += prev
        prev = v
    sampled = times[-1] - times[0]
    to_start, to_end = times[0] - (t - range_s), t - times[-1]
    average_step = sampled / (len(values) - 1)
    if increase > 0 and values[0] >= 0:
        # a counter does not go below zero: do not extrapolate past where it was 0
        to_start = min(to_start, sampled * (values[0] / increase))
    threshold = average_step * 1.1
    covered = sampled
    covered += to_start if to_start < threshold else average_step / 2
    covered += to_end if to_end < threshold else average_step / 2
    return increase * (covered / sampled) / range_s


def instant_rate(times: list[float], values: list[float]) -> float:
    """Prometheus' ``irate``: per-second change between the last two samples."""
    if len(values) < 2:
        return math.nan
    last, prev = values[-1], values[-2]
    change = last if last < prev else last - prev
    return change / (times[-1] - times[-2])


RANGE_FUNCTIONS: dict[str, Callable[[list[float], list[float], float, float], float]] = {
    "rate": extrapolated_rate,
    "irate": lambda times, values, t, range_s: instant_rate(times, values),
}


def bucket_quantile(phi: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' ``histogram_quantile`` over ``(upper bound, cumulative count)``
    pairs: linear interpolation inside the bucket the rank falls in; the highest
    finite bound when it falls in ``+Inf``; NaN without a ``+Inf`` bucket or data."""
    if math.isnan(phi):
        return math.nan
    if phi < 0:
        return -math.inf
    if phi > 1:
        return math.inf
    buckets = sorted(buckets)
    if len(buckets) < 2 or not math.isinf(buckets[-1][0]):
        return math.nan
    counts, highest = [], 0.0
    for _, count in buckets:  # rates of cumulative counts can jitter: keep them monotonic
        highest = max(highest, count)
        counts.append(highest)
    total = counts[-1]
    if total == 0 or math.isnan(total):
        return math.nan
    rank = phi * total
    b = next(i for i, c in enumerate(counts) if c >= rank)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    if b == 0 and buckets[0][0] <= 0:
        return buckets[0][0]
    start, end, count = 0.0, buckets[b][0], counts[b]
    if b > 0:
        start = buckets[b - 1][0]
        count -= counts[b - 1]
        rank -= counts[b - 1]
    return start + (end - start) * (rank / count)


# ------------------------------------------------------------------------ evaluator


def _kind(node: Any) -> str:
    return type(node).__name__


class Evaluator:
    """Evaluates parsed expressions at an instant over one recording's series."""

    def __init__(self, scrapes: Scrapes) -> None:
        self.scrapes = scrapes

    def evaluate(self, node: Any, t: float) -> Value:
        method = getattr(self, f"_eval_{_kind(node)}", None)
        if method is None:
            raise UnsupportedPromQL(f"{_kind(node)} is not supported: {node}")
        return method(node, t)

    def _eval_NumberLiteral(self, node: Any, t: float) -> Value:
        return float(node.val)

    def _eval_ParenExpr(self, node: Any, t: float) -> Value:
        return self.evaluate(node.expr, t)

    def _eval_BinaryExpr(self, node: Any, t: float) -> Value:
        op = str(node.op)
        if op not in _BINARY:
            raise UnsupportedPromQL(f"binary operator {op!r} is not supported: {node}")
        if node.modifier is not None:
            raise UnsupportedPromQL(f"vector matching modifiers are not supported: {node}")
        fn = _BINARY[op]
        lhs, rhs = self.evaluate(node.lhs, t), self.evaluate(node.rhs, t)
        if isinstance(lhs, float) and isinstance(rhs, float):
            return fn(lhs, rhs)
        if isinstance(lhs, float):
            assert isinstance(rhs, dict)
            return {k: fn(lhs, v) for k, v in rhs.items()}
        if isinstance(rhs, float):
            return {k: fn(v, rhs) for k, v in lhs.items()}
        # one-to-one on every label: elements present on both sides
        return {k: fn(v, rhs[k]) for k, v in lhs.items() if k in rhs}

    def _eval_AggregateExpr(self, node: Any, t: float) -> Value:
        op = str(node.op)
        if op != "sum" or node.param is not None:
            raise UnsupportedPromQL(f"aggregation {op!r} is not supported (only sum): {node}")
        keep: tuple[str, ...] = ()
        if node.modifier is not None:
            if "By" not in str(node.modifier.type):
                raise UnsupportedPromQL(f"only 'sum by (...)' is supported: {node}")
            keep = tuple(node.modifier.labels)
        inner = self.evaluate(node.expr, t)
        if isinstance(inner, float):
            raise UnsupportedPromQL(f"sum of a number: {node}")
        out: Vector = {}
        for labels, value in inner.items():
            key = tuple((k, v) for k, v in labels if k in keep)
            out[key] = out.get(key, 0.0) + value
        return out

    def _eval_Call(self, node: Any, t: float) -> Value:
        name = node.func.name
        if name in RANGE_FUNCTIONS:
            (arg,) = node.args
            return self._range_function(name, arg, t)
        if name == "histogram_quantile":
            phi, inner = (self.evaluate(a, t) for a in node.args)
            if not isinstance(phi, float) or isinstance(inner, float):
                raise UnsupportedPromQL(f"histogram_quantile(number, vector) expected: {node}")
            return _quantiles(phi, inner)
        raise UnsupportedPromQL(f"function {name}() is not supported: {node}")

    def _range_function(self, name: str, arg: Any, t: float) -> Vector:
        if _kind(arg) != "MatrixSelector":
            raise UnsupportedPromQL(f"{name}() needs a range selector: {arg}")
        range_s = arg.range.total_seconds()
        fn = RANGE_FUNCTIONS[name]
        out: Vector = {}
        for labels, series in self._select(arg.vector_selector):
            times, values = series.window(t - range_s, t)
            value = fn(times, values, t, range_s)
            if not math.isnan(value):
                out[labels] = value
        return out

    def _select(self, selector: Any) -> list[tuple[Labels, Series]]:
        """The series a vector selector names (its own labels; ``__name__`` dropped, as
        every function and operator of this subset drops it)."""
        if selector.offset is not None or selector.at is not None:
            raise UnsupportedPromQL(f"offset and @ are not supported: {selector}")
        if not selector.name or selector.matchers.or_matchers:
            raise UnsupportedPromQL(f"a selector needs a metric name, no 'or': {selector}")
        tests = [_matcher(m) for m in selector.matchers.matchers]
        return [
            (labels, series)
            for labels, series in self.scrapes.series.get(selector.name, {}).items()
            if all(test(dict(labels)) for test in tests)
        ]


def _matcher(m: Any) -> Callable[[dict[str, str]], bool]:
    op, name, value = str(m.op), m.name, m.value
    if op.endswith("NotRe"):
        pattern = re.compile(value)
        return lambda labels: pattern.fullmatch(labels.get(name, "")) is None
    if op.endswith("Re"):
        pattern = re.compile(value)
        return lambda labels: pattern.fullmatch(labels.get(name, "")) is not None
    if op.endswith("NotEqual"):
        return lambda labels: labels.get(name, "") != value
    if op.endswith("Equal"):
        return lambda labels: labels.get(name, "") == value
    raise UnsupportedPromQL(f"label matcher {op} is not supported")


def _quantiles(phi: float, buckets: Vector) -> Vector:
    """``histogram_quantile`` of each label set (all labels but ``le``)."""
    grouped: dict[Labels, list[tuple[float, float]]] = {}
    for labels, count in buckets.items():
        le = dict(labels).get("le")
        if le is None:
            continue  # Prometheus ignores series without le
        key = tuple((k, v) for k, v in labels if k != "le")
        grouped.setdefault(key, []).append((float(le), count))
    out = {key: bucket_quantile(phi, b) for key, b in grouped.items()}
    return {k: v for k, v in out.items() if not math.isnan(v)}
