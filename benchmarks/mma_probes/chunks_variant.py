# Session 12's "chunks taken as warps go" (not kept: the loop got slower, see
# decode_attention_notes.md, Session 12) rebuilt from the current kernel as probe variants, to
# tell its two candidate causes apart on the next device call:
#   chunks_inc.kernel     as measured: a per-head counter (PTX atom.inc), asked a round ahead
#   chunks_ahead2.kernel  the same, asked two rounds ahead (three fixed chunks first)
#   chunks_static.kernel  the same chunk order without a counter: warp gw takes chunks gw + k*W
#   chunks_tail.kernel    static contiguous ranges over the first 7/8 of the keys, then a pool of
#                         the last eighth's chunks taken from the counter (its first two asked
#                         at set-up), so the atomics are few and their latency off the path
# Writes them into .h200-mlx/scratch/ (or argv[1]); build with mk.make (chained_timing.py FILE).
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "kernels" / "tq_decode_mma.kernel"
OUT = Path(sys.argv[1] if len(sys.argv) > 1 else ".h200-mlx/scratch")


def sub(s: str, old: str, new: str) -> str:
    assert s.count(old) == 1, old[:80]
    return s.replace(old, new)


# The C++ both builders insert: the chunk constants, the fast refills' source pointers at a
# key, and lane 0's take from the counter (PTX atom.inc: an add, ptxas made warp-aggregated,
# with a shuffle of its result right behind it).
CHUNKS = """constexpr int CK = 16 * STAGES;  // a chunk: one round of tiles
const int W = NWARP * nsplit;
const int gw = split * NWARP + warp;
const int cf0 = (start + CK - 1) / CK;  // chunks [cf0, cf1): every key seen by every row
const int cf1 = (end - M + 1) / CK;
"""
AIM = """  auto aim = [&](const int key) {
    const size_t a = hbase + key;
    pk = k_codes + a * KRW + 4 * lane;
    pv = v_codes + a * VRW + 4 * lane;
    pn = ((lane < 4) ? k_norms : v_norms) + a + 4 * (lane & 3);
  };
"""
TAKE = """  auto take = [&]() {
    uint got = 0u;
    asm volatile("{\\n .reg .pred p;\\n setp.eq.u32 p, %1, 0;\\n @p atom.global.inc.u32 %0, [%2], 0x7fffffff;\\n}"
                 : "+r"(got) : "r"(lane), "l"(counter));
    return got;
  };
"""


def step_and_reset(s: str) -> str:
    """The edits every variant shares: `step` takes a refill flag and bounds its slot-by-slot
    refills by `klim` (a rest's end), and the last block also zeroes the chunk counter."""
    s = sub(s, "auto step = [&](const int kb, const int slot, const int fill, const bool fast) {\n  const int ahead = kb + 16 * (STAGES - 1);\n  if (fast) {\n",
            "int klim = kend;\n"
            "auto step = [&](const int kb, const int slot, const int fill, const bool fast, const bool refill = true) {\n"
            "  const int ahead = kb + 16 * (STAGES - 1);\n  if (fast && refill) {\n")
    s = sub(s, "  } else if (ahead < kend) {\n    issue(ahead, fill);\n  }",
            "  } else if (!fast && ahead < klim) {\n    issue(ahead, fill);\n  }")
    s = sub(s, "  if (is_last) *ticket = 0u;",
            "  if (is_last) {\n    *ticket = 0u;\n    const_cast<uint*>(scratch)[TICKET_WORDS / 2 + 8 * bh] = 0u;\n  }")
    return s


def base(ahead: int) -> str:
    """The kernel with chunked long contexts; `ahead` fixed chunks per warp before the counter."""
    s = SRC.read_text()
    s = sub(s, "const int kend = (kbeg + KEYS_W < end) ? kbeg + KEYS_W : end;\n",
            "const int kend = (kbeg + KEYS_W < end) ? kbeg + KEYS_W : end;\n" + CHUNKS)
    s = sub(s, "TS_UNROLL for (int i = 0; i < STAGES - 1; i++) {\n  if (kbeg + 16 * i < kend) issue(kbeg + 16 * i, i);\n  ts_cp_commit();\n}",
            f"const bool dyn = vec16 && cf1 - cf0 >= {ahead} * W;\n"
            "int r0 = kbeg, r1 = kend;\n"
            "if (dyn) {\n"
            "  r0 = (gw == W - 1) ? cf1 * CK : (gw == W - 2) ? (start & ~15) : (cf0 + gw) * CK;\n"
            "  r1 = (gw == W - 1) ? end : (gw == W - 2) ? cf0 * CK : r0 + CK;\n"
            "}\n"
            "TS_UNROLL for (int i = 0; i < STAGES - 1; i++) {\n  if (r0 + 16 * i < r1) issue(r0 + 16 * i, i);\n  ts_cp_commit();\n}")
    s = step_and_reset(s)
    a = s.index("int kb = kbeg;\nif (vec16 && kbeg >= start) {")
    b = s.index("ts_cp_wait<0>();  // the merge below reuses the ring")
    static = s[a:b]
    s = s[:a] + "if (!dyn) {\n" + static + "} else {\n@DYN@}\n" + s[b:]
    return s


PRE = """  int c0 = cf0 + gw;
  int c1 = c0 + W;
  if (gw >= W - 2) {
    klim = r1;
    for (int slot = 0, kb = r0; kb < r1; kb += 16) {
      step(kb, slot, (slot == 0) ? STAGES - 1 : slot - 1, false);
      slot = (slot + 1 == STAGES) ? 0 : slot + 1;
    }
    TS_UNROLL for (int i = 0; i < STAGES - 1; i++) {
      issue(c0 * CK + 16 * i, i);
      ts_cp_commit();
    }
  }
  uint* counter = const_cast<uint*>(scratch) + TICKET_WORDS / 2 + 8 * bh;
""" + AIM + TAKE + """  (void)take;
  auto round = [&](const bool more) {
    aim(c0 * CK + 16 * (STAGES - 1));
    step(c0 * CK, 0, STAGES - 1, true);
    aim(c1 * CK);
    TS_UNROLL for (int s = 1; s < STAGES; s++) step(c0 * CK + 16 * s, s, s - 1, true, more);
  };
"""
INC = PRE + """  while (true) {
    const uint got = take();
    const bool more = c1 < cf1;
    round(more);
    const int next = cf0 + 2 * W + (int)__shfl_sync(0xffffffffu, got, 0);
    if (!more) break;
    c0 = c1;
    c1 = next;
  }
"""
AHEAD2 = PRE + """  int c2 = c1 + W;
  uint pending = take();
  while (true) {
    const uint got = take();
    const bool more = c1 < cf1;
    round(more);
    const int next = cf0 + 3 * W + (int)__shfl_sync(0xffffffffu, pending, 0);
    pending = got;
    if (!more) break;
    c0 = c1;
    c1 = c2;
    c2 = next;
  }
  if (__shfl_sync(0xffffffffu, pending, 0) == 0xffffffffu) __trap();  // wait for the last atomic
"""
STATIC = PRE + """  while (true) {
    const bool more = c1 < cf1;
    round(more);
    if (!more) break;
    c0 = c1;
    c1 += W;
  }
"""


def tail() -> str:
    """chunks_tail: the static scheme over keys [0, SK), then a pool of chunks [PC, cf1)."""
    s = SRC.read_text()
    s = sub(s, """const int KEYS_W = 16 * ((end + 16 * NWARP * nsplit - 1) / (16 * NWARP * nsplit));
const int kbeg = (split * NWARP + warp) * KEYS_W;
const int kend = (kbeg + KEYS_W < end) ? kbeg + KEYS_W : end;
""", CHUNKS + """const bool dyn = (cap * TsChunk<KB, D, KC>::RW) % 4 == 0 && (cap * TsChunk<VB, D, VC>::RW) % 4 == 0 && cap % 4 == 0 &&
                 ((((size_t)k_codes) | ((size_t)v_codes) | ((size_t)k_norms) | ((size_t)v_norms)) % 16 == 0) &&
                 cf1 - cf0 >= 16 * W;
const int PC = dyn ? cf1 - (cf1 - cf0) / 8 : 0;  // the pool: chunks [PC, cf1)
const int SK = dyn ? PC * CK : end;  // the static ranges cover keys [0, SK)
const int KEYS_W = 16 * ((SK + 16 * W - 1) / (16 * W));
const int kbeg = gw * KEYS_W;
const int kend = (kbeg + KEYS_W < SK) ? kbeg + KEYS_W : SK;
uint* counter = const_cast<uint*>(scratch) + TICKET_WORDS / 2 + 8 * bh;
""" + TAKE + """const uint got0 = dyn ? take() : 0u;  // the first two pool chunks, needed after the static range
const uint got1 = dyn ? take() : 0u;
""")
    s = step_and_reset(s)
    pool = """if (dyn) {
  if (gw == W - 1 && cf1 * CK < end) {  // the last keys, which some rows do not see: slot by slot
    klim = end;
    TS_UNROLL for (int i = 0; i < STAGES - 1; i++) {
      if (cf1 * CK + 16 * i < end) issue(cf1 * CK + 16 * i, i);
      ts_cp_commit();
    }
    for (int slot = 0, kb = cf1 * CK; kb < end; kb += 16) {
      step(kb, slot, (slot == 0) ? STAGES - 1 : slot - 1, false);
      slot = (slot + 1 == STAGES) ? 0 : slot + 1;
    }
  }
  int c0 = PC + (int)__shfl_sync(0xffffffffu, got0, 0);
  int c1 = PC + (int)__shfl_sync(0xffffffffu, got1, 0);
""" + AIM + """  if (c0 < cf1) {
    TS_UNROLL for (int i = 0; i < STAGES - 1; i++) {
      issue(c0 * CK + 16 * i, i);
      ts_cp_commit();
    }
    while (true) {
      const uint got = take();
      const bool more = c1 < cf1;
      aim(c0 * CK + 16 * (STAGES - 1));
      step(c0 * CK, 0, STAGES - 1, true);
      aim(c1 * CK);
      TS_UNROLL for (int s = 1; s < STAGES; s++) step(c0 * CK + 16 * s, s, s - 1, true, more);
      const int next = PC + (int)__shfl_sync(0xffffffffu, got, 0);
      if (!more) break;
      c0 = c1;
      c1 = next;
    }
  }
}
"""
    s = sub(s, "ts_cp_wait<0>();  // the merge below reuses the ring", pool + "ts_cp_wait<0>();  // the merge below reuses the ring")
    return s


OUT.mkdir(parents=True, exist_ok=True)
(OUT / "chunks_tail.kernel").write_text(tail())
print(OUT / "chunks_tail.kernel")
for name, ahead, body in (("chunks_inc", 2, INC), ("chunks_ahead2", 3, AHEAD2), ("chunks_static", 2, STATIC)):
    (OUT / f"{name}.kernel").write_text(base(ahead).replace("@DYN@", body))
    print(OUT / f"{name}.kernel")
