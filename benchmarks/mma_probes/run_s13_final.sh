#!/usr/bin/env bash
# Session 13 final device call (as session 12's): the decode benchmark (with its paired rounds), then the whole GPU
# test file, on the final code.
mkdir -p $OUT/b
timeout 260 python3 benchmarks/decode_attention.py --out $OUT/b 2>&1 | grep -v Warn | tail -3 | cut -c1-300
timeout 230 python3 -m pytest -m gpu -q tests/test_kernels_gpu.py -rA 2>&1 > $OUT/gpu_tests_h200.log; tail -2 $OUT/gpu_tests_h200.log
grep -E "FAIL|Error" $OUT/gpu_tests_h200.log | head -5
