#!/usr/bin/env bash
# Session 11, device call 6: 16-word V rows swizzled instead of padded. GPU tests of the tensor-core
# kernel, the aligned-ring kernel (aligned.kernel) vs this one chained in one process (5 rounds),
# then this kernel's shared wavefronts per instruction under ncu (tq4 at 128k keys).
timeout 250 python3 -m pytest -m gpu -q tests/test_kernels_gpu.py -k mma 2>&1 | tail -3 | cut -c1-200
O=.h200-mlx/scratch/aligned.kernel N=kernels/tq_decode_mma.kernel
P12=s11e.json ROUNDS=5 PRESETS=tq4,k8v4,tq3 timeout 300 python3 benchmarks/mma_probes/chained_timing.py \
    $O $N > /dev/null 2>&1
python3 benchmarks/mma_probes/summ.py $OUT/s11e.json
T=benchmarks/mma_probes/ncu_s11.py
timeout 150 ncu -k regex:tq_decode_mma --launch-skip 1 --launch-count 1 --section SpeedOfLight --section SourceCounters \
    -o $OUT/tq4v python3 $T > /dev/null 2>&1
ncu --import $OUT/tq4v.ncu-rep --page details 2>/dev/null | grep -E "Duration|Elapsed Cycles|L1/TEX Cache|excessive" | cut -c1-150
ncu --import $OUT/tq4v.ncu-rep --page source --csv --print-source sass > $OUT/srcv.csv 2>/dev/null
rm -f $OUT/tq4v.ncu-rep
