#!/usr/bin/env bash
# Session 10, device call 1: the mma GPU tests, then chained timings of this tree's wrapper
# against session 9's (a copy of its tree in .h200-mlx/scratch/head), in alternating
# processes; in this tree's processes also the kernel with V2 off and with the softmax skip off.
S=.h200-mlx/scratch
timeout 200 python3 -m pytest -m gpu -q tests/test_kernels_gpu.py -rA -k mma -s 2>&1 | tee $OUT/gpu_mma.log | grep -E "rel L2|FAIL|Error|passed|failed" | tail -22
for r in 1 2; do
  [ $r = 2 ] && [ $SECONDS -gt 330 ] && break  # a second round only if the first left time
  (cd $S/head && PYTHONPATH=/tmp/site:$PWD P12=head$r.json PRESETS=tq4,tq3,k8v4 timeout 120 python3 benchmarks/mma_probes/chained_timing.py > /dev/null 2>&1)
  P12=new$r.json PRESETS=tq4,tq3,k8v4 timeout 200 python3 benchmarks/mma_probes/chained_timing.py $S/nov2.kernel $S/noskip.kernel > /dev/null 2>&1
done
echo elapsed $SECONDS; python3 benchmarks/mma_probes/summ.py $OUT/head*.json $OUT/new*.json
