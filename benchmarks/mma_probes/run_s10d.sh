#!/usr/bin/env bash
# Session 10, device call 6: the gemma-like shape (Hq 4, Hkv 1, D 256), where the final
# benchmark had tq4 slower than session 9: this kernel vs V2 off vs no __launch_bounds__.
S=.h200-mlx/scratch
K=kernels/tq_decode_mma.kernel
SHAPE=gemma P12=d_gemma.json PRESETS=tq4,tq3 timeout 170 python3 benchmarks/mma_probes/chained_timing.py $K $S/nov2.kernel "$K%nolb" 2>&1 | grep -iE "error|Trace" | head -5
echo elapsed $SECONDS; python3 benchmarks/mma_probes/summ.py $OUT/d_gemma.json
