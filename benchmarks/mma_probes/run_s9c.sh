#!/usr/bin/env bash
# Session 9, device call 4: output-count host cost; GPU span per chained call (tq4, tq3 PL); chained tq4+tq3.
python3 benchmarks/mma_probes/outputs_cost.py 2>&1 | grep -v Warn | tail -6
python3 benchmarks/mma_probes/chain_gaps.py 2>&1 | tail -8 | cut -c1-400
python3 benchmarks/mma_probes/chained_timing.py 2>&1 | tail -8 | python3 -c "
import sys, json
for l in sys.stdin:
    try: r = json.loads(l)
    except Exception: continue
    print(r['preset'], r['L'], 'sdpa', r['sdpa']['build'], r['sdpa']['eval'], 'wrapper', r['wrapper']['build'], r['wrapper']['eval'], r['wrapper']['x_sdpa'])"
