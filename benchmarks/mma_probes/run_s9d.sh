#!/usr/bin/env bash
# Session 9, device call 5: mma GPU tests (two-table PL), then k8v4 chained: PL (wrapper) vs nopl.
python3 -m pytest -m gpu -q tests/test_kernels_gpu.py -rA -k "mma" -s 2>&1 | grep -E "rel L2|FAIL|Error|error|passed|failed" | tail -25
PRESETS=k8v4 python3 benchmarks/mma_probes/chained_timing.py "kernels/tq_decode_mma.kernel%nopl" 2>&1 | tail -4 | cut -c1-600
