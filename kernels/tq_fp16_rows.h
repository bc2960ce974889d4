// The FP16 rows of a protected layer (sink rows and the recent window) as one softmax partial
// per query row, for the tensor-core decode kernel's final merge (HAS_EXTRA in
// tq_decode_mma.kernel); `quant.reference.fp16_rows_partial_ref` is its twin. Shared by
// tq_dense_partial.kernel and tq_commit_dense.kernel (CUDA only: shared arrays are declared
// inside the function, which Metal does not allow).
// Row t (position qpos + r % M) sees sink p < min(S, t + 1) and ring positions
// S + ts_committed<CB>(max(0, t + 1 - W - S)) .. t (position p in ring slot p % RCAP: the rows not yet
// committed, CB at a time), from kv_start on.
// One threadgroup of NT threads per (row r, b * Hkv + h).
// q (B, Hq, M, D); k_sinks, v_sinks (B, Hkv, sink_slots >= 1, D) (only the first S read);
// k_recent, v_recent (B, Hkv, slots, D); k_mean (B, Hkv, D) float32 (HAS_MEAN); v_rot (D,)
// signs (VROT 0) or (D, D) Π_V (VROT 1) float32; start: the row's kv_start.
// Writes part[(bh * R + r) * (D + 3) ...]: o' = Π_V Σ exp(s - m) v (natural-log units,
// unnormalized), then m, l = Σ exp(s - m), and off = scale · q·mean (what the scores of
// centred codes lack; 0 without HAS_MEAN). A row that sees no FP16 row: m = -inf.
#pragma once

template <int D, int G, int M, int R, int S, int W, int CB, int RCAP, int KMAX, int NT, int SCALE_BITS,
          bool HAS_MEAN, int VROT, typename PQ, typename PK, typename PV, typename PM, typename PR,
          typename PO>
TS_FUNC void ts_fp16_rows_partial(PQ q, PK k_sinks, PV v_sinks, PK k_recent, PV v_recent, PM k_mean, PR v_rot,
                                  int sink_slots, int hkv, size_t slots, int qpos, int start, int r, int bh,
                                  uint tid, uint lane, PO part) {
  constexpr int NW = NT / 32;
  TS_SHARED float qs[D];
  TS_SHARED float sc[KMAX];
  TS_SHARED float ob[D];
  TS_SHARED float red[NW];

  const float scale = ts_as_float(SCALE_BITS);
  const int b = bh / hkv;
  const int h = bh % hkv;
  const int hq = h * G + r / M;
  const int t = qpos + r % M;
  const size_t qrow = (((size_t)b * hkv * G + hq) * M + r % M) * D;

  float qm = 0.0f;
  for (int c = tid; c < D; c += NT) {
    const float v = static_cast<float>(q[qrow + c]);
    qs[c] = v * scale;
    if (HAS_MEAN) qm += v * k_mean[(size_t)bh * D + c];
  }
  if (HAS_MEAN) {
    qm = ts_simd_sum(qm);
    if (lane == 0) red[tid / 32] = qm;
  }
  TS_BARRIER();
  float off = 0.0f;
  if (HAS_MEAN) {
    for (int w = 0; w < NW; w++) off += red[w];
    off *= scale;
  }
  TS_BARRIER();

  // The row's FP16 keys: i < ns are sink rows, the rest ring positions from p0.
  const int ns = (S < t + 1) ? S : t + 1;
  const int p0 = S + ts_committed<CB>((t + 1 - W - S > 0) ? t + 1 - W - S : 0);
  const int n = ns + ((t >= p0) ? t - p0 + 1 : 0);
  float lmax = TS_NEG_INF;
  for (int i = tid; i < n; i += NT) {
    const int p = (i < ns) ? i : p0 + (i - ns);
    float s = TS_NEG_INF;
    if (p >= start) {
      const size_t at = (i < ns) ? ((size_t)bh * sink_slots + p) * D : ((size_t)bh * slots + p % RCAP) * D;
      const TS_GPTR auto* k = (i < ns) ? k_sinks + at : k_recent + at;
      s = 0.0f;
      for (int c = 0; c < D; c++) s += qs[c] * static_cast<float>(k[c]);
    }
    sc[i] = s;
    lmax = ts_max(lmax, s);
  }
  lmax = ts_simd_max(lmax);
  if (lane == 0) red[tid / 32] = lmax;
  TS_BARRIER();
  float m = TS_NEG_INF;
  for (int w = 0; w < NW; w++) m = ts_max(m, red[w]);
  TS_BARRIER();
  float lsum = 0.0f;
  for (int i = tid; i < n; i += NT) {
    const float e = (m == TS_NEG_INF) ? 0.0f : ts_exp(sc[i] - m);
    sc[i] = e;
    lsum += e;
  }
  lsum = ts_simd_sum(lsum);
  if (lane == 0) red[tid / 32] = lsum;
  TS_BARRIER();
  float l = 0.0f;
  for (int w = 0; w < NW; w++) l += red[w];

  // o = Σ e_i v_i, one coordinate per thread (consecutive threads read consecutive values).
  for (int c = tid; c < D; c += NT) {
    float o = 0.0f;
    for (int i = 0; i < n; i++) {
      const int p = (i < ns) ? i : p0 + (i - ns);
      const float v = (i < ns) ? static_cast<float>(v_sinks[((size_t)bh * sink_slots + p) * D + c])
                               : static_cast<float>(v_recent[((size_t)bh * slots + p % RCAP) * D + c]);
      o += sc[i] * v;
    }
    ob[c] = (VROT == 0) ? o * v_rot[c] : o;
  }
  TS_BARRIER();
  // o' = Π_V o: H(s ⊙ o) / sqrt(D) for a randomized Hadamard, Π o for a dense Π.
  if (VROT == 0) {
    ts_fwht<D, 1, NT>(ob, tid);
  }
  TS_GPTR float* out = part + ((size_t)bh * R + r) * (D + 3);
  for (int c = tid; c < D; c += NT) {
    float o = 0.0f;
    if (VROT == 0) {
      o = ob[c] / ts_sqrt((float)D);
    } else {
      for (int i = 0; i < D; i++) o += v_rot[c * D + i] * ob[i];
    }
    out[c] = o;
  }
  if (tid == 0) {
    out[D] = m;
    out[D + 1] = l;
    out[D + 2] = off;
  }
}
