#!/usr/bin/env bash
# Session 11, device call 4: every kernel's duration under ncu (tq4, tq3 tq_decode_mma and FP16
# SDPA at 128k keys), then issue and shared-memory pipe use and stall reasons of tq4.
T=benchmarks/mma_probes/ncu_s11.py
timeout 200 ncu --section SpeedOfLight -o $OUT/all python3 $T > /dev/null 2>&1
ncu --import $OUT/all.ncu-rep --page details --csv 2>/dev/null > $OUT/all.csv
python3 - "$OUT/all.csv" <<'PY'
import csv, sys
for r in csv.DictReader(open(sys.argv[1])):
    if r["Metric Name"] in ("Duration", "Memory Throughput", "Compute (SM) Throughput"):
        print(r["ID"], r["Kernel Name"][:60], r["Metric Name"], r["Metric Unit"], r["Metric Value"])
PY
timeout 200 ncu -k regex:tq_decode_mma --launch-skip 1 --launch-count 1 --section WarpStateStats --section SchedulerStats \
    --section ComputeWorkloadAnalysis --section SourceCounters --section SpeedOfLight -o $OUT/tq4 python3 $T > /dev/null 2>&1
ncu --import $OUT/tq4.ncu-rep --page details 2>/dev/null | grep -v "^ *-" | cut -c1-150 | head -120
ncu --import $OUT/tq4.ncu-rep --page source --csv --print-source sass > $OUT/src.csv 2>/dev/null
python3 benchmarks/mma_probes/ncu_source_summary.py $OUT/src.csv | cut -c1-900
