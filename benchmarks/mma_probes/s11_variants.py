"""Session 11 variant kernel files (.h200-mlx/scratch/), made from session 10's kernel (variant_base.py):

split.kernel: the loop body as a lambda `step(kb, slot, fill, fast)`; whole rounds of STAGES
tiles whose refills are all 16-byte copies run with constant ring slots (unrolled by STAGES),
the rest (last tiles, unaligned rows) slot by slot. ncu at 128k (session 11): the loop
recomputed vec16 from six kernel parameters (LDC) and the slots' addresses every tile, ~35 of
its ~290 instructions, as ptxas rematerializes them at 128 registers.

    python benchmarks/mma_probes/s11_variants.py
"""

from variant_base import ROOT as root, base_source, main_loop

src = base_source()
a, b, loop = main_loop(src)
head = "for (int kb = kbeg; kb < kend; kb += 16) {\n"
body = loop[loop.index(head) + len(head) : loop.rindex("}")]
for old, new in [
    ("  if (vec16 && ahead + 16 <= end && ahead < kend) {", "  if (fast) {"),
    ("  fill = (fill + 1 == STAGES) ? 0 : fill + 1;\n", ""),
    ("  slot = (slot + 1 == STAGES) ? 0 : slot + 1;\n", ""),
]:
    assert old in body, old
    body = body.replace(old, new)
new_loop = (
    "// One tile: refill slot `fill` with the tile STAGES - 1 ahead (`fast`: a whole tile of\n"
    "// 16-byte copies), then read slot `slot` and work on it.\n"
    "auto step = [&](const int kb, const int slot, const int fill, const bool fast) {\n"
    + body
    + "};\n"
    "// Whole rounds of STAGES tiles whose refills are all fast run with constant slots: ptxas\n"
    "// otherwise recomputes vec16 (six parameters) and the slots' addresses every tile.\n"
    "int kb = kbeg;\n"
    "if (vec16) {\n"
    "  const int lim = (kend - 1 < end - 16) ? kend - 1 : end - 16;  // a refill is fast for ahead <= lim\n"
    "  const int last = lim - 32 * (STAGES - 1);  // ... for every tile of a round from kb <= last\n"
    "  for (; kb <= last; kb += 16 * STAGES) {\n"
    "    TS_UNROLL for (int s = 0; s < STAGES; s++) step(kb + 16 * s, s, (s + STAGES - 1) % STAGES, true);\n"
    "  }\n"
    "}\n"
    "for (int slot = (kb - kbeg) / 16 % STAGES; kb < kend; kb += 16) {\n"
    "  step(kb, slot, (slot == 0) ? STAGES - 1 : slot - 1, false);\n"
    "  slot = (slot + 1 == STAGES) ? 0 : slot + 1;\n"
    "}\n"
)
out = src[:a] + new_loop + src[b:]
dst = root / ".h200-mlx" / "scratch" / "split.kernel"
dst.write_text(out)
print("wrote", dst)
