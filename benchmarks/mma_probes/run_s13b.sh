#!/usr/bin/env bash
# Session 13, device call 2: the codes as byte views (MLX counts graph inputs in elements).
# The mma GPU tests, then this tree against the last commit (a copy in .h200-mlx/scratch/head)
# in alternating processes (ab_s12.py), then commit_s13.py on this tree.
S=.h200-mlx/scratch
timeout 200 python3 -m pytest -m gpu -q tests/test_kernels_gpu.py -rA -k "mma or decode" 2>&1 | tee $OUT/gpu_mma.log | grep -E "FAIL|Error|passed|failed" | tail -8
for r in 1 2; do
  (cd $S/head && PYTHONPATH=/tmp/site:$PWD P12=head$r.json timeout 100 python3 ../../../benchmarks/mma_probes/ab_s12.py > /dev/null 2>&1)
  P12=new$r.json timeout 100 python3 benchmarks/mma_probes/ab_s12.py > /dev/null 2>&1
done
python3 - $OUT <<'PY'
import json, sys, glob, os
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    for r in json.load(open(f)):
        print(os.path.basename(f), r["preset"], r["L"], "sdpa", r["sdpa"]["build"], r["sdpa"]["eval"], "tq", r["tq"]["build"], r["tq"]["eval"], "x", r["x_sdpa"])
PY
timeout 100 python3 benchmarks/mma_probes/commit_s13.py 2>&1 | tail -1
