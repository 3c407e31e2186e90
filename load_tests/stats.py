"""Per-class statistics from request records: latency percentiles, throughput, goodput, errors, header tallies."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from app.observability.percentile import percentile  # also imported from here by load_tests.batch_throughput
from load_tests.client import RequestRecord
from load_tests.scenario import CLASS_ORDER, ClassSLO

PERCENTILES = (50, 90, 99)
ABSENT_HEADER = "(absent)"


def distribution_ms(values_s: Iterable[float]) -> dict[str, float | None]:
    values = [v * 1000 for v in values_s]
    summary: dict[str, float | None] = {f"p{q}": percentile(values, q) for q in PERCENTILES}
    summary["mean"] = sum(values) / len(values) if values else None
    summary["count"] = len(values)
    return summary


def tpot_s(record: RequestRecord) -> float | None:
    """Time per output token after the first: (E2E - TTFT) / (tokens - 1)."""
    if not record.ok or record.ttft_s is None or record.e2e_s is None or record.output_tokens < 2:
        return None
    return (record.e2e_s - record.ttft_s) / (record.output_tokens - 1)


def itl_s(record: RequestRecord) -> list[float]:
    """Gaps between consecutive content chunks."""
    offsets = record.chunk_offsets_s
    return [b - a for a, b in zip(offsets, offsets[1:])] if record.ok else []


def meets_slo(record: RequestRecord, slo: ClassSLO | None) -> bool:
    if not record.ok:
        return False
    if slo is None:
        return True
    if slo.ttft_ms is not None and (record.ttft_s is None or record.ttft_s * 1000 > slo.ttft_ms):
        return False
    if slo.e2e_ms is not None and (record.e2e_s is None or record.e2e_s * 1000 > slo.e2e_ms):
        return False
    return True


def summarize_class(
    records: Sequence[RequestRecord], slo: ClassSLO | None, tally_headers: Sequence[str]
) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ends = [r.end_s for r in records if r.end_s is not None]
    # The class's active window: its first request sent to its last answer received.
    window_s = (max(ends) - min(r.start_s for r in records)) if records and ends else 0.0
    output_tokens = sum(r.output_tokens for r in ok)
    good = [r for r in ok if meets_slo(r, slo)]
    per_s = (lambda n: n / window_s if window_s > 0 else None)
    with_cache_usage = [r for r in ok if r.prompt_tokens and r.cached_prompt_tokens is not None]
    prompt_tokens = sum(r.prompt_tokens for r in with_cache_usage)
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": dict(sorted(Counter(r.error_key for r in records if not r.ok).items())),
        "ttft_ms": distribution_ms(r.ttft_s for r in ok if r.ttft_s is not None),
        "tpot_ms": distribution_ms(t for t in map(tpot_s, ok) if t is not None),
        "itl_ms": distribution_ms(gap for r in ok for gap in itl_s(r)),
        "e2e_ms": distribution_ms(r.e2e_s for r in ok if r.e2e_s is not None),
        # Open-loop arrivals only (count 0 for closed-loop streams): the generator's own delay in sending.
        "send_lag_ms": distribution_ms(r.send_lag_s for r in records if r.send_lag_s is not None),
        "window_s": window_s,
        "output_tokens": output_tokens,
        "output_tokens_per_s": per_s(output_tokens),
        "requests_per_s": per_s(len(ok)),
        # Engine-reported cached prompt tokens / prompt tokens, over answers that reported both (None: none did).
        "prefix_hit_rate": (sum(r.cached_prompt_tokens for r in with_cache_usage) / prompt_tokens
                            if prompt_tokens else None),
        "goodput": {
            "slo": slo.model_dump(exclude_none=True) if slo else {},
            "good": len(good),
            "fraction": len(good) / len(records) if records else None,
            "requests_per_s": per_s(len(good)),
        },
        "headers": {
            name: dict(sorted(Counter(r.headers.get(name, ABSENT_HEADER) for r in records).items()))
            for name in tally_headers
        },
    }


def summarize(
    records: Sequence[RequestRecord], slo: dict[str, ClassSLO], tally_headers: Sequence[str]
) -> dict[str, Any]:
    """{"classes": {class: summary}, "all": summary over every request}; classes in realtime/interactive/batch order."""
    classes = {}
    for name in CLASS_ORDER:
        members = [r for r in records if r.request_class == name]
        if members:
            classes[name] = summarize_class(members, slo.get(name), tally_headers)
    return {"classes": classes, "all": summarize_class(records, None, tally_headers)}


def throughput_series(
    records: Sequence[RequestRecord], bin_s: float = 1.0
) -> dict[str, tuple[list[float], list[float]]]:
    """Output tokens/s per class over time: (bin start times, tokens/s). A streamed request's tokens are spread over
    its content chunks (usage count / chunk count each), so the curve shows when tokens arrived, not just when
    requests ended."""
    if bin_s <= 0:
        raise ValueError("bin_s must be > 0")
    ends = [r.end_s for r in records if r.end_s is not None]
    if not ends:
        return {}
    n_bins = max(1, math.ceil(max(ends) / bin_s))
    series: dict[str, tuple[list[float], list[float]]] = {}
    for name in CLASS_ORDER:
        members = [r for r in records if r.request_class == name and r.ok]
        if not members:
            continue
        tokens = [0.0] * n_bins
        for record in members:
            times = [record.start_s + offset for offset in record.chunk_offsets_s] or [record.end_s]
            share = record.output_tokens / len(times)
            for t in times:
                tokens[min(n_bins - 1, int(t / bin_s))] += share
        series[name] = ([i * bin_s for i in range(n_bins)], [t / bin_s for t in tokens])
    return series


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def compare(first: dict[str, Any], second: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """first ÷ second per class for the numbers a lanes-vs-single-pool comparison is judged on."""
    result: dict[str, dict[str, float | None]] = {}
    for name in CLASS_ORDER:
        a, b = first["classes"].get(name), second["classes"].get(name)
        if a is None or b is None:
            continue
        result[name] = {
            "ttft_p50": ratio(a["ttft_ms"]["p50"], b["ttft_ms"]["p50"]),
            "ttft_p99": ratio(a["ttft_ms"]["p99"], b["ttft_ms"]["p99"]),
            "e2e_p99": ratio(a["e2e_ms"]["p99"], b["e2e_ms"]["p99"]),
            "output_tokens_per_s": ratio(a["output_tokens_per_s"], b["output_tokens_per_s"]),
            "prefix_hit_rate": ratio(a.get("prefix_hit_rate"), b.get("prefix_hit_rate")),
            "goodput_fraction": ratio(a["goodput"]["fraction"], b["goodput"]["fraction"]),
        }
    return result
