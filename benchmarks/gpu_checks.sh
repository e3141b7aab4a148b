#!/usr/bin/env bash
# The GPU checks of docs/devices.md in one go, for a GPU machine that has torch (a CUDA build) and no
# internet: install this checkout against that torch, run the GPU tests, the native copy benchmark and
# `kvstore bench --backend cuda` three times. Logs go to $OUT (default ./gpu-logs).
#
# Missing pure-Python packages travel as wheels in .whl/ (made where pip works, e.g.:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 \
#     -d .whl grpcio==1.85.1 grpcio-health-checking==1.85.1 protobuf==7.35.1 pydantic pydantic-core \
#     pydantic-settings python-dotenv annotated-types typing-inspection redis==8.1.0
# with the versions pyproject.toml asks for).
set -o pipefail
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kvstore-site \
    .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/kvstore-site
fi
python3 -m pip install -q --no-deps --no-build-isolation ./client . || exit 1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
 python3 -c "import torch; from kvstore_service import native; print(torch.__version__, native.features())"
) | tee "$OUT/tests.log"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_device_backends.py tests/test_cuda_backend.py \
  tests/test_cuda_engines.py tests/test_native_copy.py tests/test_core.py 2>&1 | tee -a "$OUT/tests.log" | tail -8
timeout 150 python3 benchmarks/bench_cuda_copy.py --rounds 5 2>&1 | tee "$OUT/copy.log"
for i in 1 2 3; do
  timeout 120 kvstore bench --backend cuda --rounds 5 2>&1 | tee "$OUT/bench-$i.log" | grep -E "vs_limit |rror"
done
