#!/usr/bin/env bash
# Session 10, device call 3: warps per block (16 vs 8, now that the build states its block
# size to ptxas) and ring slots, chained, per preset; each file as the wrapper would build it.
K=kernels/tq_decode_mma.kernel
for r in 1 2; do
  [ $r = 2 ] && [ $SECONDS -gt 280 ] && break
  P12=b_tq4_$r.json PRESETS=tq4 timeout 150 python3 benchmarks/mma_probes/chained_timing.py $K "$K%w8" "$K@80%w8" > /dev/null 2>&1
  P12=b_tq3_$r.json PRESETS=tq3 timeout 150 python3 benchmarks/mma_probes/chained_timing.py $K "$K@84" "$K%w8" > /dev/null 2>&1
  P12=b_k8v4_$r.json PRESETS=k8v4 timeout 150 python3 benchmarks/mma_probes/chained_timing.py $K "$K@84" > /dev/null 2>&1
done
echo elapsed $SECONDS; python3 benchmarks/mma_probes/summ.py $OUT/b_*.json
