#!/usr/bin/env bash
# Session 13, device call 11: the warps' merge buffers written as each warp's loop ends (below
# the PL table). The mma GPU tests, then phase stamps.
timeout 200 python3 -m pytest -m gpu -q tests/test_kernels_gpu.py -rA -k "mma or decode" 2>&1 | tee $OUT/gpu_mma.log | grep -E "FAIL|Error|passed|failed" | tail -8
timeout 60 python3 benchmarks/mma_probes/phases_s12.py 2>&1 | tail -2 | cut -c1-420
