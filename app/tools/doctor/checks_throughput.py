"""Flow 2 of the doctor, throughput drop: engine stats per replica, routing balance, request outcomes, the
admission queue, the batch backlog and the circuit breakers."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from app.classes import Lane
from app.tools.doctor.model import (
    CLASS_HOME_LANE, ERROR_OUTCOMES, FLOW_THROUGHPUT, M_REQUESTS, OK, PROBLEM, REJECTED_OUTCOME, UNKNOWN_LANE, WARN,
    DoctorInputs, Finding, LaneLimits, ReplicaStats, _n, _pct, _since, _sum_by,
)
from app.tools.doctor.thresholds import (
    ERROR_SHARE_PROBLEM, ERROR_SHARE_WARN, IMBALANCE_LOAD_RATIO, IMBALANCE_MIN_LOAD, KV_FULL_FRACTION,
    REJECTED_SHARE_WARN,
)


def check_replica_scheduler(inputs: DoctorInputs) -> list[Finding]:
    """The guide's `stats['scheduler']['running']`, per replica: why requests wait instead of running."""
    findings, fine = [], []
    for r in inputs.replicas:
        if r.error is not None:
            findings.append(Finding(
                FLOW_THROUGHPUT, "engine stats", r.name, PROBLEM, "replica did not answer its stats call",
                f"error: {r.error}",
                "a replica that cannot answer within 5 s is stuck or restarting: check its state and logs in the "
                "Ray dashboard's Serve tab (HotLane / ColdLane) and `serve status`",
                {"error": r.error},
            ))
            continue
        if r.running is None and r.waiting is None:
            continue
        limit = r.max_num_seqs or inputs.lane_limits.get(r.lane, LaneLimits()).max_num_seqs
        gate_held = {c: v for c, v in r.gate_waiting_by_class.items() if v}
        evidence = (f"running {_n(r.running)}"
                    + (f" of max_num_seqs {_n(limit)}" if limit else "")
                    + f", waiting {_n(r.waiting)}, KV {_pct(r.kv_cache_usage)}"
                    + (f" of {_n(r.kv_capacity_tokens)} tokens" if r.kv_capacity_tokens else "")
                    + ("; waiting by reason: "
                       + ", ".join(f"{k} {_n(v)}" for k, v in sorted(r.waiting_by_reason.items()))
                       if r.waiting_by_reason else "")
                    + (f"; held by the replica's gate: {_classes(gate_held)}" if gate_held else ""))
        data = {"running": r.running, "waiting": r.waiting, "kv_cache_usage": r.kv_cache_usage,
                "max_num_seqs": limit, "waiting_by_reason": dict(r.waiting_by_reason), "source": r.source}
        if not (r.waiting or 0) > 0:
            if gate_held:
                findings.append(Finding(
                    FLOW_THROUGHPUT, "engine stats", r.name, WARN,
                    "requests wait in front of the engine, at the replica's realtime gate", evidence,
                    "realtime traffic is above the per-replica in-flight cap (admission.realtime_max_inflight, the "
                    "tuning guide's batch <= 4): add hot replicas, or raise the cap if the realtime TTFT goal holds",
                    {**data, "gate_waiting_by_class": gate_held},
                ))
            else:
                fine.append(r)
            continue
        if r.kv_cache_usage is not None and r.kv_cache_usage >= KV_FULL_FRACTION:
            findings.append(Finding(
                FLOW_THROUGHPUT, "engine stats", r.name, PROBLEM, "scheduler starved by a full KV cache", evidence,
                "waiting requests cannot get KV blocks: more replicas, fp8 KV, a higher gpu_memory_utilization, or "
                "shorter contexts on this lane (see KV pressure above)",
                data,
            ))
        elif limit and (r.running or 0) >= limit:
            findings.append(Finding(
                FLOW_THROUGHPUT, "engine stats", r.name, PROBLEM, "scheduler capped by max_num_seqs", evidence,
                f"KV has room ({_pct(r.kv_cache_usage)}) but all {_n(limit)} sequence slots are busy: raise "
                "max_num_seqs for this lane (python -m app.tools.kv_budget shows how many sequences fit), or add "
                "replicas",
                data,
            ))
        elif limit is None:
            findings.append(Finding(
                FLOW_THROUGHPUT, "engine stats", r.name, WARN, "requests wait while KV has room", evidence,
                "likely the max_num_seqs cap: pass --serve-config to compare running with it; if running is well "
                "below it, the engine is busy with long prefills (see max_num_batched_tokens)",
                data,
            ))
        else:
            findings.append(Finding(
                FLOW_THROUGHPUT, "engine stats", r.name, WARN,
                "requests wait with free KV and free sequence slots", evidence,
                "the engine is held up by something other than capacity: long chunked prefills (check "
                "max_num_batched_tokens), requests deferred by the scheduler (waiting by reason), or an engine step "
                "that is slow (profile it, see the long-tail section)",
                data,
            ))
    if fine:
        findings.append(Finding(
            FLOW_THROUGHPUT, "engine stats", "all", OK, "no requests waiting in any engine",
            "; ".join(f"{r.name}: running {_n(r.running)}, waiting {_n(r.waiting)}, KV {_pct(r.kv_cache_usage)}"
                      for r in fine),
            "", {"replicas": [r.replica_id for r in fine]},
        ))
    return findings


def check_routing_balance(inputs: DoctorInputs) -> list[Finding]:
    """Idle replicas next to an overloaded one in the same lane: the request router is not spreading load."""
    findings = []
    by_lane: dict[str, list[ReplicaStats]] = defaultdict(list)
    for r in inputs.replicas:
        if r.error is None and r.running is not None:
            by_lane[r.lane].append(r)
    for lane, replicas in sorted(by_lane.items()):
        if lane == UNKNOWN_LANE:
            continue
        if len(replicas) < 2:
            inputs.notes.append(f"routing balance of the {lane} lane not checked: 1 replica visible")
            continue
        busiest = max(replicas, key=lambda r: r.load)
        quietest = min(replicas, key=lambda r: r.load)
        evidence = "; ".join(f"{r.replica_id}: running {_n(r.running)}, waiting {_n(r.waiting)}" for r in replicas)
        data = {"loads": {r.replica_id: r.load for r in replicas}}
        idle_next_to_waiting = quietest.load == 0 and (busiest.waiting or 0) > 0
        lopsided = busiest.load >= IMBALANCE_MIN_LOAD and busiest.load >= IMBALANCE_LOAD_RATIO * (quietest.load + 1)
        if idle_next_to_waiting or lopsided:
            findings.append(Finding(
                FLOW_THROUGHPUT, "routing balance", lane, WARN,
                f"{quietest.replica_id} is {'idle' if quietest.load == 0 else 'nearly idle'} while "
                f"{busiest.replica_id} has {_n(busiest.load)} requests",
                evidence,
                "prefix affinity may be pinning a popular prefix to one replica: check the PrefixCache's imbalance "
                "bound and the pinned prefixes (GET /v1/admin/stats prefix_cache), and that every replica passed "
                "its health check (a replica that is not RUNNING gets no traffic)",
                data,
            ))
        else:
            findings.append(Finding(FLOW_THROUGHPUT, "routing balance", lane, OK,
                                    f"load is spread over {len(replicas)} replicas", evidence, "", data))
    return findings


def check_request_outcomes(inputs: DoctorInputs) -> list[Finding]:
    """Errors, timeouts and rejections among finished requests, per lane."""
    if inputs.metrics is None or not inputs.metrics.has(M_REQUESTS):
        return []
    counts = _sum_by(inputs.metrics, M_REQUESTS, lambda labels: (labels.get("lane", UNKNOWN_LANE),
                                                                 labels.get("outcome", "")))
    lanes = sorted({lane for lane, _ in counts})
    findings = []
    for lane in lanes:
        by_outcome = {outcome: v for (l, outcome), v in counts.items() if l == lane}
        total = sum(by_outcome.values())
        if total <= 0:
            continue
        errors = sum(by_outcome.get(o, 0.0) for o in ERROR_OUTCOMES)
        rejected = by_outcome.get(REJECTED_OUTCOME, 0.0)
        evidence = (f"{_n(total)} requests {_since(inputs)}: "
                    + ", ".join(f"{o} {_n(v)}" for o, v in sorted(by_outcome.items())))
        data = {"by_outcome": by_outcome, "error_share": errors / total, "rejected_share": rejected / total}
        subject = "rejected before a lane" if lane == "none" else lane
        if errors / total >= ERROR_SHARE_PROBLEM:
            severity, summary = PROBLEM, f"{_pct(errors / total)} of requests end in error or timeout"
        elif errors / total >= ERROR_SHARE_WARN:
            severity, summary = WARN, f"{_pct(errors / total)} of requests end in error or timeout"
        elif rejected / total >= REJECTED_SHARE_WARN:
            severity, summary = WARN, f"{_pct(rejected / total)} of requests rejected (load shedding)"
        else:
            findings.append(Finding(FLOW_THROUGHPUT, "request outcomes", subject, OK,
                                    "errors and rejections are rare", evidence, "", data))
            continue
        action = ("errors and timeouts: the Router's logs name the cause (engine errors, deadlines); an open breaker "
                  "or a restarting replica shows in the engine-stats findings"
                  if severity == PROBLEM or errors / total >= ERROR_SHARE_WARN else
                  "admission is shedding load (429 / 503): the lane is at capacity; add replicas or raise the "
                  "admission queue bounds if the latency goals allow")
        findings.append(Finding(FLOW_THROUGHPUT, "request outcomes", subject, severity, summary, evidence, action,
                                data))
    return findings


def _classes(counts: Mapping[str, float]) -> str:
    return ", ".join(f"{c} {_n(v)}" for c, v in sorted(counts.items()))


def check_admission_queue(inputs: DoctorInputs) -> list[Finding]:
    """Requests queued at the Router's admission: at capacity (engines busy), or stuck (engines idle)."""
    if not inputs.admission_queued:
        return []
    queued = {c: v for c, v in inputs.admission_queued.items() if v}
    if not queued:
        return [Finding(FLOW_THROUGHPUT, "admission queue", "router", OK, "nothing queued at admission",
                        "queued by class: " + _classes(inputs.admission_queued), "", {"queued": {}})]
    findings = []
    by_lane: dict[str, dict[str, float]] = defaultdict(dict)
    for request_class, count in queued.items():
        by_lane[CLASS_HOME_LANE.get(request_class, UNKNOWN_LANE)][request_class] = count
    for lane, counts in sorted(by_lane.items()):
        engines = [r for r in inputs.replicas if r.lane == lane and r.error is None and r.running is not None]
        load = sum(r.load for r in engines)
        evidence = f"queued at the Router: {_classes(counts)}; {lane} lane engines: {len(engines)}, {_n(load)} requests"
        data = {"queued": counts, "lane_replicas": len(engines), "lane_load": load}
        if engines and load == 0:
            findings.append(Finding(
                FLOW_THROUGHPUT, "admission queue", lane, PROBLEM, "admission holds requests while the engines idle",
                evidence,
                "the Router's queue is not being released: check its logs and the back-pressure state (GET "
                "/v1/admin/stats router); a breaker that is open or half-open also holds traffic",
                data,
            ))
        else:
            findings.append(Finding(
                FLOW_THROUGHPUT, "admission queue", lane, WARN, "requests queue at admission: the lane is at capacity",
                evidence,
                "their queue wait adds to TTFT: add replicas to this lane (or let interactive spill to cold earlier); "
                "the engine-stats findings say what limits each replica",
                data,
            ))
    return findings


def check_batch_backlog(inputs: DoctorInputs) -> list[Finding]:
    """A batch backlog with an idle cold lane: the dispatcher is not draining it into the engines."""
    if inputs.batch_backlog_lines is None:
        return []
    cold = [r for r in inputs.replicas if r.lane == Lane.COLD.value and r.error is None and r.running is not None]
    backlog = inputs.batch_backlog_lines
    cold_load = sum(r.load for r in cold)
    evidence = (f"{_n(backlog)} batch lines not finished; cold lane: {len(cold)} replicas, {_n(cold_load)} requests"
                + (f"; dispatcher window {_n(inputs.batch_window)}" if inputs.batch_window is not None else ""))
    data = {"backlog_lines": backlog, "cold_replicas": len(cold), "cold_load": cold_load,
            "batch_window": inputs.batch_window}
    if backlog > 0 and cold and cold_load == 0:
        return [Finding(
            FLOW_THROUGHPUT, "batch backlog", "cold", PROBLEM, "batch backlog waits while the cold lane is idle",
            evidence,
            "the dispatcher is not claiming lines: check the Router's dispatcher logs, the batch store "
            "(batch.store) and expired leases; a stuck lease returns after batch.lease_s",
            data,
        )]
    return [Finding(FLOW_THROUGHPUT, "batch backlog", "cold", OK,
                    "no backlog" if backlog <= 0 else "the cold lane is working on the backlog", evidence, "", data)]


def check_breakers(inputs: DoctorInputs) -> list[Finding]:
    """Circuit breakers per lane, when the stats document reports them."""
    findings = []
    for lane, state in sorted(inputs.breakers.items()):
        state_key = state.lower().replace("-", "_")
        if state_key == "open":
            findings.append(Finding(
                FLOW_THROUGHPUT, "circuit breaker", lane, PROBLEM, "breaker open: the lane refuses requests",
                f"breaker state {state}",
                "the lane failed repeatedly: its replicas' logs say why; interactive traffic spills to the other "
                "lane meanwhile, realtime and batch get 503 with Retry-After",
                {"state": state},
            ))
        elif state_key == "half_open":
            findings.append(Finding(FLOW_THROUGHPUT, "circuit breaker", lane, WARN,
                                    "breaker half-open: probing after failures", f"breaker state {state}",
                                    "watch whether it closes; if it re-opens the lane is still failing",
                                    {"state": state}))
    closed = {lane: state for lane, state in sorted(inputs.breakers.items())
              if state.lower().replace("-", "_") not in ("open", "half_open")}
    if closed:
        findings.append(Finding(FLOW_THROUGHPUT, "circuit breaker", "lanes", OK, "breakers closed",
                                ", ".join(f"{lane} {state}" for lane, state in closed.items()), "",
                                {"states": closed}))
    return findings

