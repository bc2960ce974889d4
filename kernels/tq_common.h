// Packed-code helpers shared by the TurboQuant kernels, written in the dialect
// (TS_* names come from the backend prelude). Layout: turbospark_mlx/quant/packing.py:
// 1/2/4/8 bits in one plane; 3 bits = a 2-bit plane then a 1-bit plane; word w of a
// plane of width b holds coordinates [w*32/b, (w+1)*32/b), lowest bits first.

// Code slots a query row reads when a protected layer commits its rows CB at a time: of the
// n it would read with rows committed one by one, the whole blocks, CB * floor(n / CB)
// (TurboQuantConfig.committed_end; n <= 0: none).
template <int CB>
TS_FUNC int ts_committed(int n) {
  return (CB == 1 || n <= 0) ? n : n / CB * CB;
}

// N consecutive words from src into out; src is aligned to VEC words (1, 2 or 4),
// so the loads are as wide as the alignment allows.
template <int N, int VEC, typename P>
TS_FUNC void ts_load_words(P src, TS_TPTR uint* out) {
  if (VEC >= 4 && N % 4 == 0) {
    TS_UNROLL for (int i = 0; i < N / 4; i++) {
      const uint4 v = ((const TS_GPTR uint4*)src)[i];
      out[4 * i] = v.x;
      out[4 * i + 1] = v.y;
      out[4 * i + 2] = v.z;
      out[4 * i + 3] = v.w;
    }
  } else if (VEC >= 2 && N % 2 == 0) {
    TS_UNROLL for (int i = 0; i < N / 2; i++) {
      const uint2 v = ((const TS_GPTR uint2*)src)[i];
      out[2 * i] = v.x;
      out[2 * i + 1] = v.y;
    }
  } else {
    TS_UNROLL for (int i = 0; i < N; i++) out[i] = src[i];
  }
}

// The BITS words (3 for 3-bit: two of the low plane, one of the high plane) that
// hold coordinates [32*blk, 32*blk + 32) of one packed vector of DIM coordinates.
// VEC: the alignment, in words, of `codes` (the row's word count is a multiple of it).
template <int BITS, int DIM, int VEC, typename P>
TS_FUNC void ts_block_words(P codes, int blk, TS_TPTR uint* words) {
  if (BITS == 3) {
    constexpr int W0 = (DIM + 15) / 16;  // words of the 2-bit plane
    ts_load_words<2, (VEC < 2 ? VEC : 2)>(codes + 2 * blk, words);
    words[2] = codes[W0 + blk];
  } else {
    ts_load_words<BITS, (VEC < BITS ? VEC : BITS)>(codes + BITS * blk, words);
  }
}

// Indices of coordinates [8c, 8c + 8) of a 32-coordinate block from its words.
template <int BITS>
TS_FUNC void ts_block_unpack8(TS_TPTR const uint* words, int c, TS_TPTR uint* idx) {
  if (BITS == 3) {
    const uint lo = words[c / 2] >> ((c % 2) * 16);
    const uint hi = words[2] >> (c * 8);
    TS_UNROLL for (int e = 0; e < 8; e++) idx[e] = ((lo >> (2 * e)) & 3u) | (((hi >> e) & 1u) << 2);
  } else if (BITS == 8) {
    TS_UNROLL for (int e = 0; e < 4; e++) {
      idx[e] = (words[2 * c] >> (8 * e)) & 255u;
      idx[e + 4] = (words[2 * c + 1] >> (8 * e)) & 255u;
    }
  } else {
    const uint w = words[(8 * c * BITS) / 32] >> ((8 * c * BITS) % 32);
    TS_UNROLL for (int e = 0; e < 8; e++) idx[e] = (w >> (BITS * e)) & ((1u << BITS) - 1u);
  }
}

// Indices of coordinates [8c, 8c + 8) straight from a packed vector in memory.
template <int BITS, int DIM, typename P>
TS_FUNC void ts_unpack8(P codes, int c, TS_TPTR uint* idx) {
  if (BITS == 3) {
    constexpr int W0 = (DIM + 15) / 16;
    const uint lo = codes[c / 2] >> ((c % 2) * 16);
    const uint hi = codes[W0 + c / 4] >> ((c % 4) * 8);
    TS_UNROLL for (int e = 0; e < 8; e++) idx[e] = ((lo >> (2 * e)) & 3u) | (((hi >> e) & 1u) << 2);
  } else if (BITS == 8) {
    const uint w0 = codes[2 * c];
    const uint w1 = codes[2 * c + 1];
    TS_UNROLL for (int e = 0; e < 4; e++) {
      idx[e] = (w0 >> (8 * e)) & 255u;
      idx[e + 4] = (w1 >> (8 * e)) & 255u;
    }
  } else {
    const uint w = codes[(8 * c * BITS) / 32] >> ((8 * c * BITS) % 32);
    TS_UNROLL for (int e = 0; e < 8; e++) idx[e] = (w >> (BITS * e)) & ((1u << BITS) - 1u);
  }
}

// In-place fast Walsh-Hadamard transform (Sylvester order, unnormalized) of NV
// interleaved vectors of length N in threadgroup memory: element j of vector v at
// buf[j * NV + v]. All NTH threads of the group call it; it ends with a barrier.
template <int N, int NV, int NTH>
TS_FUNC void ts_fwht(TS_SPTR float* buf, uint tid) {
  for (int h = 1; h < N; h <<= 1) {
    for (int p = tid; p < (N / 2) * NV; p += NTH) {
      const int v = p % NV;
      const int k = p / NV;
      const int i = (k / h) * 2 * h + (k % h);
      const float a = buf[i * NV + v];
      const float b = buf[(i + h) * NV + v];
      buf[i * NV + v] = a + b;
      buf[(i + h) * NV + v] = a - b;
    }
    TS_BARRIER();
  }
}

// Quantize one row of D coordinates with one SIMD group (32 lanes; the row's threadgroup
// is that group): *norm = ||x - mean||, codes = the packed cells of Π (x - mean) / ||x - mean||.
// mean is read only when CENTER. xs: D floats of threadgroup memory. A zero row maps to the
// middle cell and decodes to 0 through its norm (as quantize_ref).
template <int D, int BITS, int W, int ROT, bool CENTER, typename PX, typename PM, typename PR, typename PB,
          typename PC, typename PN>
TS_FUNC void ts_quantize_row(PX x, PM mean, PR rot, PB bnd, TS_SPTR float* xs, uint lane, PC codes, PN norm) {
  float ss = 0.0f;
  for (int j = lane; j < D; j += 32) {
    const float v = static_cast<float>(x[j]) - (CENTER ? mean[j] : 0.0f);
    ss += v * v;
    xs[j] = (ROT == 0) ? v * rot[j] : v;
  }
  ss = ts_simd_sum(ss);
  const float n = ts_sqrt(ss);
  const float dn = ts_max(n, 1e-30f);
  if (lane == 0) {
    *norm = n;
  }
  TS_BARRIER();
  if (ROT == 0) {
    ts_fwht<D, 1, 32>(xs, lane);
  }
  const float inv = (ROT == 0) ? 1.0f / ts_sqrt((float)D) : 1.0f;
  constexpr int W0 = (BITS == 3) ? (D + 15) / 16 : W;  // words of the first (low) plane
  for (int w = lane; w < W; w += 32) {
    const bool high = BITS == 3 && w >= W0;
    const int width = BITS == 3 ? (high ? 1 : 2) : BITS;
    const int per = 32 / width;
    const int j0 = (high ? w - W0 : w) * per;
    const int shift = high ? 2 : 0;
    uint word = 0u;
    for (int s = 0; s < per; s++) {
      const int j = j0 + s;
      if (j < D) {
        float yr = 0.0f;
        if (ROT == 0) {
          yr = xs[j] * inv;
        } else {
          for (int i = 0; i < D; i++) yr += rot[j * D + i] * xs[i];
        }
        const float y = yr / dn;
        // Branchless binary search: the count of boundaries strictly below y.
        uint idx = 0u;
        for (int step = 1 << (BITS - 1); step > 0; step >>= 1) {
          idx += (y > bnd[idx + step - 1]) ? (uint)step : 0u;
        }
        word |= ((idx >> shift) & ((1u << width) - 1u)) << (s * width);
      }
    }
    codes[w] = word;
  }
}
