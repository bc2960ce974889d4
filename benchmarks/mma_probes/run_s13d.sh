#!/usr/bin/env bash
# Session 13, device call 4: when do a warp's first tiles land? Phase stamps of the current
# kernel, then of a copy that waits for its first tiles right after issuing them (its
# "tables" stamp is then their arrival; written by hand into .h200-mlx/scratch/firsttile.kernel:
# one `ts_cp_wait<0>();` before "// Tables, one column per lane").
timeout 100 python3 benchmarks/mma_probes/phases_s12.py 2>&1 | tail -2 | cut -c1-600
KERNEL=.h200-mlx/scratch/firsttile.kernel timeout 100 python3 benchmarks/mma_probes/phases_s12.py 2>&1 | tail -2 | cut -c1-600
