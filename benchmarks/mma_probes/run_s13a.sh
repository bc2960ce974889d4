#!/usr/bin/env bash
# Session 13, device call 1: the GPU test file (first: 165f7d4 came after session 12's last GPU
# run), then commit_s13.py under MLX's default commit limits and two tighter ones.
timeout 240 python3 -m pytest -m gpu -q tests/test_kernels_gpu.py -rA > $OUT/gpu_tests_h200.log 2>&1; tail -2 $OUT/gpu_tests_h200.log
grep -E "FAIL|Error" $OUT/gpu_tests_h200.log | head -5
timeout 100 python3 benchmarks/mma_probes/commit_s13.py 2>&1 | tail -1
MLX_MAX_MB_PER_BUFFER=100 timeout 100 python3 benchmarks/mma_probes/commit_s13.py 2>&1 | tail -1
MLX_MAX_OPS_PER_BUFFER=2 timeout 100 python3 benchmarks/mma_probes/commit_s13.py 2>&1 | tail -1
