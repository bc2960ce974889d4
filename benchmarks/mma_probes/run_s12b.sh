#!/usr/bin/env bash
# Session 12, device call 2: the chained timeline at 128k and 32k, then with MLX committing a
# CUDA graph per call (MLX_MAX_OPS_PER_BUFFER=1), to see what the graph batching costs.
python3 benchmarks/mma_probes/chain_timeline.py 2>&1 | tail -20
L=32768 python3 benchmarks/mma_probes/chain_timeline.py 2>&1 | tail -20
echo "--- MLX_MAX_OPS_PER_BUFFER=1"
MLX_MAX_OPS_PER_BUFFER=1 python3 benchmarks/mma_probes/chain_timeline.py 2>&1 | tail -20
