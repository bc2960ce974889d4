#!/usr/bin/env bash
# Session 11, device call 3: the GPU tests of the tensor-core kernel (split loop, unmasked fast
# rounds), then old vs new kernel files chained in one process, 5 interleaved rounds.
timeout 250 python3 -m pytest -m gpu -q tests/test_kernels_gpu.py -k mma -rA 2>&1 | tail -25 | cut -c1-200
O=.h200-mlx/scratch/old.kernel N=kernels/tq_decode_mma.kernel
P12=s11b.json ROUNDS=5 PRESETS=tq4,tq3,k8v4 timeout 300 python3 benchmarks/mma_probes/chained_timing.py \
    $O $N $N%w12 > /dev/null 2>&1
python3 benchmarks/mma_probes/summ.py $OUT/s11b.json
