#!/usr/bin/env bash
# Session 11, device call 2: the loop split into constant-slot rounds (split.kernel) and 12-warp
# blocks (%w12: up to 168 registers, so no rematerialization), alone and with the pipelined loop.
python3 benchmarks/mma_probes/s11_variants.py
python3 benchmarks/mma_probes/pipelined_variant.py
K=kernels/tq_decode_mma.kernel S=.h200-mlx/scratch/split.kernel P=.h200-mlx/scratch/pipe.kernel
P12=s11a.json PRESETS=tq4,tq3,k8v4 timeout 400 python3 benchmarks/mma_probes/chained_timing.py \
    $S $S%w12 $K%w12 $P%w12 > /dev/null 2>&1
python3 benchmarks/mma_probes/summ.py $OUT/s11a.json
