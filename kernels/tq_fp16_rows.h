// The FP16 rows of a protected layer (sink rows and the recent window) as one softmax partial
// for one query row, computed by one block of tq_decode_mma.kernel (DENSE) and merged with the
// codes' splits there; `quant.reference.fp16_rows_partial_ref` is its twin (in natural-log units,
// where this works in log2 units). CUDA only.
// Row r (position t = qpos + r % M) sees sink p < min(S, t + 1) and ring positions
// S + ts_committed<CB>(max(0, t + 1 - W - S)) .. t (position p in ring slot p % RCAP: the rows not
// yet committed, CB at a time), from `start` on.
// Warp w takes the row's FP16 keys w, w + NW, ... with an online softmax, each lane D / 32
// consecutive coordinates (one coalesced row read per key and side); the warps' (m, l, o) are
// merged in shared memory `ws` (NW * (D + 2) + D floats), then o is rotated by Π_V.
// q (B, Hq, M, D); k_sinks, v_sinks (B, Hkv, sink_slots >= 1, D) (only the first S read);
// k_recent, v_recent (B, Hkv, slots, D); k_mean (B, Hkv, D) float32 (HAS_MEAN); v_rot (D,)
// signs (VROT 0) or (D, D) Π_V (VROT 1) float32; scale2: the score scale times log2(e).
// Writes out[0, D) = o' = Π_V Σ 2^(s - m) v (unnormalized; s = scale2 · q·k), out[D] = m,
// out[D + 1] = l = Σ 2^(s - m), out[D + 2] = scale2 · q·mean (what the scores of centred codes
// lack; 0 without HAS_MEAN). A row that sees no FP16 row: m = -inf, l = 0, o' = 0.
#pragma once

template <int D, int G, int M, int S, int W, int CB, int RCAP, int NT, bool HAS_MEAN, int VROT, typename PQ,
          typename PK, typename PV, typename PM, typename PR>
TS_FUNC void ts_fp16_rows_partial(PQ q, PK k_sinks, PV v_sinks, PK k_recent, PV v_recent, PM k_mean, PR v_rot,
                                  float scale2, int sink_slots, int hkv, size_t slots, int qpos, int start, int r,
                                  int bh, uint tid, float* ws, float* out) {
  constexpr int NW = NT / 32;
  constexpr int QE = D / 32;  // coordinates per lane
  const uint lane = tid & 31u;
  const uint warp = tid >> 5;
  const int b = bh / hkv;
  const int hq = (bh % hkv) * G + r / M;
  const int t = qpos + r % M;
  const size_t qrow = (((size_t)b * hkv * G + hq) * M + r % M) * D + lane * QE;

  float qv[QE];
  float qm = 0.0f;
  TS_UNROLL for (int e = 0; e < QE; e++) {
    const float x = static_cast<float>(q[qrow + e]);
    qv[e] = x * scale2;
    if (HAS_MEAN) qm += x * k_mean[(size_t)bh * D + lane * QE + e];
  }
  const float off = HAS_MEAN ? ts_simd_sum(qm) * scale2 : 0.0f;

  // The row's FP16 keys: i < ns are sink rows, the rest ring positions from p0.
  const int ns = (S < t + 1) ? S : t + 1;
  const int p0 = S + ts_committed<CB>((t + 1 - W - S > 0) ? t + 1 - W - S : 0);
  const int n = ns + ((t >= p0) ? t - p0 + 1 : 0);
  float m = TS_NEG_INF, l = 0.0f, o[QE];
  TS_UNROLL for (int e = 0; e < QE; e++) o[e] = 0.0f;
  for (int i = warp; i < n; i += NW) {
    const int p = (i < ns) ? i : p0 + (i - ns);
    if (p < start) continue;  // the whole warp's key
    const bool sink = i < ns;
    const size_t at = (sink ? ((size_t)bh * sink_slots + p) : ((size_t)bh * slots + p % RCAP)) * D + lane * QE;
    const auto* k = (sink ? k_sinks : k_recent) + at;
    const auto* v = (sink ? v_sinks : v_recent) + at;
    float s = 0.0f;
    TS_UNROLL for (int e = 0; e < QE; e++) s += qv[e] * static_cast<float>(k[e]);
    s = ts_simd_sum(s);
    const float mn = ts_max(m, s);
    const float a = ts_exp2(m - mn);  // 0 while m is -inf
    const float pe = ts_exp2(s - mn);
    l = l * a + pe;
    TS_UNROLL for (int e = 0; e < QE; e++) o[e] = o[e] * a + pe * static_cast<float>(v[e]);
    m = mn;
  }

  // Merge the warps: o of warp w at ws[w * D], m and l at ws[NW * D + w], ws[NW * D + NW + w];
  // the merged, Π_V-rotated row at ob.
  float* ob = ws + NW * (D + 2);
  TS_UNROLL for (int e = 0; e < QE; e++) ws[warp * D + lane * QE + e] = o[e];
  if (lane == 0) {
    ws[NW * D + warp] = m;
    ws[NW * D + NW + warp] = l;
  }
  TS_BARRIER();
  float mx = TS_NEG_INF;
  for (int w = 0; w < NW; w++) mx = ts_max(mx, ws[NW * D + w]);
  for (int c = tid; c < D; c += NT) {
    float x = 0.0f;
    if (mx != TS_NEG_INF) {
      for (int w = 0; w < NW; w++) x += ws[w * D + c] * ts_exp2(ws[NW * D + w] - mx);
    }
    ob[c] = (VROT == 0) ? x * v_rot[c] : x;
  }
  TS_BARRIER();
  // o' = Π_V o: H(s ⊙ o) / sqrt(D) for a randomized Hadamard, Π o for a dense Π.
  if (VROT == 0) ts_fwht<D, 1, NT>(ob, tid);
  for (int c = tid; c < D; c += NT) {
    float x = 0.0f;
    if (VROT == 0) {
      x = ob[c] / ts_sqrt((float)D);
    } else {
      for (int i = 0; i < D; i++) x += v_rot[c * D + i] * ob[i];
    }
    out[c] = x;
  }
  if (tid == 0) {
    float lsum = 0.0f;
    if (mx != TS_NEG_INF) {
      for (int w = 0; w < NW; w++) lsum += ws[NW * D + NW + w] * ts_exp2(ws[NW * D + w] - mx);
    }
    out[D] = mx;
    out[D + 1] = lsum;
    out[D + 2] = off;
  }
}
