#!/usr/bin/env bash
# Session 13, device call 3: tq3 with a third ring slot (MMA_RING_BYTES 80 KB: 3 slots at tq3,
# still 2 at tq4), chained against the wrapper and SDPA, three interleaved rounds.
P12=ring.json PRESETS=tq3,tq4 ROUNDS=3 timeout 300 python3 benchmarks/mma_probes/chained_timing.py \
  kernels/tq_decode_mma.kernel kernels/tq_decode_mma.kernel@80 > /dev/null 2>&1
python3 benchmarks/mma_probes/summ.py $OUT/ring.json
python3 - $OUT/ring.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r["preset"], r["L"], {k: (r[k]["build"], r[k]["eval"], r[k]["evals"]) for k in r if isinstance(r[k], dict) and "evals" in r[k]})
PY
