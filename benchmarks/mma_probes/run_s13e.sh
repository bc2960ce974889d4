#!/usr/bin/env bash
# Session 13, device call 7: q' stored as B fragments (one 16-byte load per two k-steps) and the
# row factors computed once. The mma GPU tests; phase stamps of this kernel and of two copies that
# issue the first tiles later (after the K table's loads; after q'); then this tree against the
# last commit (.h200-mlx/scratch/head) in alternating processes (ab_s12.py).
S=.h200-mlx/scratch
timeout 200 python3 -m pytest -m gpu -q tests/test_kernels_gpu.py -rA -k "mma or decode" 2>&1 | tee $OUT/gpu_mma.log | grep -E "FAIL|Error|passed|failed" | tail -8
for k in kernels/tq_decode_mma.kernel $S/tiles_after_tables.kernel $S/tiles_after_q.kernel; do
  KERNEL=$k timeout 60 python3 benchmarks/mma_probes/phases_s12.py 2>&1 | tail -2 | cut -c1-330
done
for r in 1 2; do
  (cd $S/head && PYTHONPATH=/tmp/site:$PWD P12=head$r.json timeout 100 python3 ../../../benchmarks/mma_probes/ab_s12.py > /dev/null 2>&1)
  P12=new$r.json timeout 100 python3 benchmarks/mma_probes/ab_s12.py > /dev/null 2>&1
done
python3 - $OUT <<'PY'
import json, sys, glob, os
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    if "phases" in f: continue
    for r in json.load(open(f)):
        print(os.path.basename(f), r["preset"], r["L"], "sdpa", r["sdpa"]["build"], r["sdpa"]["eval"], "tq", r["tq"]["build"], r["tq"]["eval"], "x", r["x_sdpa"])
PY
