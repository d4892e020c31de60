#!/usr/bin/env bash
# One device call for the tests that need a GPU: tests/gpu (Q3TTS_GPU_TESTS=1: the graph-captured fast path and its
# numerics) and tests/kernels on CUDA (every Triton kernel compiled and run against its PyTorch twin, where CI runs
# them in Triton's interpreter). Carry .gpuwhl (pytest) and .benchwhl (the server's packages: without them the
# server's GPU test is skipped).
#   COMMIT=<short hash> bash bench/gpu_tests.sh          (OUT=$OUT on the device machine)
# Knobs: GPU_TESTS_S=480 KERNEL_TESTS_S=300, GPU_TESTS_ARGS (more pytest arguments, split at spaces: -x, say), KERNELS=1 (0:
# tests/gpu alone).
WHEEL_DIRS=$(ls -d .gpuwhl .benchwhl 2>/dev/null | tr '\n' ' ') source "$(dirname "$0")/device_call.sh" /tmp/gpu_tests \
  gpu_tests.txt
log "commit ${COMMIT:-?}: GPU tests"
PYTHONPATH=/tmp/site:$PWD Q3TTS_GPU_TESTS=1 timeout ${GPU_TESTS_S:-480} python3 -m pytest -q -p no:cacheprovider \
  tests/gpu -rs --durations=0 ${GPU_TESTS_ARGS:-} 2>&1 | tail -40
if [ "${KERNELS:-1}" = 1 ]; then
  log "kernel tests on CUDA"
  PYTHONPATH=/tmp/site:$PWD timeout ${KERNEL_TESTS_S:-300} python3 -m pytest -q -p no:cacheprovider tests/kernels -rs \
    --durations=10 2>&1 | tail -40
fi
log "done"
