#!/usr/bin/env bash
# Session 9, device call 2: ticket-view A/B, then tq3 at 8 vs 16 warps per block.
python3 benchmarks/mma_probes/ticket_ab.py 2>&1 | grep -v Warn | tail -5
PRESETS=tq3 python3 benchmarks/mma_probes/chained_timing.py kernels/tq_decode_mma.kernel kernels/tq_decode_mma.kernel%w16 2>&1 | tail -5
