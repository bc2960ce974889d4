#!/usr/bin/env bash
# Prepared in session 10 (no device time was left to run it): one device call for the next
# session. 1) Nsight Compute stall reasons of the current tq4 kernel at 128k (the third 128k
# launch of ncu_target.py), summarized per opcode and reason; 2) the software-pipelined variant
# (pipelined_variant.py, WIP: compiled, never run) against the current kernel, chained, with its
# max error against the wrapper in each row's "errs" (must be ~1e-3 or less to mean anything).
python3 benchmarks/mma_probes/pipelined_variant.py
timeout 200 ncu -k regex:tq_decode_mma --launch-skip 4 --launch-count 1 --section WarpStateStats \
    --section SourceCounters --section SchedulerStats -o $OUT/r128 python3 benchmarks/mma_probes/ncu_target.py > /dev/null 2>&1
ncu --import $OUT/r128.ncu-rep --page source --csv --print-source sass > $OUT/src128.csv 2>/dev/null
python3 benchmarks/mma_probes/ncu_source_summary.py $OUT/src128.csv | cut -c1-900
P12=pipe.json PRESETS=tq4,tq3,k8v4 timeout 200 python3 benchmarks/mma_probes/chained_timing.py .h200-mlx/scratch/pipe.kernel > /dev/null 2>&1
python3 benchmarks/mma_probes/summ.py $OUT/pipe.json
