#!/usr/bin/env bash
# Session 11, device call 5: tile rings 128-byte aligned. GPU tests of the tensor-core kernel,
# the previous kernel file (split_head.kernel) vs the new one chained in one process (5 rounds),
# then the new kernel's shared wavefronts and duration under ncu (tq4 at 128k keys).
timeout 250 python3 -m pytest -m gpu -q tests/test_kernels_gpu.py -k mma 2>&1 | tail -3 | cut -c1-200
O=.h200-mlx/scratch/split_head.kernel N=kernels/tq_decode_mma.kernel
P12=s11d.json ROUNDS=5 PRESETS=tq4,tq3,k8v4 timeout 300 python3 benchmarks/mma_probes/chained_timing.py \
    $O $N > /dev/null 2>&1
python3 benchmarks/mma_probes/summ.py $OUT/s11d.json
T=benchmarks/mma_probes/ncu_s11.py
timeout 150 ncu -k regex:tq_decode_mma --launch-skip 1 --launch-count 1 --section SpeedOfLight --section SourceCounters \
    --section SchedulerStats -o $OUT/tq4a python3 $T > /dev/null 2>&1
ncu --import $OUT/tq4a.ncu-rep --page details 2>/dev/null | grep -E "Duration|Elapsed Cycles|SM Frequency|L1/TEX Cache|Issued Warp|excessive|Compute \(SM\)" | cut -c1-150
