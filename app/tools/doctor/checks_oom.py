"""Flow 1 of the doctor, OOM with low GPU use: long contexts, the batched-token budget, KV pressure."""

from __future__ import annotations

import math

from app.classes import Lane
from app.router.spill import REASON_LONG_CONTEXT
from app.tools.doctor.model import (
    FLOW_OOM, M_DEGRADE, M_REQUESTS, OK, PROBLEM, V_PROMPT_TOKENS, WARN, DoctorInputs, Finding, LaneLimits, _bucket,
    _lane_key, _n, _pct, _since, _sum_by, histograms,
)
from app.tools.doctor.thresholds import (
    KV_FULL_FRACTION, LONG_CONTEXT_SHARE_WARN, NEAR_MAX_MODEL_LEN_FRACTION, PROMPT_TAIL_RATIO_WARN,
)


def check_prompt_lengths(inputs: DoctorInputs) -> list[Finding]:
    """Abnormally long contexts: the prompt-length histogram's tail vs its median, max_model_len and the
    long-context threshold, per lane."""
    if inputs.metrics is None or not inputs.metrics.has(V_PROMPT_TOKENS + "_bucket"):
        return []
    findings = []
    threshold = inputs.long_context_threshold
    for lane, hist in sorted(histograms(inputs.metrics, V_PROMPT_TOKENS, _lane_key(inputs)).items()):
        if hist.count <= 0:
            continue
        p50, p99 = hist.quantile_bucket(0.5), hist.quantile_bucket(0.99)
        largest = hist.largest_bucket()
        above_least, above_most = hist.count_above(threshold)
        evidence = (
            f"{_n(hist.count)} prompts {_since(inputs)}: p50 in {_bucket(p50)}, p99 in {_bucket(p99)}, "
            f"longest in {_bucket(largest)} tokens"
            + (f" (max_model_len {_n(inputs.max_model_len)})" if inputs.max_model_len else "")
            + f"; above the long-context threshold {_n(threshold)}: "
            + (_n(above_least) if above_least == above_most else f"{_n(above_least)}-{_n(above_most)}")
        )
        data = {"prompts": hist.count, "p50_bucket": p50, "p99_bucket": p99, "longest_bucket": largest,
                "above_long_context_threshold": [above_least, above_most], "max_model_len": inputs.max_model_len}
        severity, summary, action = OK, "prompt lengths look ordinary", ""
        near_least = 0.0
        if inputs.max_model_len:
            near_least, _ = hist.count_above(NEAR_MAX_MODEL_LEN_FRACTION * inputs.max_model_len)
            data["near_max_model_len_at_least"] = near_least
        # Ratio of the p99 bucket's floor to the median bucket's ceiling: a tail at least this long.
        tail_ratio = (p99[0] / p50[1]) if p50 and p99 and p50[1] > 0 and not math.isinf(p50[1]) else 0.0
        data["p99_over_p50_at_least"] = tail_ratio
        cold_lane_exists = Lane.COLD.value in inputs.lanes_present
        if lane == Lane.HOT.value and above_least > 0 and cold_lane_exists:
            severity = PROBLEM
            summary = f"at least {_n(above_least)} prompts above {_n(threshold)} tokens ran on the hot lane"
            action = ("long-context degrade should send these to the cold lane (it keeps them on hot only while the "
                      "cold lane's breaker is open or cannot fit them): check admission.long_context_threshold in "
                      "the serve config and the Router's degrade path (ray_llm_lanes_degrade_total"
                      f"{{reason=\"{REASON_LONG_CONTEXT}\"}}); one long prefill stalls every hot request's TTFT")
        elif near_least > 0:
            severity = WARN
            margin = _pct(1 - NEAR_MAX_MODEL_LEN_FRACTION)
            summary = f"at least {_n(near_least)} prompts within {margin} of max_model_len"
            action = ("each holds a whole max_model_len worth of KV blocks: find the clients sending them (Router "
                      "logs / traces), cap their context, or give them a lane with more KV per sequence "
                      "(python -m app.tools.kv_budget --context N shows how many fit)")
        elif tail_ratio >= PROMPT_TAIL_RATIO_WARN:
            severity = WARN
            summary = f"abnormally long contexts: p99 prompt is at least {tail_ratio:.0f}x the median"
            action = ("a few requests carry far longer contexts than the rest; under memory pressure they are the "
                      "ones that fill the KV cache: lower the long-context threshold so they degrade to the cold "
                      "lane, or cap them at the client")
        findings.append(Finding(FLOW_OOM, "long contexts", lane, severity, summary, evidence, action, data))
    return findings


def check_long_context_degrades(inputs: DoctorInputs) -> list[Finding]:
    """How many requests the Router sent to the cold lane for a long prompt, and their share of all traffic."""
    if inputs.metrics is None or not inputs.metrics.has(M_DEGRADE):
        return []
    by_class = _sum_by(inputs.metrics, M_DEGRADE,
                       lambda labels: labels.get("request_class") if labels.get("reason") == REASON_LONG_CONTEXT
                       else None)
    degraded = sum(by_class.values())
    requests = sum(s.value for s in inputs.metrics.select(M_REQUESTS))
    share = degraded / requests if requests else None
    evidence = (f"{_n(degraded)} long-context degrades {_since(inputs)}"
                + (f" of {_n(requests)} requests ({_pct(share)})" if share is not None else "")
                + (": " + ", ".join(f"{c} {_n(v)}" for c, v in sorted(by_class.items())) if by_class else ""))
    data = {"degraded": degraded, "requests": requests, "share": share, "by_class": by_class}
    if share is not None and share >= LONG_CONTEXT_SHARE_WARN:
        return [Finding(
            FLOW_OOM, "long-context degrade", "all", WARN,
            f"{_pct(share)} of requests have prompts above {_n(inputs.long_context_threshold)} tokens",
            evidence,
            "long contexts are a real share of traffic, not outliers: size the cold lane's KV cache for them "
            "(app.tools.kv_budget --lane cold --context N) and check the cold lane's preemptions below",
            data,
        )]
    return [Finding(FLOW_OOM, "long-context degrade", "all", OK, "long-context degrades are rare", evidence, "", data)]


def check_batched_tokens(inputs: DoctorInputs) -> list[Finding]:
    """max_num_batched_tokens vs the longest prompts: a prompt above it is prefilled in several chunked steps."""
    if inputs.metrics is None or not inputs.metrics.has(V_PROMPT_TOKENS + "_bucket"):
        return []
    findings = []
    for lane, hist in sorted(histograms(inputs.metrics, V_PROMPT_TOKENS, _lane_key(inputs)).items()):
        budget = inputs.lane_limits.get(lane, LaneLimits()).max_num_batched_tokens
        if budget is None or hist.count <= 0:
            continue
        p99, largest = hist.quantile_bucket(0.99), hist.largest_bucket()
        over_least, over_most = hist.count_above(budget)
        evidence = (f"max_num_batched_tokens {_n(budget)}; p99 prompt in {_bucket(p99)}, longest in "
                    f"{_bucket(largest)}; prompts above the budget: "
                    + (_n(over_least) if over_least == over_most else f"{_n(over_least)}-{_n(over_most)}")
                    + f" of {_n(hist.count)}")
        data = {"max_num_batched_tokens": budget, "p99_bucket": p99, "longest_bucket": largest,
                "above_budget": [over_least, over_most]}
        if p99 and p99[0] >= budget:
            steps = math.ceil(p99[0] / budget)
            findings.append(Finding(
                FLOW_OOM, "max_num_batched_tokens", lane, WARN,
                f"the p99 prompt needs at least {steps} prefill steps of {_n(budget)} tokens",
                evidence,
                "long prompts are prefilled in chunks that share each step with decodes: their TTFT grows with the "
                "chunk count and everyone's step time grows with the chunk size. Raise max_num_batched_tokens if "
                "KV headroom allows (vLLM sizes its activation reserve from it at start-up, so the KV pool shrinks), "
                "or lower the long-context threshold so these prompts run on the cold lane",
                data,
            ))
        else:
            findings.append(Finding(
                FLOW_OOM, "max_num_batched_tokens", lane, OK,
                "the p99 prompt fits one prefill step", evidence,
                "" if not over_least else "the few longer prompts are prefilled in chunks (chunked prefill)", data,
            ))
    return findings


def check_kv_pressure(inputs: DoctorInputs) -> list[Finding]:
    """KV usage near full with preemptions: vLLM's form of 'out of memory' (sequences are evicted and recomputed)."""
    findings, fine = [], []
    for r in inputs.replicas:
        if r.error is not None or (r.kv_cache_usage is None and r.preemptions is None):
            continue
        full = r.kv_cache_usage is not None and r.kv_cache_usage >= KV_FULL_FRACTION
        preempted = (r.preemptions or 0) > 0
        evidence = (f"KV {_pct(r.kv_cache_usage)} in use"
                    + (f" of {_n(r.kv_capacity_tokens)} tokens" if r.kv_capacity_tokens else "")
                    + f", {_n(r.preemptions) if r.preemptions is not None else 'unknown'} preemptions {_since(inputs)}"
                    + f", running {_n(r.running)}, waiting {_n(r.waiting)}")
        data = {"kv_cache_usage": r.kv_cache_usage, "kv_capacity_tokens": r.kv_capacity_tokens,
                "preemptions": r.preemptions}
        if full and preempted:
            findings.append(Finding(
                FLOW_OOM, "KV pressure", r.name, PROBLEM, "KV cache full and preempting sequences", evidence,
                "preempted sequences are recomputed from scratch (wasted GPU time, long tails): add replicas, use fp8 "
                "KV (extra_engine_args.kv_cache_dtype), raise gpu_memory_utilization, lower max_num_seqs or "
                "max_model_len, or move long prompts off this lane; then check with nvidia-smi -q -d MEMORY that the "
                "memory is the KV pool and not another process",
                data,
            ))
        elif full:
            findings.append(Finding(
                FLOW_OOM, "KV pressure", r.name, WARN, f"KV cache at least {_pct(KV_FULL_FRACTION)} full", evidence,
                "the next long prompt will preempt running sequences: watch ray_vllm_num_preemptions_total and "
                "consider the actions for KV pressure (more replicas, fp8 KV, lower max_num_seqs)",
                data,
            ))
        elif preempted:
            findings.append(Finding(
                FLOW_OOM, "KV pressure", r.name, WARN, "sequences were preempted for KV space", evidence,
                "the KV cache ran full at some point: look for bursts of long prompts (long contexts above) and "
                "re-run with --window-s to see whether it is still happening",
                data,
            ))
        else:
            fine.append(r)
    if fine:
        worst = max(fine, key=lambda r: r.kv_cache_usage or 0.0)
        findings.append(Finding(
            FLOW_OOM, "KV pressure", "all", OK, "no replica is short of KV cache",
            f"{len(fine)} replicas, highest KV use {_pct(worst.kv_cache_usage)} ({worst.name}), no preemptions "
            f"{_since(inputs)}",
            "", {"replicas": len(fine), "max_kv_cache_usage": worst.kv_cache_usage},
        ))
    return findings

