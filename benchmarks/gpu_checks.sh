#!/usr/bin/env bash
# The GPU checks of docs/devices.md in one go (about six minutes on an H100, pip install included), for
# a GPU machine that has torch (a CUDA build) and no internet. From the repository root:
#
#   OUT=/some/dir bash benchmarks/gpu_checks.sh
#
# Steps, each with its own time limit, in this order (a step that fails does not stop the others); what
# matters most first (issue "Device paths, third review"), within ten minutes:
#   install   this checkout (./client and .) against the machine's torch, no build isolation
#   tests     the GPU tests (pytest): device backends, fake-driver tests, CUDA engines, native copies
#   nonroot   the chart's default: a daemon as uid 10001 against a root engine, store and load exact
#   ipcpid    bare torch CUDA IPC across PID namespaces with equal and with different PIDs: which open
#   sigterm   the daemon SIGTERMed mid-load: it drains and exits 0, no byte lands late or outside
#   kernel    the copy kernel (KVSTORE_CUDA_COPY_KERNEL=1) on IPC memory, exact; then a sticky fault: exit 75
#   bigpool   a pool of up to 64 GiB pinned at the first mapping, a 32 GiB engine cache opened by IPC
#   pidns     daemon and two engines in three PID namespaces (unshare --pid), both engines PID 1: CUDA
#             IPC does not open across them, so each registration is refused naming hostPID
#   kill      an engine SIGKILLed while its store waits for its (10 s) step; another engine stores and
#             loads meanwhile: its jobs keep completing, the dead session ends, GPU memory returns
#   busy      engine B's load latency (p50/p99) with engine A idle, then running 50 ms steps that store
#   fatal     a sticky CUDA error (700) in the daemon's context: the daemon must exit 75
#   bench     kvstore bench --backend cuda, once, if time is left
# Logs: $OUT/<step>.log and summary.log (default OUT=./gpu-logs).
# Every check ends its log with "RESULT PASS|FAIL|SKIP ..."; summary.log has them all, with timings.
# Without a GPU the checks say "RESULT SKIP no CUDA GPU" and the script still runs through (a dry run on a
# machine where kvstore is installed already: SKIP_INSTALL=1 OUT=/tmp/x bash benchmarks/gpu_checks.sh).
#
# Missing pure-Python packages travel as wheels in .whl/ (made where pip works, e.g.:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 \
#     -d .whl grpcio==1.85.1 grpcio-health-checking==1.85.1 protobuf==7.35.1 pydantic pydantic-core \
#     pydantic-settings python-dotenv annotated-types typing-inspection redis==8.1.0
# with the versions pyproject.toml asks for); they are installed into /tmp/kvstore-site.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
T0=$SECONDS
SITE=""
if [ -z "${SKIP_INSTALL:-}" ] && compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kvstore-site \
    .whl/*.whl || exit 1
  SITE=/tmp/kvstore-site
fi
# PYTHONSAFEPATH: never import kvstore_service from the checkout (no native engine built there), always
# the installed one.
export PYTHONPATH="$PWD/tests${SITE:+:$SITE}" PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
summary() { echo "$*" | tee -a "$OUT/summary.log"; }
: > "$OUT/summary.log"

step() {  # step NAME LIMIT_S COMMAND...: run it, log to $OUT/NAME.log, note its RESULT line and time
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  local verdict
  verdict=$(grep -E "^RESULT " "$OUT/$name.log" | tail -1)
  [ "$rc" = 124 ] && verdict="RESULT FAIL timed out after ${limit}s"
  summary "$name: rc=$rc $((SECONDS - start))s ${verdict:-}"
}

if [ -z "${SKIP_INSTALL:-}" ]; then  # SKIP_INSTALL=1: a dry run where kvstore is installed (editable) already
  timeout 120 python3 -m pip install -q --no-deps --no-build-isolation ./client . > "$OUT/env.log" 2>&1 \
    || { summary "install failed (see env.log)"; tail -20 "$OUT/env.log"; exit 1; }
fi
summary "install: $((SECONDS - T0))s"
{ git rev-parse HEAD 2>/dev/null || echo "(no git)"
  nvidia-smi --query-gpu=name,driver_version,compute_mode,mig.mode.current,memory.used,memory.total \
    --format=csv,noheader 2>&1 || echo "no nvidia-smi"
  python3 -c "import torch; from kvstore_service import native; print(torch.__version__, native.features())"
  unshare --pid --fork --mount-proc true 2>&1 && echo "unshare --pid: permitted"
} >> "$OUT/env.log" 2>&1

start=$SECONDS
timeout -k 10 150 python3 -m pytest -q -p no:cacheprovider tests/device/test_device_backends.py tests/device/test_cuda_engines.py \
  tests/unit/test_native_copy.py tests/unit/test_device_ordering.py tests/device/test_cuda_backend.py > "$OUT/tests.log" 2>&1
summary "tests: rc=$? $((SECONDS - start))s $(tail -1 "$OUT/tests.log")"

step nonroot 60 python3 benchmarks/gpu_device_checks.py nonroot
step ipcpid 90 python3 benchmarks/gpu_device_checks.py ipcpid
step sigterm 60 python3 benchmarks/gpu_device_checks.py sigterm
step kernel 90 python3 benchmarks/gpu_device_checks.py kernel
step bigpool 180 python3 benchmarks/gpu_device_checks.py bigpool
step pidns 60 python3 benchmarks/gpu_device_checks.py pidns
step kill 75 python3 benchmarks/gpu_device_checks.py kill
step busy 75 python3 benchmarks/gpu_device_checks.py busy
step fatal 60 python3 benchmarks/gpu_device_checks.py fatal

if [ $((SECONDS - T0)) -lt 480 ]; then
  start=$SECONDS
  timeout -k 10 60 kvstore bench --backend cuda --rounds 5 > "$OUT/bench.log" 2>&1
  summary "bench: rc=$? $((SECONDS - start))s $(grep -E "vs_limit " "$OUT/bench.log" | tr '\n' ' ')"
else
  summary "bench: skipped, $((SECONDS - T0))s used already"
fi
summary "total: $((SECONDS - T0))s"
