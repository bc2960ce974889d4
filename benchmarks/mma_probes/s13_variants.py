# Session 13's probe kernel files (phases_s12.py KERNEL=...), written by the edits below into
# .h200-mlx/scratch/ (or argv[2]) from the kernel file argv[1]. Which source each run used:
# benchmarks/results/mma_phases_s13_128k.json says ("what"); e.g. for firsttile, finesetup and
# icache: `git show 6bab49d:kernels/tq_decode_mma.kernel > /tmp/k && python3 s13_variants.py /tmp/k`.
#   firsttile           waits for its first tiles before the tables (its "tables" stamp: their arrival)
#   finesetup           firsttile + stamps 11-14 through the rest of the set-up
#   icache              finesetup with the q' fragment reads run twice (stamp 15 between)
#   tiles_after_tables  the first tiles issued between the K table's loads and stores
#   tiles_after_q       the first tiles issued after q', before the barrier (16788a2 does this)
#   finetail            stamps 11-15 through the merges after the loop (sources from 16788a2 on)
#   tailcache           finetail with the warps' merge-buffer stores run twice (stamp 8 between)
import sys
from pathlib import Path

src = Path(sys.argv[1]).read_text()
out = Path(sys.argv[2] if len(sys.argv) > 2 else ".h200-mlx/scratch")
ISSUE = """TS_UNROLL for (int i = 0; i < STAGES - 1; i++) {
  if (kbeg + 16 * i < kend) issue(kbeg + 16 * i, i);
  ts_cp_commit();
}
"""


def ins(s: str, anchor: str, text: str) -> str:
    assert s.count(anchor) == 1, anchor
    return s.replace(anchor, text + anchor)


def sub(s: str, old: str, new: str) -> str:
    assert s.count(old) == 1, old[:60]
    return s.replace(old, new)


def write(name: str, s: str) -> None:
    (out / f"{name}.kernel").write_text(s)


if "// q' = Π_K q, one row per warp" in src and "qbuf[c * RP + r]" in src:  # before 16788a2
    first = ins(src, "// Tables, one column per lane", "ts_cp_wait<0>();  // probe: the first tiles landed (STAMP 1 follows)\n")
    write("firsttile", first)
    fine = ins(first, "// Score factor and causal limit", "STAMP(11);\n")
    fine = ins(fine, "// The loop's copies of whole tiles", "STAMP(12);\n")
    fine = ins(fine, "static_assert(M <= 16 * (STAGES - 1) + 1", "STAMP(13);\n")
    fine = ins(fine, "  ts_cp_wait<STAGES - 1>();\n", "  if (kb == kbeg) STAMP(14);\n")
    write("finesetup", fine)
    ic = sub(fine, "uint qb[RN][KSTEPS][2];\nTS_UNROLL for (int n = 0; n < RN; n++) {",
             "uint qb[RN][KSTEPS][2];\n#pragma unroll 1\nfor (int rep = 0; rep < 2; rep++) {\n"
             "if (rep == 1) STAMP(15);\nTS_UNROLL for (int n = 0; n < RN; n++) {")
    ic = sub(ic, "qbuf[(c + 3) * RP + r] * inv) : 0u;\n  }\n}\n", "qbuf[(c + 3) * RP + r] * inv) : 0u;\n  }\n}\n}\n")
    write("icache", ic)
else:
    base = sub(src, ISSUE, "")
    write("tiles_after_tables", ins(base, "  // Entry e of lane l at word e*32 + l, or e*64 + l under PL",
                                    ISSUE.replace("\n", "\n  ").rstrip(" ")))
    write("tiles_after_q", ins(base, "__syncthreads();\n// B fragments of Q'^T", ISSUE))
    tail = ins(src, "float* wbuf = (float*)smem;", "STAMP(11);\n")
    tail = ins(tail, "const size_t pbase = ", "STAMP(12);\n")
    tail = ins(tail, "__shared__ int is_last;", "STAMP(13);\n")
    tail = ins(tail, "// One warp per row (R <= 16", "STAMP(14);\n")
    tail = ins(tail, "  if (HAS_SINK) {\n    const float sink", "  STAMP(15);\n")
    write("finetail", tail)
    if "{\n  float* wo = wbuf + warp * WSTRIDE;" in tail:  # 16788a2 (stores after the barrier)
        write("tailcache", sub(tail, "{\n  float* wo = wbuf + warp * WSTRIDE;",
                               "#pragma unroll 1\nfor (int rep = 0; rep < 2; rep++) {\n"
                               "  if (rep == 1) { __syncthreads(); STAMP(8); }\n  float* wo = wbuf + warp * WSTRIDE;"))
