"""The doctor's thresholds, named for what they decide (the checks compare against these)."""

from app.config import AdmissionConfig

# A replica whose KV cache is this full cannot admit a new sequence without preempting one.
KV_FULL_FRACTION = 0.95
# Prompts within this fraction of max_model_len leave no room to generate and hold a whole sequence's KV blocks.
NEAR_MAX_MODEL_LEN_FRACTION = 0.9
# p99 prompt this many times the median: a few requests carry contexts far longer than the usual traffic.
PROMPT_TAIL_RATIO_WARN = 8.0
# Long-context degrades above this share of all requests: the cold lane carries real load for them.
LONG_CONTEXT_SHARE_WARN = 0.10
# Routing balance: a lane is imbalanced when one replica's load (running + waiting) is this many times another's
# (+1 so an idle replica compares as 1) and the busy one has at least this much load.
IMBALANCE_LOAD_RATIO = 4.0
IMBALANCE_MIN_LOAD = 8
# Request outcomes: share of error + timeout, and of rejections (429 / 503), among finished requests.
ERROR_SHARE_WARN = 0.01
ERROR_SHARE_PROBLEM = 0.05
REJECTED_SHARE_WARN = 0.05
# Tails: a p99 read from fewer samples than this is just the maximum, not a tail.
MIN_SAMPLES_FOR_TAIL = 20
# TTFT p99/p50: queueing or long prefills in front of some requests. E2E varies with output length by nature, so
# only a large ratio is worth a look and never a PROBLEM on its own.
TTFT_TAIL_RATIO_WARN = 5.0
TTFT_TAIL_RATIO_PROBLEM = 10.0
E2E_TAIL_RATIO_WARN = 10.0
# The tuning guide's realtime goal: P99 < 450 ms.
REALTIME_TTFT_P99_GOAL_S = 0.45
# Slowest traces: WARN when the slowest request took this many times the median traced request.
SLOW_TRACE_RATIO_WARN = 5.0
DEFAULT_SLOWEST_TRACES = 5
# TTFT by hop: the Router's own work plus the two Serve hops is "the request path"; WARN when it is at least this
# share of a class's median TTFT (on the H200 it is ~7 of 42 ms with Ray Serve's default replica settings, ~4 of 28
# with gpu-single.yaml's; docs/history.md, round 9).
PATH_SHARE_WARN = 0.5
# Without a serve config: the schema's admission.long_context_threshold (the tuning guide's 8K).
SCHEMA_LONG_CONTEXT_THRESHOLD = AdmissionConfig.model_fields["long_context_threshold"].default
