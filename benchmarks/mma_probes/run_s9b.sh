#!/usr/bin/env bash
# Session 9, device call 3: mma GPU tests (2/3-bit PL lookups), then tq3 chained: PL (wrapper) vs nopl.
python3 -m pytest -m gpu -q tests/test_kernels_gpu.py -rA -k "mma" -s 2>&1 | grep -E "rel L2|PASS|FAIL|Error|error|passed|failed" | tail -40
PRESETS=tq3 python3 benchmarks/mma_probes/chained_timing.py "kernels/tq_decode_mma.kernel%nopl" 2>&1 | tail -4
python3 benchmarks/mma_probes/ticket_ab.py 2>&1 | grep -v Warn | tail -4
