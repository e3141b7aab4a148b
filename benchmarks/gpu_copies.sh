#!/usr/bin/env bash
# Issue 38's GPU measurements, after benchmarks/gpu_checks.sh installed kvstore on the GPU machine (about
# four minutes). From the repository root:  OUT=/some/dir bash benchmarks/gpu_copies.sh
#   cpu-bench  kvstore bench --backend cpu on the GPU machine's host cores: the CPU targets where the daemon's
#              loop has a core of its own (the 2-vCPU VM shares its two with both copy threads)
#   timeline   each job's timeline in the daemon beside what the client saw and the pinned copy's time
#              (benchmarks/bench_timeline.py): 2048 x 256 KiB stores and loads, a 2048-token hit and a
#              256-token hit of a vLLM-sized layout
#   ab-*       bench_copy_ab.py --backend cuda, interleaved rounds: the copy kernel
#              (KVSTORE_CUDA_COPY_KERNEL=1, csrc/copy_kernel.cu) against the copy engines, for bulk stores
#              and loads (256 KiB runs) and for vLLM-sized hits of 16 and 128 blocks (32 KiB runs: the
#              copy engines moved those at 0.3-0.5 of a contiguous copy), and gpu_checks.sh's busy check
#              with the kernel (what it costs an engine's steps beside it); then loads with the checksum
#              sample vs not verified (KVSTORE_VERIFY_LOADS=0), and the job's cut (chunks.py) as is vs
#              chunks capped at 16 MiB (2026-11-27 on an H100: 4 copy threads, 4 streams per copy, 16 MiB
#              first chunks and a tail of 64 MiB chunks were each worse)
# Logs: $OUT/cpu-bench.log, $OUT/timeline.log, $OUT/ab.log.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
SITE=""
[ -d /tmp/kvstore-site ] && SITE=/tmp/kvstore-site
export PYTHONPATH="$PWD/tests${SITE:+:$SITE}" PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
T0=$SECONDS
timeout -k 10 75 kvstore bench --backend cpu --rounds 5 > "$OUT/cpu-bench.log" 2>&1
echo "cpu-bench: rc=$? $((SECONDS - T0))s $(grep -E "(store|load|store_sustained)_vs_copy_engine " "$OUT/cpu-bench.log" | tr -s ' ' | tr '\n' ' ')" | tee -a "$OUT/ab.log"
timeout -k 10 90 python3 benchmarks/bench_timeline.py --backend cuda --rounds 4 > "$OUT/timeline.log" 2>&1
echo "timeline: rc=$? $((SECONDS - T0))s" | tee -a "$OUT/ab.log"

# The job's cut, varied in a copy of the installed package (its native module included).
PKG=$(python3 -c "import kvstore_service, os; print(os.path.dirname(kvstore_service.__file__))")
variant() {  # variant NAME SED-EXPRESSION: /tmp/kvstore-NAME/kvstore_service with chunks.py edited
  rm -rf "/tmp/kvstore-$1" && mkdir -p "/tmp/kvstore-$1" && cp -r "$PKG" "/tmp/kvstore-$1/" &&
    sed -i "$2" "/tmp/kvstore-$1/kvstore_service/chunks.py" && grep -c "$3" "/tmp/kvstore-$1/kvstore_service/chunks.py"
}
variant cap16 's/^CHUNK_BYTES = 64 << 20/CHUNK_BYTES = 16 << 20/' "^CHUNK_BYTES = 16 << 20"

for v in cap16; do  # the variants the daemons will import
  PYTHONPATH="/tmp/kvstore-$v:$PYTHONPATH" python3 -c "import kvstore_service.chunks as c
print('$v', c.__file__, c.FIRST_CHUNK_BYTES >> 20, c.CHUNK_BYTES >> 20, c.TAIL_CHUNK_BYTES >> 20)" >> "$OUT/ab.log" 2>&1
done

ab() {  # ab WHAT MODES ARGS...: each mode (store, load, hit) in turn
  for mode in $2; do
    echo "== $1 ($mode)" >> "$OUT/ab.log"
    timeout -k 10 60 python3 benchmarks/bench_copy_ab.py "$mode" --backend cuda --rounds 8 "${@:3}" >> "$OUT/ab.log" 2>&1
    echo "rc=$? at $((SECONDS - T0))s" >> "$OUT/ab.log"
  done
}
ab "copy engines vs the copy kernel" "store load" --b-env KVSTORE_CUDA_COPY_KERNEL=1
ab "copy engines vs the copy kernel, 16-block hits" hit --b-env KVSTORE_CUDA_COPY_KERNEL=1 --rounds 20
ab "copy engines vs the copy kernel, 128-block hits" hit --b-env KVSTORE_CUDA_COPY_KERNEL=1 --hit-blocks 128 --rounds 12
# What the kernel costs an engine beside it (time-sliced with its kernels without MPS): gpu_checks.sh's busy
# check again, the daemon copying with the kernel; compare the stepper's steps and B's loads with busy.log.
echo "== busy check, the daemon copying with the copy kernel" >> "$OUT/ab.log"
KVSTORE_CUDA_COPY_KERNEL=1 timeout -k 10 75 python3 benchmarks/gpu_device_checks.py busy >> "$OUT/ab.log" 2>&1
echo "rc=$? at $((SECONDS - T0))s" >> "$OUT/ab.log"
ab "loads verified vs not" load --b-env KVSTORE_VERIFY_LOADS=0
ab "chunks capped at 64 vs 16 MiB" "store load" --b-env "PYTHONPATH=/tmp/kvstore-cap16:$PYTHONPATH"
echo "total: $((SECONDS - T0))s" >> "$OUT/ab.log"
cat "$OUT/ab.log"
