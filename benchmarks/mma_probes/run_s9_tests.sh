#!/usr/bin/env bash
# Session 9: the whole GPU test file (log to $OUT), then k8v4 chained: PL (wrapper) vs nopl.
python3 -m pytest -m gpu -q tests/test_kernels_gpu.py -rA 2>&1 | tee $OUT/gpu_tests_h200.log | grep -E "FAIL|Error|passed|failed" | tail -15
PRESETS=k8v4 python3 benchmarks/mma_probes/chained_timing.py "kernels/tq_decode_mma.kernel%nopl" 2>&1 | tail -4 | cut -c1-700
