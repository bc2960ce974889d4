#!/usr/bin/env bash
# Prepared in session 12 for the next device call (not run yet): the four chunk variants of
# chunks_variant.py against the current kernel, chained (x SDPA, with each variant's max error
# against the wrapper), then their phase stamps at 128k. Tells whether the chunked loop lost its
# time to the counter's atomic (chunks_static as fast as the current kernel) or to the order it
# reads memory in (chunks_static as slow as chunks_inc); chunks_tail is the candidate to keep if
# the counter is cheap enough when only the last eighth of the keys comes from it.
S=.h200-mlx/scratch
python3 benchmarks/mma_probes/chunks_variant.py $S > /dev/null
P12=chunks.json PRESETS=tq4,tq3 ROUNDS=2 timeout 400 python3 benchmarks/mma_probes/chained_timing.py \
  kernels/tq_decode_mma.kernel $S/chunks_inc.kernel $S/chunks_ahead2.kernel $S/chunks_static.kernel $S/chunks_tail.kernel > /dev/null 2>&1
python3 benchmarks/mma_probes/summ.py $OUT/chunks.json
for v in chunks_inc chunks_ahead2 chunks_static chunks_tail; do
  KERNEL=$S/$v.kernel timeout 60 python3 benchmarks/mma_probes/phases_s12.py 2>&1 | tail -2 | cut -c1-400
done
