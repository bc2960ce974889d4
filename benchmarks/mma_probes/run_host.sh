#!/usr/bin/env bash
# One device call: host-cost probe, then nsys NVTX/CUDA-API summaries of chained mma and SDPA at 4k.
set -x
python3 benchmarks/mma_probes/host_cost.py 2>&1 | tail -40
which nsys ncu; nvidia-smi --query-gpu=name,clocks.sm --format=csv
if command -v nsys >/dev/null; then
  for w in mma sdpa; do
    nsys profile -q --trace=nvtx,cuda,osrt --sample=none -o $OUT/nsys_$w -f true python3 benchmarks/mma_probes/nsys_chain.py $w
    nsys stats -q --report nvtx_sum,cuda_api_sum --format csv -o $OUT/stats_$w $OUT/nsys_$w.nsys-rep >/dev/null 2>&1
    ls $OUT
    rm -f $OUT/nsys_$w.sqlite
  done
fi
