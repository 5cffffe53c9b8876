#!/usr/bin/env bash
# The prepared GPU check: one command, on one H200, answers what a CPU cannot (docs/gpu_check.md).
#
#   bash tools/gpu_check.sh                  # a fresh GPU machine with package registries: install, check
#   bash tools/gpu_check.sh --install none --python python3 --wheels .whl
#                                            # an image that has CUDA torch already, no registry
#   bash tools/gpu_check.sh --dry-run        # the plan: every step, its time box and command (any host)
#   bash tools/gpu_check.sh --fetch-wheels .whl   # where a registry is reachable: the few wheels that
#                                            # --install none needs on an image without one
#
# Every step is time-boxed (timeout) against one deadline (--budget-s) and writes its evidence into
# $OUT (the device tool sets it; else SCRATCH/out): log.txt, results.json, summary.txt, pytest.txt and
# the RL run's rl_metrics.jsonl, rl_summary.json, rl_phases.jsonl; seven files (the device tool brings
# back at most eight). A failing or killed step is recorded and the next one runs. Never run on a GPU
# yet: written on a CPU-only machine.
set -uo pipefail  # no -e: one failing step must not hide the others

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
INSTALL=fresh PYTHON_BIN="" WHEELS="" BUDGET_S=470 STEPS=all SMALL="" DRY_RUN=0 DEVICE=cuda FETCH=""
OUT=${OUT:-} SCRATCH=${SCRATCH:-}

# step: name, time box (s), what it does. Order = priority: the acceptance figures come early.
PLAN="gpu:10:nvidia-smi: the GPU, its driver and clocks; refuses to go on without one
install:240:CUDA torch 2.13.0 + the project (-e .[dev]) in a venv; apt libaio-dev, g++; in the background: the [gpu] extra in an env of its own, the JIT op prebuild
env:40:section env: versions, device, kernels found, baselines importable
mla_decode:60:section mla_decode: paged MLA decode vs torch, fp32/bf16, B=64 x 8k and B=4 x 32k; HBM fraction
kda_chunk:60:section kda_chunk: KDA chunk forward vs torch, fp32/bf16, T=8192 and 8 x 2048; TFLOP/s
fla:150:section fla (baseline env): ours vs fla chunk_kda fwd/bwd and fused_recurrent_kda
rl_run:200:section rl_run: 3 RL iterations, experiment.device=cuda, bf16, streamed reference, spill
kda_backward:60:section kda_backward: KDA chunk forward+backward (Triton autograd) vs torch autograd
kda_decode:30:section kda_decode: KDA decode step vs torch; GB/s
mla_weights:30:section mla_weights: per-token attention weights vs torch
mla_prefill:40:section mla_prefill: paged MLA prefill vs torch
compile_stats:60:section compile_stats: variants per kernel over T in 1,17,1000,1024,1025,3000; regs/spills/smem
engine_syncs:45:section engine_syncs: host syncs per engine prefill / decode step
pinned_host:20:section pinned_host: pinned host allocator rounding
pytest:240:pytest -m 'gpu or triton' natively (every test file; collection errors do not stop it)
flashinfer:120:section flashinfer (baseline env): ours vs FlashInfer MLA paged decode (JIT-compiles first)"
MIN_STEP_S=15  # a step is skipped ("out of time") when less than this is left before the deadline
RESERVE_S=10   # kept for the summary

usage() {
  cat <<EOF
Usage: bash tools/gpu_check.sh [options]

  --out DIR          evidence folder (default: \$OUT, else SCRATCH/out)
  --scratch DIR      venvs, caches, the RL run directory (default: \$SCRATCH, else a new temp dir)
  --install MODE     fresh (default): python3.11 venv, CUDA torch 2.13.0 and the project from the
                     package registries; none: use --python as it is (CUDA torch already there)
  --python PY        interpreter for --install none (default: python3)
  --wheels DIR       with --install none: wheels to add offline (fla_core*/einops*/flashinfer*
                     go to the baseline env, the rest to the check's path)
  --budget-s N       deadline for the whole run, seconds (default 470: under 8 minutes)
  --steps LIST       comma-separated steps to run (default: all; gpu always runs unless --dry-run)
  --small            small shapes in the Python sections (a quick smoke run)
  --dry-run          print the plan and exit; touches nothing, needs no GPU
  --fetch-wheels DIR download, for an image with CUDA torch and Python 3.12 but no registry, the
                     wheels --install none --wheels DIR needs (hydra-core, omegaconf, antlr4 runtime,
                     fla-core; ~1.5 MB) and exit
  --device cpu       with --install none: run the steps on CPU, Triton under its interpreter (a test
                     of this script's plumbing: no GPU figure; the CUDA-only sections say so)
  -h, --help         this text

Steps (name, time box in s, what):
$(echo "$PLAN" | awk -F: '{d = $0; sub(/^[^:]*:[^:]*:/, "", d); printf "  %-14s %4s  %s\n", $1, $2, d}')
EOF
}

die() { echo "error: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=${2:?--out needs a folder}; shift 2 ;;
    --scratch) SCRATCH=${2:?--scratch needs a folder}; shift 2 ;;
    --install) INSTALL=${2:?--install needs fresh or none}; shift 2 ;;
    --python) PYTHON_BIN=${2:?--python needs an interpreter}; shift 2 ;;
    --wheels) WHEELS=${2:?--wheels needs a folder}; shift 2 ;;
    --budget-s) BUDGET_S=${2:?--budget-s needs seconds}; shift 2 ;;
    --steps) STEPS=${2:?--steps needs a list}; shift 2 ;;
    --small) SMALL=--small; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    --device) DEVICE=${2:?--device needs cuda or cpu}; shift 2 ;;
    --fetch-wheels) FETCH=${2:?--fetch-wheels needs a folder}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done
case "$INSTALL" in fresh|none) ;; *) die "--install must be 'fresh' or 'none', got '$INSTALL'" ;; esac
case "$DEVICE" in cuda|cpu) ;; *) die "--device must be 'cuda' or 'cpu', got '$DEVICE'" ;; esac
[ "$DEVICE" = cuda ] || [ "$INSTALL" = none ] || die "--device cpu goes with --install none (fresh installs CUDA torch)"
[[ "$BUDGET_S" =~ ^[0-9]+$ ]] || die "--budget-s must be a whole number of seconds, got '$BUDGET_S'"
[ -z "$WHEELS" ] || [ "$INSTALL" = none ] || die "--wheels goes with --install none (fresh installs from the registries)"
[ -z "$WHEELS" ] || [ -d "$WHEELS" ] || die "--wheels '$WHEELS' is not a folder"
KNOWN=$(echo "$PLAN" | cut -d: -f1 | tr '\n' ' ')
if [ "$STEPS" != all ]; then
  for s in ${STEPS//,/ }; do [[ " $KNOWN " == *" $s "* ]] || die "unknown step '$s'; steps: $KNOWN"; done
fi

wanted() { [ "$STEPS" = all ] || [[ ",$STEPS," == *",$1,"* ]] || [ "$1" = gpu ]; }
budget_of() { echo "$PLAN" | awk -F: -v s="$1" '$1 == s {print $2}'; }

if [ -n "$FETCH" ]; then  # pure-Python wheels: any host with pip and a registry can fetch them
  py=${PYTHON_BIN:-python3}
  mkdir -p "$FETCH" || die "cannot create $FETCH"
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$FETCH" \
    hydra-core==1.3.8 "omegaconf>=2.3,<2.4" fla-core==0.6.0 || die "pip download failed"
  "$py" -m pip wheel -q --no-deps -w "$FETCH" antlr4-python3-runtime==4.9.3 || die "pip wheel (antlr4) failed"
  ls -l "$FETCH"
  exit 0
fi

if [ "$DRY_RUN" = 1 ]; then
  echo "gpu_check plan (dry run: nothing is run): install=$INSTALL budget=${BUDGET_S}s steps=$STEPS ${SMALL}"
  echo "$PLAN" | while IFS=: read -r name box what; do
    if wanted "$name"; then echo "  run   $name (<= ${box}s): $what"; else echo "  skip  $name"; fi
  done
  echo "evidence: \$OUT/{log.txt,results.json,summary.txt,pytest.txt,rl_metrics.jsonl,rl_summary.json,rl_phases.jsonl}"
  exit 0
fi

# ---- from here on: a real run ------------------------------------------------------------------------
T0=$(date +%s)
DEADLINE=$((T0 + BUDGET_S))
SCRATCH=${SCRATCH:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
OUT=${OUT:-$SCRATCH/out}
mkdir -p "$OUT" "$SCRATCH" || die "cannot create $OUT or $SCRATCH"
OUT=$(cd "$OUT" && pwd) SCRATCH=$(cd "$SCRATCH" && pwd)
LOG=$OUT/log.txt RESULTS=$OUT/results.json
export OUT PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DS_BUILD_OPS=0 WANDB_MODE=disabled \
  TORCH_EXTENSIONS_DIR=$SCRATCH/torch_extensions TRITON_CACHE_DIR=$SCRATCH/triton_cache GPU_CHECK_SCRATCH=$SCRATCH
unset TRITON_INTERPRET  # native Triton only
cd "$ROOT" || die "cannot enter $ROOT"
PY="" BASE_PY="" BASE_PATH="" BG_PIDS=() APT_PID="" BASE_INSTALL_PID=""

log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
left_s() { echo $(( DEADLINE - $(date +%s) - RESERVE_S )); }
record() {  # step rc wall_s note: into results.json (any python3 will do: no torch needed)
  local py=${PY:-python3}
  "$py" tools/gpu_check.py --record-step "$RESULTS" "$1" "$2" "$3" --note "${4:-}" >/dev/null 2>&1 \
    || echo "(could not record step $1 in results.json)" >>"$LOG"
}

# run_step NAME CMD...: time-boxed by min(its box, time left); output into log.txt
run_step() {
  local name=$1; shift
  local box limit start rc
  box=$(budget_of "$name"); limit=$(left_s)
  [ "$limit" -gt "$box" ] && limit=$box
  if [ "$limit" -lt "$MIN_STEP_S" ]; then
    log "skip $name: out of time (${limit}s left of the ${BUDGET_S}s budget)"; record "$name" -1 0 "skipped: out of time"
    return 0
  fi
  log "start $name (time box ${limit}s)"
  start=$(date +%s)
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  local note=""; [ "$rc" = 124 ] || [ "$rc" = 137 ] && note="killed at its ${limit}s time box"
  log "end $name rc=$rc ($(( $(date +%s) - start ))s) $note"
  record "$name" "$rc" "$(( $(date +%s) - start ))" "$note"
}

section() {  # a Python section in a process of its own (a CUDA fault poisons the whole process)
  run_step "$1" "$PY" tools/gpu_check.py --device "$DEVICE" --out "$OUT" --sections "$1" ${SMALL:+"$SMALL"}
}

baseline_section() {  # the same, with the [gpu] extra importable (never on the test path)
  if [ -z "$BASE_PY" ]; then log "skip $1: no baseline environment"; record "$1" -1 0 "no baseline env"; return 0; fi
  run_step "$1" env PYTHONPATH="$BASE_PATH${PYTHONPATH:+:$PYTHONPATH}" "$BASE_PY" tools/gpu_check.py \
    --device "$DEVICE" --out "$OUT" --sections "$1" ${SMALL:+"$SMALL"}
}

gpu_step() {
  log "gpu_check: device=$DEVICE install=$INSTALL budget=${BUDGET_S}s out=$OUT scratch=$SCRATCH" \
      "commit=$(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  if [ "$DEVICE" = cpu ]; then log "device cpu: a plumbing run under the Triton interpreter; no GPU figure"; return; fi
  if ! nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>&1 \
      | tee -a "$LOG"; then
    log "error: no NVIDIA GPU visible here (nvidia-smi failed or is missing): this check runs on a GPU host." \
        "--dry-run prints its plan; the CPU-runnable parts: python tools/gpu_check.py --device cpu --small"
    exit 2
  fi
}

# ---- install -----------------------------------------------------------------------------------------
as_root_apt() {  # apt-get install the packages given, when root with apt; 1 otherwise
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 1
  timeout 60 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 120 apt-get install -y -qq "$@" >/dev/null
}

install_fresh() {  # python3.11 venv with CUDA torch and the project, as the Makefile does (torch first)
  local py311
  py311=$(command -v python3.11 || true)
  if [ -z "$py311" ]; then
    if ! as_root_apt python3.11 python3.11-venv; then
      echo "python3.11 is missing and apt could not install it (the project's pins are cp311);" \
           "on an image that has CUDA torch already, use --install none"
      return 1
    fi
    py311=$(command -v python3.11)
  fi
  if ! dpkg -s libaio-dev >/dev/null 2>&1 || ! command -v g++ >/dev/null; then  # DeepSpeed's ops; not needed yet
    (as_root_apt libaio-dev g++ >"$SCRATCH/apt.log" 2>&1 || echo "apt: libaio-dev/g++ not installed" >>"$SCRATCH/apt.log") &
    APT_PID=$!; BG_PIDS+=("$APT_PID")
  fi
  if ! "$py311" -m venv "$SCRATCH/venv"; then  # Debian splits ensurepip into python3.11-venv
    if ! { as_root_apt python3.11-venv && "$py311" -m venv --clear "$SCRATCH/venv"; }; then
      echo "cannot make a python3.11 venv (python3.11-venv missing?)"; return 1
    fi
  fi
  PY=$SCRATCH/venv/bin/python
  printf 'torch==2.13.0\ntriton==3.7.1\n' >"$SCRATCH/constraints.txt"
  # few retries, short timeouts: without a registry, fail in seconds rather than minutes
  export PIP_RETRIES=2 PIP_TIMEOUT=30
  timeout 150 "$PY" -m pip install -q -c "$SCRATCH/constraints.txt" torch==2.13.0 || { echo "torch install failed"; return 1; }
  timeout 80 "$PY" -m pip install -q -c "$SCRATCH/constraints.txt" -e '.[dev]' || { echo "project install failed"; return 1; }
}

install_none() {  # the interpreter as it is; --wheels added offline (never into its own site-packages)
  PY=${PYTHON_BIN:-python3}
  command -v "$PY" >/dev/null || { echo "--python '$PY' not found"; return 1; }
  BASE_PY=$PY BASE_PATH=$SCRATCH/baselines
  [ -n "$WHEELS" ] || return 0
  local w main=() base=()
  for w in "$WHEELS"/*.whl; do
    [ -e "$w" ] || continue
    case $(basename "$w") in fla_core-*|flashinfer*|einops-*) base+=("$w") ;; *) main+=("$w") ;; esac
  done
  if [ ${#main[@]} -gt 0 ]; then
    "$PY" -m pip install -q --no-index --no-deps --target "$SCRATCH/site" "${main[@]}" || return 1
    export PYTHONPATH="$SCRATCH/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  if [ ${#base[@]} -gt 0 ]; then
    "$PY" -m pip install -q --no-index --no-deps --target "$BASE_PATH" "${base[@]}" || echo "baseline wheels not installed"
  fi
}

install_all() {
  if [ "$INSTALL" = fresh ]; then install_fresh || return 1; else install_none || return 1; fi
  "$PY" -c 'import sys, torch, triton
ok = torch.cuda.is_available() and torch.version.cuda is not None
print("python", sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda, "triton",
      triton.__version__, "device", torch.cuda.get_device_name() if ok else None)
sys.exit(0 if ok or sys.argv[1] == "cpu" else 1)' "$DEVICE" || {
    echo "this torch has no CUDA or sees no GPU: for --install fresh, point pip at an index with the CUDA" \
         "wheel (PIP_INDEX_URL / PIP_EXTRA_INDEX_URL); for --install none, pass a --python whose torch has CUDA"
    return 1; }
}

start_background_jobs() {  # the baseline env and the JIT op prebuild, while the first sections run
  if [ "$INSTALL" = fresh ]; then
    # fla-core and FlashInfer in a venv of their own that sees the main venv's packages through a .pth
    # file; the main venv (where pytest runs) never sees them: transformers would bind fla's kernels.
    (
      set -e
      "$PY" -m venv "$SCRATCH/base"
      site_main=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
      site_base=$("$SCRATCH/base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
      echo "import site; site.addsitedir('$site_main')" >"$site_base/_hybridrl_main_venv.pth"
      timeout 240 "$SCRATCH/base/bin/python" -m pip install -q -c "$SCRATCH/constraints.txt" fla-core==0.6.0 \
        flashinfer-python
      touch "$SCRATCH/base.ok"
    ) >"$SCRATCH/baseline_install.log" 2>&1 &
    BASE_INSTALL_PID=$!; BG_PIDS+=("$BASE_INSTALL_PID")
    BASE_PY=$SCRATCH/base/bin/python BASE_PATH=""
  fi
  [ "$DEVICE" = cuda ] || return 0  # no JIT builds on a CPU plumbing run
  (
    [ -n "${APT_PID:-}" ] && while kill -0 "$APT_PID" 2>/dev/null; do sleep 1; done
    timeout 300 "$PY" -m kernels.prebuild
  ) >"$SCRATCH/prebuild.log" 2>&1 &
  BG_PIDS+=("$!")
}

wait_for_baselines() {  # the baseline env's install, waited for only while time is left
  [ -n "${BASE_INSTALL_PID:-}" ] || return 0
  while kill -0 "$BASE_INSTALL_PID" 2>/dev/null && [ "$(left_s)" -gt "$MIN_STEP_S" ]; do sleep 2; done
  if [ ! -f "$SCRATCH/base.ok" ]; then
    log "baseline env not ready (see baseline_install.log in log.txt): fla / flashinfer sections skipped"
    BASE_PY=""
  fi
  BASE_INSTALL_PID=""
}

# shellcheck disable=SC2317  # invoked by the EXIT trap
finish() {
  for pid in "${BG_PIDS[@]}"; do pkill -TERM -P "$pid" 2>/dev/null; kill "$pid" 2>/dev/null; done  # ours only
  for f in "$SCRATCH"/apt.log "$SCRATCH"/prebuild.log "$SCRATCH"/baseline_install.log; do
    [ -f "$f" ] && { echo "---- $(basename "$f") (tail)"; tail -15 "$f"; } >>"$LOG"
  done
  local py=${PY:-python3}
  "$py" tools/gpu_check.py --summarize "$RESULTS" >"$OUT/summary.txt" 2>&1 \
    || echo "summary failed: see log.txt" >>"$OUT/summary.txt"
  log "summary ($(( $(date +%s) - T0 ))s in all):"
  tee -a "$LOG" <"$OUT/summary.txt"
}

gpu_step  # refuses (exit 2) before anything else without a GPU
trap finish EXIT
if wanted install; then
  start=$(date +%s)
  install_all > >(tee -a "$LOG") 2>&1  # not a pipeline: what it sets (PY, BASE_PY) stays in this shell
  rc=$?
  record install "$rc" "$(( $(date +%s) - start ))"
  [ "$rc" = 0 ] || { log "install failed: nothing else can run (see above)"; exit 1; }
  start_background_jobs
else  # an earlier run's environments under --scratch, else the interpreter as it is
  PY=${PYTHON_BIN:-python3}; [ -x "$SCRATCH/venv/bin/python" ] && PY=$SCRATCH/venv/bin/python
  BASE_PY=$PY BASE_PATH=$SCRATCH/baselines
  [ -x "$SCRATCH/base/bin/python" ] && BASE_PY=$SCRATCH/base/bin/python BASE_PATH=""
fi

for step in env mla_decode kda_chunk fla rl_run kda_backward kda_decode mla_weights mla_prefill compile_stats \
            engine_syncs pinned_host pytest flashinfer; do
  wanted "$step" || continue
  case "$step" in
    fla|flashinfer) wait_for_baselines; baseline_section "$step" ;;
    rl_run)  # the run's own timeout ends inside the section's box, so its files are still copied out
      box=$(budget_of rl_run); [ "$(left_s)" -lt "$box" ] && box=$(left_s)
      export GPU_CHECK_RL_TIMEOUT_S=$(( box > 30 ? box - 20 : 10 )); section rl_run ;;
    pytest)  # the whole output in pytest.txt, its tail in log.txt
      run_step pytest bash -c "\"\$0\" -m pytest -m 'gpu or triton' -v -p no:cacheprovider \
        --continue-on-collection-errors -rfEs --durations=10 tests >'$OUT/pytest.txt' 2>&1; rc=\$?; \
        tail -30 '$OUT/pytest.txt'; exit \$rc" "$PY" ;;
    *) section "$step" ;;
  esac
done
exit 0  # the steps ran; pass or fail is in summary.txt
