// CUDA-only helpers of tq_decode_mma.kernel (tensor-core TurboQuant decode attention).
// Appended to prelude_cuda.h + tq_common.h. Why a CUDA-only variant: on the H200 the
// dialect kernel spends ~2k lane instructions per key and head on scalar FMAs and
// shared-memory codebook loads; here the products run on mma.sync (fp16 in, fp32
// accumulate) and a code pair costs one shift, one mask and one conflict-free load.
#pragma once

// D (16x8, fp32) += A (16x16, fp16, row-major) * B (16x8, fp16, column-major).
// Lane l = 4g + t holds a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..],
// a3 = A[g+8][2t+8..]; b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g];
// c0 = C[g][2t], c1 = C[g][2t+1], c2 = C[g+8][2t], c3 = C[g+8][2t+1].
TS_FUNC void ts_mma16816(float* c, uint a0, uint a1, uint a2, uint a3, uint b0, uint b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The transpose of an 8x8 b16 tile held as one register per lane (lane 4g + t: row g,
// columns 2t and 2t + 1), in the same layout.
TS_FUNC uint ts_movmatrix_t(uint x) {
  uint y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

TS_FUNC uint ts_half2_bits(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint*>(&h);
}

// exp2 on the SFU with denormals flushed: exp2f's non-ftz path costs a compare, two
// multiplies and a branch per call, and softmax weights below 2^-126 do not matter.
TS_FUNC float ts_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Byte p of w, zero-extended (one PRMT).
TS_FUNC uint ts_byte(uint w, int p) { return __byte_perm(w, 0u, 0x4440 | p); }

// Largest power of two (<= 4) dividing x: the widest aligned load of words at offset x.
constexpr int ts_align4(int x) { return (x % 4 == 0) ? 4 : (x % 2 == 0) ? 2 : 1; }
constexpr int ts_min(int a, int b) { return a < b ? a : b; }

// The words of one bit plane (PB bits per coordinate, plane starting at word POFF of a
// row of RW words) that hold coordinates [c0, c0 + NC) of the row at `row`. If the run
// is shorter than a word, out[0] is that word shifted so the run starts at bit 0.
template <int PB, int NC, int POFF, int RW>
TS_FUNC void ts_load_plane(const uint* row, int c0, uint* out) {
  constexpr int NBITS = NC * PB;
  if (NBITS >= 32) {
    constexpr int VEC = ts_min(ts_align4(RW), ts_min(ts_align4(POFF), ts_align4(NBITS / 32)));
    ts_load_words<NBITS / 32, VEC>(row + POFF + (c0 * PB) / 32, out);
  } else {
    out[0] = row[POFF + (c0 * PB) / 32] >> ((c0 * PB) % 32);
  }
}

// ((w >> shift) & mask) * 128 in two operations (shift may be negative): the byte offset
// of a table entry when entry e of a lane's column sits at 32 e words.
TS_FUNC uint ts_field128(uint w, int shift, uint mask) {
  return (shift >= 7 ? (w >> (shift - 7)) : (w << (7 - shift))) & (mask << 7);
}
// A table word at byte offset `off` from `lut`, a 32-bit shared-window address: so the
// address is one LEA / IADD from the code bits (a generic pointer costs two IMADs).
// Not volatile: the tables are written once, before the set-up's barriers.
TS_FUNC uint ts_lut_at(uint lut, uint off) {
  uint v;
  asm("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(lut + off));
  return v;
}

// One LOP3 of truth table LUT (PTX lop3: a = 0xF0, b = 0xCC, c = 0xAA). Written as C,
// each side of these gets its own mask from ptxas, one more operation each.
template <int LUT>
TS_FUNC uint ts_lop3(uint a, uint b, uint c) {
  uint d;
  asm("lop3.b32 %0, %1, %2, %3, %4;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c), "n"(LUT));
  return d;
}
// (a & ~m) | (b & m)
TS_FUNC uint ts_bitsel(uint a, uint b, uint m) { return ts_lop3<0xD8>(a, b, m); }
// (a | b) & m
TS_FUNC uint ts_or_and(uint a, uint b, uint m) { return ts_lop3<0xA8>(a, b, m); }

// Under PL (table entries 256 bytes apart from a 64 KB-aligned window address): the shared
// address of the entry indexed by byte b of w, in one PRMT: bytes 0, 2, 3 from the lane's
// column address, byte 1 = the index byte.
TS_FUNC uint ts_pl_addr(uint w, int b, uint lane_addr) { return __byte_perm(w, lane_addr, 0x7604 | (b << 4)); }

// Words of a code chunk (coordinates [c0, c0 + NC) of one vector of D coordinates at
// BITS bits): plane 0 in lo, and for 3 bits the high plane in hi.
template <int BITS, int D, int NC>
struct TsChunk {
  static constexpr int PB0 = (BITS == 3) ? 2 : BITS;
  static constexpr int NLO = (NC * PB0 >= 32) ? NC * PB0 / 32 : 1;
  static constexpr int NHI = (BITS == 3) ? ((NC >= 32) ? NC / 32 : 1) : 0;
  static constexpr int RW = (BITS == 3) ? (D + 15) / 16 + (D + 31) / 32 : D * BITS / 32;
  uint lo[NLO];
  uint hi[NHI > 0 ? NHI : 1];

  TS_FUNC void load(const uint* row, int c0) {
    ts_load_plane<PB0, NC, 0, RW>(row, c0, lo);
    if (BITS == 3) ts_load_plane<1, NC, (D + 15) / 16, RW>(row, c0, hi);
  }

  // Byte offset (entry * 128) in a lane-replicated table of coordinate pair p
  // (coordinates c0 + 2p, c0 + 2p + 1); BITS 2/3/4.
  TS_FUNC uint pair(int p) const {
    if (BITS == 4) return ts_byte(lo[p / 4], p % 4) << 7;  // PRMT + the address LEA
    if (BITS == 2) return ts_field128(lo[p / 8], 4 * (p % 8), 15u);
    return ts_field128(lo[p / 8], 4 * (p % 8), 15u) | ts_field128(hi[p / 16], 2 * (p % 16) - 4, 3u << 4);
  }
  // Byte offset of coordinate c0 + i's entry; BITS 8.
  TS_FUNC uint single(int i) const { return ts_byte(lo[i / 4], i % 4) << 7; }
  // Under PL: the shared address of the entry of code byte b (pair p at 2/3/4 bits,
  // coordinate i at 8), one PRMT (ts_pl_addr).
  TS_FUNC uint byte_addr(int b, uint lane_addr) const {
    if (BITS == 2 || BITS == 3) return ts_pl_addr(ix[2 * (b / 8) + (b % 2)], (b % 8) / 2, lane_addr);
    return ts_pl_addr(lo[b / 4], b % 4, lane_addr);
  }
  // Under PL at 2/3 bits: each pair's table index (its plane-0 nibble, its two high-plane
  // bits above) as one byte, so that an address is one PRMT as at 4 bits. Word 2w holds
  // pairs 8w + 0, 2, 4, 6 and word 2w + 1 pairs 8w + 1, 3, 5, 7. At 3 bits an even pair's
  // byte keeps the next pair's high bits in bits 6-7 (the kernel stores a 3-bit table four
  // times over, 256 entries): 8 operations per 8 pairs (2 at 2 bits).
  static constexpr int NIX = (BITS == 2 || BITS == 3) ? 2 * NLO : 1;
  uint ix[NIX];
  TS_FUNC void pair_bytes() {
    TS_UNROLL for (int w = 0; w < NLO; w++) {
      if (BITS == 3) {
        // Nibble m of the 16 high bits of these 8 pairs to byte m: pair 8w + 2m's two bits
        // at bits 0-1, pair 8w + 2m + 1's at bits 2-3.
        uint x = __byte_perm(hi[w / 2], 0u, (w % 2) ? 0x4342 : 0x4140);
        x = ts_or_and(x, x << 4, 0x0f0f0f0fu);
        ix[2 * w] = ts_bitsel(lo[w], x << 4, 0xf0f0f0f0u);
        ix[2 * w + 1] = ts_bitsel(lo[w] >> 4, x << 2, 0xf0f0f0f0u);
      } else {
        ix[2 * w] = lo[w] & 0x0f0f0f0fu;
        ix[2 * w + 1] = (lo[w] >> 4) & 0x0f0f0f0fu;
      }
    }
  }
};

// Entries of a side's lookup table: a half2 of two coordinates' centroids for 2/3/4 bits
// (a pair of codes indexes it), one half in the low 16 bits for 8 bits.
constexpr int ts_lut_entries(int bits) { return bits == 8 ? 256 : 1 << (2 * bits); }

// half2 (coordinates c0 + 2p, c0 + 2p + 1) of one key from its chunk. `lut` addresses
// this lane's column of a table replicated once per lane (entry e at lut[32 e]), so
// the 32 lanes of a warp always hit 32 different banks.
template <int BITS, int D, int NC, bool PL = false>
TS_FUNC uint ts_key_pair(const TsChunk<BITS, D, NC>& ch, uint lut, int p) {
  if (PL && BITS == 8) {
    return __byte_perm(ts_lut_at(0u, ch.byte_addr(2 * p, lut)), ts_lut_at(0u, ch.byte_addr(2 * p + 1, lut)), 0x5410);
  }
  if (PL) return ts_lut_at(0u, ch.byte_addr(p, lut));
  if (BITS == 8) return __byte_perm(ts_lut_at(lut, ch.single(2 * p)), ts_lut_at(lut, ch.single(2 * p + 1)), 0x5410);
  return ts_lut_at(lut, ch.pair(p));
}

// For the weighted-V product, whose fragments pair two keys at one coordinate: from
// keys x and y, the half2s (x[c], y[c]) and (x[c + 1], y[c + 1]) of pair p.
template <int BITS, int D, int NC, bool PL = false>
TS_FUNC void ts_two_key_pair(const TsChunk<BITS, D, NC>& x, const TsChunk<BITS, D, NC>& y, uint lut,
                             int p, uint& even, uint& odd) {
  if (PL && BITS == 8) {
    even = __byte_perm(ts_lut_at(0u, x.byte_addr(2 * p, lut)), ts_lut_at(0u, y.byte_addr(2 * p, lut)), 0x5410);
    odd = __byte_perm(ts_lut_at(0u, x.byte_addr(2 * p + 1, lut)), ts_lut_at(0u, y.byte_addr(2 * p + 1, lut)), 0x5410);
  } else if (PL) {
    const uint a = ts_lut_at(0u, x.byte_addr(p, lut));
    const uint b = ts_lut_at(0u, y.byte_addr(p, lut));
    even = __byte_perm(a, b, 0x5410);
    odd = __byte_perm(a, b, 0x7632);
  } else if (BITS == 8) {
    even = __byte_perm(ts_lut_at(lut, x.single(2 * p)), ts_lut_at(lut, y.single(2 * p)), 0x5410);
    odd = __byte_perm(ts_lut_at(lut, x.single(2 * p + 1)), ts_lut_at(lut, y.single(2 * p + 1)), 0x5410);
  } else {
    const uint a = ts_lut_at(lut, x.pair(p));
    const uint b = ts_lut_at(lut, y.pair(p));
    even = __byte_perm(a, b, 0x5410);
    odd = __byte_perm(a, b, 0x7632);
  }
}

// Under PL at 4 bits, for the weighted-V product: bytes that pair keys x and y at one
// coordinate (x's code in the low nibble, y's in the high), so that one lookup in the
// pair table gives (x[c], y[c]) as a half2, the A fragment, with no PRMT to pair two
// lookups. ev[w] byte j: coordinate c0 + 8w + 2j; od[w]: c0 + 8w + 2j + 1. Two operations
// per word each, where pairing after the lookups costs one PRMT per half2.
// (Templated on BITS so that other variants compile the call they never make; 4 bits only.)
template <int BITS, int D, int NC>
TS_FUNC void ts_two_key_bytes(const TsChunk<BITS, D, NC>& x, const TsChunk<BITS, D, NC>& y, uint* ev, uint* od) {
  TS_UNROLL for (int w = 0; w < TsChunk<BITS, D, NC>::NLO; w++) {
    ev[w] = ts_bitsel(x.lo[w], y.lo[w] << 4, 0xf0f0f0f0u);
    od[w] = ts_bitsel(x.lo[w] >> 4, y.lo[w], 0xf0f0f0f0u);
  }
}
// The PL table word indexed by byte b of w.
TS_FUNC uint ts_lut_byte(uint w, int b, uint lane_addr) { return ts_lut_at(0u, ts_pl_addr(w, b, lane_addr)); }

// Asynchronous global -> shared copies (sm_80+): a warp streams its next tiles into a
// ring in shared memory while it works on the current one, so the bytes in flight are
// not bounded by registers (cp.async.cg: 16 bytes, L2 only; .ca: 4 bytes).
TS_FUNC uint ts_smem_addr(const void* p) {
  uint a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }\n" : "=r"(a) : "l"(p));
  return a;
}
TS_FUNC void ts_cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(ts_smem_addr(dst)), "l"(src));
}
// The same copy to a shared-window address (no generic-to-shared conversion per copy).
TS_FUNC void ts_cp_async16_at(uint dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
TS_FUNC void ts_cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(ts_smem_addr(dst)), "l"(src));
}
TS_FUNC void ts_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
TS_FUNC void ts_cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// In-place unnormalized Walsh-Hadamard transform (Sylvester order) of one vector of 32*E
// coordinates held by a warp, coordinate lane*E + e in v[e]: the stages within a lane in
// registers, the others across lanes by shuffles (the stages commute), so no barrier.
template <int E>
TS_FUNC void ts_warp_fwht(float (&v)[E], int lane) {
  TS_UNROLL for (int h = 1; h < E; h <<= 1) {
    TS_UNROLL for (int e = 0; e < E; e++) {
      if ((e & h) == 0) {
        const float a = v[e];
        const float b = v[e + h];
        v[e] = a + b;
        v[e + h] = a - b;
      }
    }
  }
  TS_UNROLL for (int m = 1; m < 32; m <<= 1) {
    TS_UNROLL for (int e = 0; e < E; e++) {
      const float p = __shfl_xor_sync(0xffffffffu, v[e], m);
      v[e] = (lane & m) ? p - v[e] : v[e] + p;
    }
  }
}

// N consecutive floats from global memory through L2 only (another block wrote them in
// this launch), as wide as N allows; src is aligned to the width.
template <int N>
TS_FUNC void ts_ldcg_floats(const float* src, float* out) {
  if (N % 4 == 0) {
    TS_UNROLL for (int i = 0; i < N / 4; i++) {
      const float4 v = __ldcg(reinterpret_cast<const float4*>(src) + i);
      out[4 * i] = v.x;
      out[4 * i + 1] = v.y;
      out[4 * i + 2] = v.z;
      out[4 * i + 3] = v.w;
    }
  } else if (N % 2 == 0) {
    TS_UNROLL for (int i = 0; i < N / 2; i++) {
      const float2 v = __ldcg(reinterpret_cast<const float2*>(src) + i);
      out[2 * i] = v.x;
      out[2 * i + 1] = v.y;
    }
  } else {
    TS_UNROLL for (int i = 0; i < N; i++) out[i] = __ldcg(src + i);
  }
}

// One row's merge of a head's split partials (tq_decode_mma.kernel, after its tickets): o'
// (QE coordinates at `coords` of each partial, lane*QE.. of the row) with an online
// softmax over the splits, relative to exp2(*mx); returns the denominator. A batch of SB
// splits has all its loads in flight at once (lane j < SB: split j's max and sum at `ms`
// and ms + RP; every lane: its coordinates of each): at 16 splits one L2 round trip, where
// a pass for the maxima and then the coordinates, 8 splits at a time, takes three.
// Not inlined: inlined, it changes ptxas's register plan of the main loop (spills in the
// loop over a warp's last tiles, tq4 at 16 warps and 128 registers).
template <int QE, int SB, int RP, int STRIDE>
__device__ __noinline__ float ts_merge_splits(const float* coords, const float* ms, int nsplit, int lane, float* o, float* mx_out) {
  float mx = TS_NEG_INF;  // o and den are relative to exp2(mx)
  float den = 0.0f;
  float acc[QE];
  TS_UNROLL for (int e = 0; e < QE; e++) acc[e] = 0.0f;
  for (int s0 = 0; s0 < nsplit; s0 += SB) {
    float mj = TS_NEG_INF;  // a split past the last, or one that saw no key of this row
    float lj = 0.0f;
    if (lane < SB && s0 + lane < nsplit) {
      mj = __ldcg(ms + (size_t)(s0 + lane) * STRIDE);
      lj = __ldcg(ms + (size_t)(s0 + lane) * STRIDE + RP);
    }
    float x[SB][QE];
    TS_UNROLL for (int j = 0; j < SB; j++) {
      TS_UNROLL for (int e = 0; e < QE; e++) x[j][e] = 0.0f;
      if (s0 + j < nsplit) ts_ldcg_floats<QE>(coords + (size_t)(s0 + j) * STRIDE, x[j]);
    }
    float mn = mj;
    TS_UNROLL for (int w = 16; w > 0; w >>= 1) mn = ts_max(mn, __shfl_xor_sync(0xffffffffu, mn, w));
    mn = ts_max(mn, mx);
    // No key of this row yet: everything stays 0 (a reference of 0 keeps exp2 off -inf - -inf).
    const float mref = (mn == TS_NEG_INF) ? 0.0f : mn;
    const float a = ts_exp2(mx - mref);  // 0 while mx is -inf
    const float fj = ts_exp2(mj - mref);
    den = den * a + ts_simd_sum(fj * lj);
    TS_UNROLL for (int e = 0; e < QE; e++) acc[e] *= a;
    TS_UNROLL for (int j = 0; j < SB; j++) {
      const float f = __shfl_sync(0xffffffffu, fj, j);
      TS_UNROLL for (int e = 0; e < QE; e++) acc[e] += f * x[j][e];
    }
    mx = mn;
  }
  TS_UNROLL for (int e = 0; e < QE; e++) o[e] = acc[e];
  *mx_out = mx;
  return den;
}
