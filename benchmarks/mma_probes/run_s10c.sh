#!/usr/bin/env bash
# Session 10, device call 4: the whole GPU test file (log to $OUT), then chained timings of
# this tree's kernel against call 2's (c2: before the copy registers and the shared softmax
# votes) and a variant with four score accumulators (sc4), interleaved in each process.
S=.h200-mlx/scratch
K=kernels/tq_decode_mma.kernel
timeout 250 python3 -m pytest -m gpu -q tests/test_kernels_gpu.py -rA 2>&1 > $OUT/gpu_tests_h200.log; tail -3 $OUT/gpu_tests_h200.log
grep -E "FAIL|Error" $OUT/gpu_tests_h200.log | head -5
for r in 1 2; do
  [ $r = 2 ] && [ $SECONDS -gt 420 ] && break
  P12=c_$r.json PRESETS=tq4,tq3,k8v4 timeout 170 python3 benchmarks/mma_probes/chained_timing.py $K $S/c2.kernel $S/sc4.kernel > /dev/null 2>&1
done
echo elapsed $SECONDS; python3 benchmarks/mma_probes/summ.py $OUT/c_*.json
