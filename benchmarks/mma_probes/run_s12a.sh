#!/usr/bin/env bash
# Session 12, device call 1: SM clocks while the probes run; per-call GPU phases of the current
# kernel in a chained eval (chain_gaps.py: stamped kernel); the Python build of one call.
nvidia-smi --query-gpu=clocks.sm,clocks.mem,clocks.max.sm,power.draw,temperature.gpu --format=csv -lms 100 > $OUT/clocks.csv &
SMI=$!
python3 benchmarks/mma_probes/chain_gaps.py 2>&1 | tail -20
python3 benchmarks/mma_probes/host_s12.py 2>&1 | tail -3
kill $SMI
python3 - $OUT/clocks.csv <<'PY'
import sys, collections
rows = [l.strip().split(", ") for l in open(sys.argv[1])][1:]
c = collections.Counter(r[0] for r in rows)
print("sm clock samples:", c.most_common(8), "of", len(rows))
PY
