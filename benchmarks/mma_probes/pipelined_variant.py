"""Writes a software-pipelined tq_decode_mma variant next to the probes' scratch files
(.h200-mlx/scratch/pipe.kernel) from session 10's kernel (variant_base.py). Run on the H200 in
session 11 (mma_probe_s11_pipe.json, at 12 warps mma_probe_s11_variants.json): outputs equal to
the wrapper's, speed within noise of the plain loop; not kept.

Why: session 10 removed instructions per tile without a measurable change at 128k, and 8 warps
with more registers were slower than 16, which points at latency per warp. Here each warp keeps
two tiles in hand: tile i+1's tile read, lookups and score mmas are issued before tile i's
softmax and weighted-V product (the mma results are consumed an iteration later), in a loop
unrolled by two so the tiles alternate between two register sets without copies.

    python benchmarks/mma_probes/pipelined_variant.py
    python benchmarks/mma_probes/sass_count.py 4 4 --kernel .h200-mlx/scratch/pipe.kernel
    # on the H200: correctness (max error vs the wrapper, printed as errs) and speed
    python3 benchmarks/mma_probes/chained_timing.py .h200-mlx/scratch/pipe.kernel
"""

from variant_base import ROOT as root, base_source, main_loop

src = base_source()

a, b, loop = main_loop(src)

# Pieces of the current loop body, reused verbatim.
ahead_line = "  const int ahead = kb + 16 * (STAGES - 1);\n"
refill_body = loop[loop.index(ahead_line) + len(ahead_line) : loop.index("  ts_cp_commit();\n")]
score_start = loop.index("  float sc[RN][4], sc2[RN][4];")
score_end = loop.index("  TS_UNROLL for (int n = 0; n < RN; n++) {\n    TS_UNROLL for (int e = 0; e < 4; e++) sc[n][e] += sc2[n][e];")
score_body = loop[score_start:score_end].replace("  float sc[RN][4], sc2[RN][4];\n", "")
finish_start = loop.index("  // Online softmax per row;")
finish_body = loop[finish_start : loop.rindex("}")]

new_loop = (
    "int slot = 0, fill = STAGES - 1;  // the slot read next, the slot refilled next\n"
    "// Refill `fill` with the tile at `ahead` (its slot was read: every lane is past it).\n"
    "auto refill = [&](const int ahead) {\n"
    + refill_body
    + "  ts_cp_commit();\n};\n"
    "// Read the next tile of the ring and issue its score mmas into (sc, sc2), summed by `finish`:\n"
    "// their latency runs under the previous tile's softmax and weighted-V product.\n"
    "auto fetch = [&](Tile& cur, float (&sc)[RN][4], float (&sc2)[RN][4]) {\n"
    "  ts_cp_wait<STAGES - 1>();\n  __syncwarp();\n  read_tile(slot, cur);\n  __syncwarp();\n"
    "  slot = (slot + 1 == STAGES) ? 0 : slot + 1;\n"
    + score_body
    + "};\n"
    "auto finish = [&](const Tile& cur, float (&sc)[RN][4], const float (&sc2)[RN][4], const int kb) {\n"
    "  TS_UNROLL for (int n = 0; n < RN; n++) {\n    TS_UNROLL for (int e = 0; e < 4; e++) sc[n][e] += sc2[n][e];\n  }\n"
    + finish_body
    + "};\n"
    "// Two tiles in hand: A and B alternate, so no register copies between iterations. A fetch\n"
    "// past kend reads a stale slot (its scores are never used; its refill group is empty).\n"
    "Tile ta, tb;\n"
    "float sa[RN][4], sa2[RN][4], sb[RN][4], sb2[RN][4];\n"
    "refill(kbeg + 16 * (STAGES - 1));\n"
    "fetch(ta, sa, sa2);\n"
    "for (int kb = kbeg; kb < kend; kb += 32) {\n"
    "  refill(kb + 16 * STAGES);\n"
    "  fetch(tb, sb, sb2);\n"
    "  finish(ta, sa, sa2, kb);\n"
    "  if (kb + 16 >= kend) break;\n"
    "  refill(kb + 16 * (STAGES + 1));\n"
    "  fetch(ta, sa, sa2);\n"
    "  finish(tb, sb, sb2, kb + 16);\n"
    "}\n"
)
out = src[:a] + new_loop + src[b:]
dst = root / ".h200-mlx" / "scratch" / "pipe.kernel"
dst.parent.mkdir(parents=True, exist_ok=True)
dst.write_text(out)
print("wrote", dst)
