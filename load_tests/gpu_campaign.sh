#!/usr/bin/env bash
# The GPU campaign on one H200: the app under each serve config in turn, the same workload each time, one
# summary. Runs ON the GPU host (the load generator talks to the app over loopback), after the payload is installed:
#
#   source /tmp/site.env && bash load_tests/gpu_campaign.sh PHASE [PHASE ...]
#
# Phases (run in the order given; each serving phase starts Ray + the app, measures, and tears everything down):
#   preflight          env + versions, the 8B dummy model dir, app.tools.preflight, app.tools.kv_budget per lane and
#                      for gpu-single.yaml's engines together (--shared-gpu)
#   lanes-tuned        load_tests/configs/gpu-lanes-tuned.yaml  (hot 0.20 / cold 0.70, no MPS)
#   lanes              serve_configs/gpu-single.yaml       (the shipped one-GPU config; with the CUDA MPS daemon on,
#                      which it needs; skipped if MPS is missing)
#   baseline-fcfs      serve_configs/baseline-gpu.yaml     (one engine, FCFS)
#   baseline-priority  load_tests/configs/baseline-gpu-priority.yaml (one engine, vLLM priority)
#   lanes-tuned-mps    gpu-lanes-tuned.yaml with the CUDA MPS daemon on (optional; skipped if MPS is missing)
#   config=PATH        any other serve config or overlay; the phase is named after the file
#   config-mps=PATH    the same with the CUDA MPS daemon on; the phase is named <file>-mps
#   'config=PATH --set KEY=VALUE ...'   (one quoted word; also config-mps=) the config with values changed
#                      (load_tests/overlay.py); the phase is named <file>-<key><value>...
#   summary            only rebuild the summary (every invocation ends with one anyway)
# Overlays (load_tests/configs) are merged here, with PyYAML only: each serving phase keeps the merged config as
# <phase>/serve-config.yaml and serves it (a shipped config without --set is served from its own path).
#
# A device call is limited to 10 minutes, so one call runs one or two phases. State lives in $CAMPAIGN_DIR
# (/tmp/campaign), which survives back-to-back calls on a warm machine; at the end of every phase and at exit the
# whole campaign so far is copied into $OUT (<= 7 files, no folders): summary.md, summary.json, report.md (every
# scenario's combined report, gpu_mixed's first), latency_cdf.png, throughput.png (gpu_mixed's), campaign.tar.gz
# (everything), campaign.log. A phase run again in the same campaign (another SCENARIOS, a repeat) keeps the first
# run's folder and is named <label>-run2, -run3...
# A serving phase that would not finish inside the call (CALL_BUDGET_S from CALL_T0) is deferred, not started:
# the script then exits 3 and lists it in summary.md; run it in the next call.
#
# Settings (environment): CALL_T0 (unix time the device call began; default: now), CALL_BUDGET_S (570),
# PHASE_EST_S (seconds a serving phase needs, 240), READY_TIMEOUT_S (420), SCENARIOS ("gpu_mixed"; e.g.
# "gpu_mixed gpu_shared_prefix"), SCENARIO_DIR (load_tests/scenarios), CAMPAIGN_DIR (/tmp/campaign), PY (python3),
# DIRECT_INGRESS (1: Ray Serve's direct ingress for every serving phase of this invocation: the load generator sends
# the scenarios to the Router replicas' own ports, not through the HTTP proxy; phases are named <label>-di),
# TRACING (1: every serving phase serves a copy of its config that writes every request's spans to
# <phase>/spans.jsonl, and <phase>/ttft-breakdown.md splits each class's TTFT into the hops of the request path
# (load_tests/ttft_breakdown.py); phases are named <label>-traced; the file writes add a little to every request).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
CAMPAIGN_DIR=${CAMPAIGN_DIR:-/tmp/campaign}
OUT_DIR=${OUT:-$CAMPAIGN_DIR/out}
PY=${PY:-python3}
URL=${URL:-http://127.0.0.1:8000}
MODEL_DIR=${MODEL_DIR:-models/llama-8b-dummy}
MODEL_NAME=${MODEL_NAME:-llama-8b-dummy}
CALL_T0=${CALL_T0:-$(date +%s)}
CALL_BUDGET_S=${CALL_BUDGET_S:-570}
PHASE_EST_S=${PHASE_EST_S:-240}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-420}
SCENARIOS=${SCENARIOS:-gpu_mixed}
SCENARIO_DIR=${SCENARIO_DIR:-load_tests/scenarios}
DIRECT_INGRESS=${DIRECT_INGRESS:-0}
TRACING=${TRACING:-0}
# Kept free at the end of a call for the summary, the tarball and the copy into $OUT.
FINALIZE_RESERVE_S=30
# GPU memory (MiB) under which the GPU counts as released after a phase.
GPU_IDLE_MIB=2048

export RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
# No `pip install -e` there: the repo root on PYTHONPATH lets the driver and every Ray worker import `app` (the
# raylet that `ray start` launches, and the workers it forks, inherit this environment).
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

mkdir -p "$CAMPAIGN_DIR" "$OUT_DIR"
LOG=$CAMPAIGN_DIR/campaign.log
SERVE_PID="" GPU_SAMPLER_PID="" STATS_SAMPLER_PID="" MPS_STARTED=0 DEFERRED=()

log() { echo "[$(date -u +%H:%M:%S) +$(( $(date +%s) - CALL_T0 ))s] $*" | tee -a "$LOG" >&2; }
remaining_s() { echo $(( CALL_BUDGET_S - ($(date +%s) - CALL_T0) )); }
have() { command -v "$1" >/dev/null 2>&1; }
# Alive and not a zombie (an exited child stays a zombie until `wait` reaps it).
running() { [ -r "/proc/$1/stat" ] && [ "$(sed 's/.*) //' "/proc/$1/stat" | cut -d' ' -f1)" != Z ]; }
# JSON value: a number as is, anything else quoted, empty -> null.
jnum() { [[ "$1" =~ ^-?[0-9]+(\.[0-9]+)?$ ]] && echo "$1" || echo null; }

config_for() {
  case "$1" in
    lanes-tuned|lanes-tuned-mps) echo load_tests/configs/gpu-lanes-tuned.yaml ;;
    lanes) echo serve_configs/gpu-single.yaml ;;
    baseline-fcfs) echo serve_configs/baseline-gpu.yaml ;;
    baseline-priority) echo load_tests/configs/baseline-gpu-priority.yaml ;;
    config=*) echo "${1#config=}" ;;
    config-mps=*) echo "${1#config-mps=}" ;;
    *) return 1 ;;
  esac
}
label_for() {
  local suffix=""
  [ "$DIRECT_INGRESS" = 1 ] && suffix="-di"
  [ "$TRACING" = 1 ] && suffix="$suffix-traced"
  local spec
  case "$1" in
    config=*) read -r -a spec <<<"${1#config=}"; echo "$("$PY" -m load_tests.overlay --label "${spec[@]}")$suffix" ;;
    config-mps=*) read -r -a spec <<<"${1#config-mps=}"
                  echo "$("$PY" -m load_tests.overlay --label "${spec[@]}")-mps$suffix" ;;
    *) echo "$1$suffix" ;;
  esac
}

# merge_config DIR CONFIG [--set KEY=VALUE ...]: the full serve config (an overlay merged onto its base, the --set
# values applied) written to DIR/serve-config.yaml; prints the file to serve (CONFIG itself if nothing was merged).
merge_config() {
  local dir=$1; shift
  "$PY" -m load_tests.overlay "$@" --out "$dir/serve-config.yaml" --out-dir "$dir"
}

payload_ready() {
  have serve && have ray && "$PY" -c 'import importlib.util as u, sys; sys.exit(0 if u.find_spec("vllm") and u.find_spec("ray") else 1)'
}

ensure_model() {
  [ -f "$MODEL_DIR/config.json" ] && [ -f "$MODEL_DIR/tokenizer.json" ] && return 0
  log "writing the Llama-3.1-8B-shaped dummy model dir $MODEL_DIR"
  "$PY" -m app.tools.make_tiny_model --shape llama-3.1-8b "$MODEL_DIR" >>"$LOG" 2>&1
}

gpu_used_mib() { have nvidia-smi && nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1 | tr -d ' '; }

# ---- preflight --------------------------------------------------------------------------------------------------

phase_preflight() {
  local dir=$CAMPAIGN_DIR/preflight rc stem lane cfg
  rm -rf "$dir"; mkdir -p "$dir"
  log "preflight: environment"
  { date -u; uname -a; echo "nproc: $(nproc)"; free -g; df -h /tmp; echo
    nvidia-smi; nvidia-smi -q 2>/dev/null | grep -iE 'product name|driver version|cuda version|compute mode|mig mode|persistence' 
    echo "nvidia-cuda-mps-control: $(command -v nvidia-cuda-mps-control || echo absent)"
    echo "PYTHONPATH=$PYTHONPATH"; echo "python: $(command -v "$PY")"; } >"$dir/env.txt" 2>&1
  timeout 120 "$PY" - >"$dir/versions.json" 2>>"$dir/env.txt" <<'EOF'
import json, importlib.metadata as md
names = ["torch", "vllm", "ray", "pydantic", "fastapi", "starlette", "uvicorn", "httpx", "matplotlib", "tqdm",
         "pyyaml", "transformers", "tokenizers", "triton", "numpy", "nvidia-ml-py", "prometheus-client",
         "opentelemetry-sdk", "grpcio"]
versions = {}
for n in names:
    try:
        versions[n] = md.version(n)
    except md.PackageNotFoundError:
        versions[n] = None
info = {"packages": versions}
try:
    import torch
    info["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, capability=f"{p.major}.{p.minor}", total_memory_gib=round(p.total_memory / 2**30, 2),
                    multiprocessors=p.multi_processor_count, torch_cuda=torch.version.cuda)
except Exception as error:  # recorded, not fatal
    info["torch_error"] = repr(error)
imports = {}
for module in ("httpx", "yaml", "pydantic", "tqdm", "matplotlib"):
    try:
        __import__(module)
        imports[module] = "ok"
    except Exception as error:
        imports[module] = repr(error)
info["load_generator_imports"] = imports
print(json.dumps(info, indent=1))
EOF
  ensure_model || log "preflight: model dir FAILED (see log)"
  log "preflight: serve configs against the schema"
  for cfg in serve_configs/gpu-single.yaml load_tests/configs/gpu-lanes-tuned.yaml serve_configs/baseline-gpu.yaml \
             load_tests/configs/baseline-gpu-priority.yaml; do
    validate_config "$cfg" >>"$dir/configs.txt" 2>&1; echo "$cfg: rc=$?" >>"$dir/configs.txt"
    # The merged copy: kv_budget reads full serve configs, not overlays.
    "$PY" -m load_tests.overlay "$cfg" --out "$dir/$(basename "$cfg")" 2>>"$dir/configs.txt"
  done
  log "preflight: app.tools.preflight"
  timeout 180 "$PY" -m app.tools.preflight --serve-config serve_configs/gpu-single.yaml --json \
    >"$dir/preflight.json" 2>"$dir/preflight.err"; rc=$?
  timeout 180 "$PY" -m app.tools.preflight --serve-config serve_configs/gpu-single.yaml --no-bandwidth \
    >"$dir/preflight.txt" 2>&1
  local kv_rcs=""
  for pair in gpu-single:hot gpu-single:cold gpu-lanes-tuned:hot gpu-lanes-tuned:cold baseline-gpu:hot; do
    stem=${pair%%:*} lane=${pair##*:}
    timeout 120 "$PY" -m app.tools.kv_budget --serve-config "$dir/$stem.yaml" --lane "$lane" \
      >"$dir/kv-$stem-$lane.txt" 2>&1
    timeout 120 "$PY" -m app.tools.kv_budget --serve-config "$dir/$stem.yaml" --lane "$lane" --json \
      >"$dir/kv-$stem-$lane.json" 2>/dev/null
    kv_rcs+="\"$stem-$lane\": $?, "
  done
  # Every engine that shares the GPU, together (gpu-single.yaml's three): fit, and vLLM's start-up check per engine.
  timeout 120 "$PY" -m app.tools.kv_budget --serve-config serve_configs/gpu-single.yaml --shared-gpu \
    >"$dir/kv-gpu-single-shared.txt" 2>&1
  kv_rcs+="\"gpu-single-shared\": $?, "
  printf '{"preflight_rc": %s, "kv_budget_rc": {%s}}\n' "$rc" "${kv_rcs%, }" >"$dir/summary.json"
  log "preflight: done (preflight rc=$rc; kv_budget rc: ${kv_rcs%, })"
}

validate_config() {  # validate_config CONFIG: a serve config or an overlay (merged first)
  "$PY" - "$1" <<'EOF'
import sys
from app.config import load_app_config
from load_tests.overlay import llm_lanes_application, load_serve_config
cfg = load_app_config(llm_lanes_application(load_serve_config(sys.argv[1]))["args"])
print(f"{sys.argv[1]}: valid; lanes {cfg.lane_names if hasattr(cfg, 'lane_names') else '?'}")
EOF
}

# ---- one serving phase --------------------------------------------------------------------------------------------

start_mps() {
  have nvidia-cuda-mps-control || return 1
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || return 1
  MPS_STARTED=1
}

stop_mps() {
  [ "$MPS_STARTED" = 1 ] || return 0
  echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
  MPS_STARTED=0
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}

stop_samplers() {
  local pid
  for pid in $GPU_SAMPLER_PID $STATS_SAMPLER_PID; do kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; done
  GPU_SAMPLER_PID="" STATS_SAMPLER_PID=""
}

# serve shutdown, then the `serve run` process group (TERM, KILL), then `ray stop --force`, then wait until
# the GPU memory is released so the next config starts on an empty GPU.
stop_app() {
  local dir=$1
  stop_samplers
  if [ -n "$SERVE_PID" ]; then
    timeout 90 serve shutdown -y >>"$dir/shutdown.log" 2>&1
    # No SIGINT: a background job of a non-interactive shell starts with SIGINT ignored.
    for sig in TERM KILL; do
      running "$SERVE_PID" || break
      kill -s "$sig" -- "-$SERVE_PID" 2>/dev/null
      for _ in $(seq 1 10); do running "$SERVE_PID" || break; sleep 1; done
    done
    wait "$SERVE_PID" 2>/dev/null
    SERVE_PID=""
  fi
  timeout 90 ray stop --force >>"$dir/shutdown.log" 2>&1
  release_gpu "$dir" 60
  # The MPS control/server logs name each client and the settings it connected with (SM share, priority).
  [ "$MPS_STARTED" = 1 ] && cp -r "${CUDA_MPS_LOG_DIRECTORY:-/tmp/mps/log}" "$dir/mps-log" 2>/dev/null
  stop_mps
}

gpu_busy() { [ "$(gpu_used_mib || echo 0)" -gt "$GPU_IDLE_MIB" ] 2>/dev/null; }

release_gpu() {  # release_gpu DIR [WAIT_S]: wait for the GPU memory to be freed, then kill what still holds it
  local waited=0 pid
  while gpu_busy && [ "$waited" -lt "${2:-0}" ]; do sleep 2; waited=$((waited + 2)); done
  gpu_busy || return 0
  # Engine-core processes that outlived their Ray workers: on this machine, all were started by this campaign.
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
    log "killing leftover GPU process $pid"; kill -9 "$pid" 2>/dev/null
  done
  sleep 3
}

keep_tail() {  # keep_tail FILE BYTES: a log cut to its first MiB and last BYTES (the tarball has a size limit)
  local f=$1 max=$2
  [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt "$max" ] || return 0
  { head -c 1048576 "$f"; printf '\n[... cut by gpu_campaign.sh ...]\n'; tail -c "$max" "$f"; } >"$f.cut" && mv "$f.cut" "$f"
}

collect_ray_logs() {
  local dir=$1 logs=/tmp/ray/session_latest/logs f
  [ -d "$logs" ] || return 0
  mkdir -p "$dir/raylogs"
  for f in "$logs"/serve/*.log; do [ -f "$f" ] && tail -c 2000000 "$f" >"$dir/raylogs/$(basename "$f")"; done
  grep -l -E 'Traceback|Error' "$logs"/*.err 2>/dev/null | head -20 | while read -r f; do
    tail -c 200000 "$f" >"$dir/raylogs/$(basename "$f")"
  done
}

write_phase_json() {  # write_phase_json DIR LABEL CONFIG STATUS MPS key=value...
  local dir=$1 label=$2 config=$3 status=$4 mps=$5; shift 5
  local timings="" kv
  for kv in "$@"; do timings+="\"${kv%%=*}\": $(jnum "${kv#*=}"), "; done
  printf '{"label": "%s", "config": "%s", "status": "%s", "mps": %s, "started_at": "%s", "timings": {%s}}\n' \
    "$label" "$config" "$status" "$mps" "$(date -u -d "@$PHASE_T0" +%FT%TZ)" "${timings%, }" >"$dir/phase.json"
}

run_serving_phase() {
  local phase=$1 label config dir mps=false t status="ok" ray_s="" ready_s="" scenario_s="" shutdown_s="" sc budget
  local spec
  label=$(label_for "$phase"); read -r -a spec <<<"$(config_for "$phase")"; config=${spec[0]}
  dir=$CAMPAIGN_DIR/$label
  if [ -f "$dir/phase.json" ]; then
    # Run before in this campaign (another scenario, a repeat): kept, and this run numbered beside it.
    local n=2
    while [ -e "$CAMPAIGN_DIR/$label-run$n" ]; do n=$((n + 1)); done
    label="$label-run$n"; dir=$CAMPAIGN_DIR/$label
  fi
  PHASE_T0=$(date +%s)
  rm -rf "$dir"; mkdir -p "$dir"
  log "[$label] config ${spec[*]}"
  if [ ! -f "$config" ]; then
    write_phase_json "$dir" "$label" "$config" "config_missing" false; log "[$label] no such config"; return 1
  fi
  if ! config=$(merge_config "$dir" "${spec[@]}" 2>"$dir/config-check.txt"); then
    write_phase_json "$dir" "$label" "${spec[0]}" "config_invalid" false
    log "[$label] config does not merge: $(tail -3 "$dir/config-check.txt" | tr '\n' ' ')"
    return 1
  fi
  if ! validate_config "$config" >"$dir/config-check.txt" 2>&1; then
    write_phase_json "$dir" "$label" "$config" "config_invalid" false
    log "[$label] config does not validate against app/config/: $(tail -3 "$dir/config-check.txt" | tr '\n' ' ')"
    return 1
  fi
  ensure_model || { write_phase_json "$dir" "$label" "$config" "model_failed" false; return 1; }
  if [ "$TRACING" = 1 ]; then
    "$PY" -m load_tests.gpu_campaign traced-config --config "$config" --spans "$dir/spans.jsonl" \
      --out "$dir/serve-config-traced.yaml" >>"$LOG" 2>&1 \
      || { write_phase_json "$dir" "$label" "$config" "config_invalid" false; log "[$label] no traced config"; return 1; }
    config=$dir/serve-config-traced.yaml
  fi
  # gpu-single.yaml caps the cold lane under MPS: without the daemon its CUDA_MPS_* settings do nothing.
  if [ "$phase" = lanes ] || [ "$phase" = lanes-tuned-mps ] || [[ "$phase" == config-mps=* ]]; then
    if start_mps; then mps=true; log "[$label] MPS daemon started"; else
      write_phase_json "$dir" "$label" "$config" "mps_unavailable" false; log "[$label] no MPS: skipped"; return 1
    fi
  fi

  # A call cut off at its time limit can leave Ray (started in its own sessions) and engines behind.
  timeout 60 ray stop --force >"$dir/ray-start.log" 2>&1
  release_gpu "$dir"
  if [ "$DIRECT_INGRESS" = 1 ]; then export RAY_SERVE_ENABLE_DIRECT_INGRESS=1; else unset RAY_SERVE_ENABLE_DIRECT_INGRESS; fi
  t=$(date +%s)
  timeout 120 ray start --head --num-gpus 1 --disable-usage-stats --dashboard-host 127.0.0.1 >>"$dir/ray-start.log" 2>&1 \
    || { status="ray_start_failed"; log "[$label] ray start failed: $(tail -3 "$dir/ray-start.log" | tr '\n' ' ')"; }
  ray_s=$(( $(date +%s) - t ))
  if [ "$status" = ok ]; then
    t=$(date +%s)
    # Its own session and process group, so stop_app can signal the whole tree. `--address auto`: join the cluster
    # just started (with this environment), never quietly start another one.
    setsid serve run --address auto "$config" >"$dir/serve.log" 2>&1 &
    SERVE_PID=$!
    budget=$(( $(remaining_s) - 120 ))
    [ "$budget" -gt "$READY_TIMEOUT_S" ] && budget=$READY_TIMEOUT_S
    log "[$label] serve run started (pid $SERVE_PID); waiting up to ${budget}s for the app"
    if "$PY" -m load_tests.gpu_campaign wait-ready --url "$URL" --model "$MODEL_NAME" --timeout "$budget" \
         --pid "$SERVE_PID" --out "$dir/ready.json" >>"$LOG" 2>&1; then
      ready_s=$(( $(date +%s) - t ))
      log "[$label] ready after ${ready_s}s"
      nvidia-smi >"$dir/nvidia-smi-ready.txt" 2>&1
      "$PY" -m load_tests.gpu_campaign smoke --url "$URL" --model "$MODEL_NAME" --out "$dir/smoke.json" \
        >"$dir/smoke.txt" 2>&1 || log "[$label] smoke request failed (see smoke.json)"
      log "[$label] smoke: $(head -c 400 "$dir/smoke.txt")"
      nvidia-smi --query-gpu=timestamp,memory.used,memory.total,utilization.gpu,power.draw,clocks.sm \
        --format=csv,noheader,nounits -lms 1000 >"$dir/gpu.csv" 2>/dev/null &
      GPU_SAMPLER_PID=$!
      "$PY" -m load_tests.gpu_campaign sample-stats --url "$URL" --out "$dir/stats.jsonl" --interval 2 \
        >/dev/null 2>&1 &
      STATS_SAMPLER_PID=$!
      local target=$URL
      if [ "$DIRECT_INGRESS" = 1 ]; then
        target=$("$PY" -m load_tests.direct_ingress urls --serve-config "$config" --log "$dir/serve.log" --timeout 60 \
          2>>"$LOG") || { log "[$label] no direct-ingress ports found; using the proxy"; target=$URL; }
        log "[$label] scenarios go to $target"
      fi
      t=$(date +%s)
      for sc in $SCENARIOS; do
        budget=$(( $(remaining_s) - 60 ))
        if [ "$budget" -lt 90 ]; then log "[$label] no time left for scenario $sc"; status="partial"; break; fi
        log "[$label] scenario $sc (at most ${budget}s)"
        timeout "$budget" "$PY" -m load_tests.run --scenario "$SCENARIO_DIR/$sc.yaml" --url "$target" --label "$label" \
          --out "$dir/$sc" --no-progress >"$dir/$sc.log" 2>&1 \
          || { log "[$label] scenario $sc exited $? (see $sc.log)"; status="partial"; }
      done
      scenario_s=$(( $(date +%s) - t ))
      if [ "$TRACING" = 1 ]; then
        # Only the measured part: the load generator's warm-up requests (one per client, one at a time, on a GPU
        # without batch work yet) are traced too. They begin before the first scenario's measured_from_unix.
        since=$("$PY" -c 'import json, sys; t = json.load(open(sys.argv[1]))["runs"][0].get("measured_from_unix")
print(t) if t else sys.exit(1)' \
          "$dir/${SCENARIOS%% *}/report.json" 2>/dev/null) || since=$t
        timeout 120 "$PY" -m load_tests.ttft_breakdown "$dir/spans.jsonl" --json "$dir/ttft-breakdown.json" \
          --since "$since" >"$dir/ttft-breakdown.md" 2>&1
        log "[$label] TTFT by hop (ms):"; cat "$dir/ttft-breakdown.md" | tee -a "$LOG" >&2
      fi
      nvidia-smi >"$dir/nvidia-smi-after.txt" 2>&1
      "$PY" -m load_tests.gpu_campaign stats --url "$URL" --out "$dir/stats-final.json" >/dev/null 2>&1
    else
      status="not_ready"
      log "[$label] app not ready: $(tail -c 600 "$dir/ready.json" 2>/dev/null)"
    fi
  fi
  collect_ray_logs "$dir"
  t=$(date +%s)
  stop_app "$dir"
  shutdown_s=$(( $(date +%s) - t ))
  keep_tail "$dir/serve.log" 6000000
  [ -f "$dir/spans.jsonl" ] && keep_tail "$dir/spans.jsonl" 20000000
  write_phase_json "$dir" "$label" "$config" "$status" "$mps" "ray_start_s=$ray_s" "ready_s=$ready_s" \
    "scenario_s=$scenario_s" "shutdown_s=$shutdown_s" "phase_s=$(( $(date +%s) - PHASE_T0 ))"
  log "[$label] $status: ray ${ray_s}s, ready ${ready_s:-–}s, scenarios ${scenario_s:-–}s, shutdown ${shutdown_s}s"
  [ "$status" = ok ]
}

# ---- results into $OUT ------------------------------------------------------------------------------------------

finalize_out() {
  local base parent size
  log "summary -> $OUT_DIR"
  printf '%s\n' "${DEFERRED[@]}" >"$CAMPAIGN_DIR/deferred.txt"
  [ ${#DEFERRED[@]} -gt 0 ] || rm -f "$CAMPAIGN_DIR/deferred.txt"
  timeout 120 "$PY" -m load_tests.gpu_campaign summary --campaign "$CAMPAIGN_DIR" --out "$CAMPAIGN_DIR/combined" \
    >>"$LOG" 2>&1 || log "summary failed (see campaign.log)"
  mkdir -p "$OUT_DIR"
  cp -f "$CAMPAIGN_DIR/combined/summary.md" "$CAMPAIGN_DIR/combined/summary.json" "$OUT_DIR/" 2>/dev/null
  for f in latency_cdf.png throughput.png; do
    cp -f "$CAMPAIGN_DIR/combined/gpu_mixed/$f" "$OUT_DIR/$f" 2>/dev/null
  done
  # Every scenario's report in one report.md, gpu_mixed's first: a call returns 8 files at most.
  local report
  rm -f "$OUT_DIR/report.md"
  for report in "$CAMPAIGN_DIR/combined/gpu_mixed/report.md" "$CAMPAIGN_DIR"/combined/*/report.md; do
    [ -f "$report" ] || continue
    [ "$report" = "$CAMPAIGN_DIR/combined/gpu_mixed/report.md" ] && [ -s "$OUT_DIR/report.md" ] && continue
    cat "$report" >>"$OUT_DIR/report.md"; printf '\n' >>"$OUT_DIR/report.md"
  done
  base=$(basename "$CAMPAIGN_DIR"); parent=$(dirname "$CAMPAIGN_DIR")
  tar -czf "$OUT_DIR/campaign.tar.gz.part" -C "$parent" --exclude="$base/out" "$base" 2>/dev/null
  size=$(stat -c %s "$OUT_DIR/campaign.tar.gz.part" 2>/dev/null || echo 0)
  if [ "$size" -gt 15000000 ]; then  # $OUT files come back only up to 16 MiB each
    tar -czf "$OUT_DIR/campaign.tar.gz.part" -C "$parent" --exclude="$base/out" --exclude='*/raylogs' \
      --exclude='*.log' --exclude="$base/combined/*/report.json" "$base" 2>/dev/null
  fi
  mv -f "$OUT_DIR/campaign.tar.gz.part" "$OUT_DIR/campaign.tar.gz"
  cp -f "$LOG" "$OUT_DIR/campaign.log"
}

on_exit() {
  local rc=$?
  trap - EXIT INT TERM
  if [ -n "$SERVE_PID" ] || [ -n "$GPU_SAMPLER_PID" ] || [ -n "$STATS_SAMPLER_PID" ]; then
    log "cleaning up after an interruption"; stop_app "$CAMPAIGN_DIR"
  fi
  stop_mps
  finalize_out
  exit "$rc"
}

# The verified GPU payload (../shared/gpu) carries vllm + ray and their dependencies, not everything pyproject.toml
# asks for: it may have an older grpcio than the stubs' floor (they are generated by grpcio-tools 1.85.1 and refuse an
# older runtime; the payload has had 1.84.0) and no grpcio-health-checking, and then the Serve proxy cannot start the
# gRPC server and `serve run` exits.
# The GPU benchmarks use HTTP only, so in this disposable copy of the tree: lower the stubs' version floor to the
# runtime's and drop the health servicer from the serve configs. Logged, never done on a developer's checkout.
adapt_to_payload() {
  local have_grpc stub=app/proto/llm_lanes/v1/llm_lanes_pb2_grpc.py
  have_grpc=$("$PY" -c 'import grpc; print(grpc.__version__)' 2>/dev/null)
  if [ -n "$have_grpc" ] && ! "$PY" -c "import app.proto.llm_lanes.v1.llm_lanes_pb2_grpc" >/dev/null 2>&1; then
    sed -i "s/^GRPC_GENERATED_VERSION = .*/GRPC_GENERATED_VERSION = '$have_grpc'/" "$stub"
    log "payload: grpcio $have_grpc is older than the stubs' floor; lowered it in this copy of $stub"
  fi
  if ! "$PY" -c "import grpc_health.v1.health_pb2_grpc" >/dev/null 2>&1; then
    sed -i '/add_HealthServicer_to_server/d' serve_configs/*.yaml load_tests/configs/*.yaml
    log "payload: no grpcio-health-checking; dropped the gRPC health servicer from this copy's serve configs"
  fi
}

# ---- main -------------------------------------------------------------------------------------------------------

[ $# -gt 0 ] || { sed -n '2,37p' "$0"; exit 2; }
for phase in "$@"; do
  case "$phase" in preflight|summary) ;; *) config_for "$phase" >/dev/null || { echo "unknown phase: $phase" >&2; exit 2; } ;; esac
done
if ! payload_ready; then
  echo "vllm/ray are not installed here (a fresh machine?): run the three payload calls first, then" \
       "'source /tmp/site.env'" | tee -a "$LOG" >&2
  exit 42
fi
trap on_exit EXIT
trap 'exit 130' INT TERM
adapt_to_payload
log "campaign: phases $* (budget ${CALL_BUDGET_S}s from call start, $(remaining_s)s left)"
failed=0
for phase in "$@"; do
  case "$phase" in
    summary) ;;
    preflight) phase_preflight ;;
    *)
      if [ ${#DEFERRED[@]} -gt 0 ] || [ "$(remaining_s)" -lt $(( PHASE_EST_S + FINALIZE_RESERVE_S )) ]; then
        DEFERRED+=("$phase"); log "[$phase] deferred: $(remaining_s)s left, a phase needs ~${PHASE_EST_S}s"
        continue
      fi
      run_serving_phase "$phase" || failed=1
      finalize_out  # what is done so far comes back even if a later phase runs into the call's time limit
      ;;
  esac
done
if [ ${#DEFERRED[@]} -gt 0 ]; then
  log "DEFERRED to the next call: ${DEFERRED[*]}"
  exit 3
fi
exit "$failed"
