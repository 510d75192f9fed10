// chunk_prepare_kernel: one CTA per (chunk, head), everything of a chunk that does not depend
// on the state (chunk.cuh has the overview). 256 threads and ~103 KB of shared memory, so two
// CTAs share an SM and one's staging and serial stages overlap the other's (v6 ran one
// 512-thread CTA of 212 KB per SM, every stage latency-bound behind its barriers).
//   0. stage the raw q|k|v rows (and the W-1 rows before the chunk) and the raw gate;
//   A. per channel pair, a thread walks the 64 rows: conv + SiLU (bf16) of q, k, v written
//      in place over the raw rows (β⊙V for v), or for the gate channels the gate in log2
//      units summed into Γ on the way (no separate cumsum); then the row l2-norms of q, k;
//   C. A_qk, A_kk (64 x 64, causal) on tensor cores, the operand fragments built in
//      registers from q, k (bf16), their row norms and Γ: for rows r of the 16-row block a
//      and columns j of block b <= a, exp(Γ_r − Γ_j) = e^{Γr−Γm_a}·e^{Γm_a−Γj} with m_a the
//      middle row of block a, so no factor exceeds e^{8·|lb|} (§7.3, needs |lb| <= 10) and
//      no operand copy is kept in shared memory;
//   D. Q⊙e^Γ, K⊙e^{Γn−Γ}, e^{Γn} to the workspace, β⊙K⊙e^Γ in place over k; meanwhile four
//      warps invert the diagonal 16 x 16 blocks of L = A_kk (forward substitution, fp32);
//   E. the off-diagonal blocks of Linv = (I + A_kk)^{-1} block-row by block-row, in place
//      (a thread per 4 adjacent columns);
//   F. W = Linv·(β⊙K⊙e^Γ), U = Linv·(β⊙V) on tensor cores.
#pragma once

#include "k3/kda/chunk.cuh"

namespace k3 {
namespace kda {

constexpr int kPrepThreads = 256;
constexpr int kPrepWarps = kPrepThreads / 32;
constexpr int kLA = 68;  // fp32 row stride of L / Linv

// Shared memory of the prepare kernel, byte offsets. Row strides are chosen so that the
// fragment-pattern reads (8 rows x 4 lanes) and the ldmatrix row fetches hit distinct banks.
template <int D, int W>
struct PrepareLayout {
  static constexpr int LQ = 3 * D + 8;  // bf16 rows of q|k|v
  static constexpr int LG = D + 8;      // fp32 rows of Γ
  static constexpr int LAB = kChunk + 8;  // bf16 rows of Linv
  // [64 + W-1][LQ] bf16: raw q|k|v rows (from token t0-(W-1)), then in rows 0..63 the conv
  // outputs q, k, β⊙V; later β⊙K⊙e^Γ over k
  static constexpr int QKV = 0;
  // [64][LG] fp32 Γ; then the scratch of step E; then the bf16 Linv [64][LAB]
  static constexpr int G = ((kChunk + W - 1) * LQ * 2 + 15) / 16 * 16;
  static constexpr int LR = G + kChunk * LG * 4;  // raw gate [64][D] bf16, then L / Linv [64][kLA] fp32
  static constexpr int LR_BYTES = kChunk * D * 2 > kChunk * kLA * 4 ? kChunk * D * 2 : kChunk * kLA * 4;
  static constexpr int BETA = LR + LR_BYTES;  // [64] fp32 β
  static constexpr int QN = BETA + kChunk * 4;  // [64] fp32 q row factors (l2-norm and scale)
  static constexpr int KN = QN + kChunk * 4;    // [64] fp32 k row factors
  static constexpr size_t BYTES = KN + kChunk * 4;
  static_assert(3 * 256 * 4 <= kChunk * LG * 4 && kChunk * LAB * 2 <= kChunk * LG * 4,
                "Linv scratch and bf16 Linv fit the Γ region");
};

// Stage rows t0-(W-1) .. t0+n-1 of `width` consecutive channels from `ch0` (multiples of
// 8) into dst[row * stride + channel]; rows before the sequence come from the conv state.
// cp.async, so that all of a thread's copies are in flight at once (a plain load + store
// per piece waits for each load before the next is issued).
template <int W>
__device__ __forceinline__ void stage_rows(const Params& p, __nv_bfloat16* dst, int stride,
                                           int width, int ch0, int P3, int t0, int n, int bos,
                                           int slot, bool continues) {
  for (int idx = threadIdx.x; idx < (n + W - 1) * (width / 8); idx += kPrepThreads) {
    const int rho = idx / (width / 8), c = (idx % (width / 8)) * 8;
    const int s = t0 - (W - 1) + rho;
    __nv_bfloat16* d = dst + rho * stride + c;
    if (s >= bos) {
      cp_async16(d, p.qkv + (int64_t)s * P3 + ch0 + c);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e)
        d[e] = __float2bfloat16_rn(conv_input<W>(p, P3, s, bos, ch0 + c + e, slot, continues));
    }
  }
}

// Sequence of global chunk `index`: the last b with starts[b] <= index.
__device__ __forceinline__ int chunk_sequence(const int* starts, int num_seqs, int index) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (starts[mid] <= index) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ float2 load_bf16x2(const __nv_bfloat16* x) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(x));
}

__device__ __forceinline__ uint32_t bf16x2_bits(float lo, float hi) {
  const __nv_bfloat162 v = pack_bf16(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// One B-fragment pair of A_qk / A_kk: bf16 of x[c..c+1]·s·2^{Γm[c..c+1] − Γ[c..c+1]}, where x
// is a k conv output (bf16), s its row factor and Γm the Γ row of the middle of block a
// (the column side e^{Γm_a−Γj}).
__device__ __forceinline__ uint32_t column_pair(const __nv_bfloat16* x, const float* g, float2 gm, float s) {
  const float2 v = load_bf16x2(x), gv = *reinterpret_cast<const float2*>(g);
  return bf16x2_bits(v.x * s * fast_exp2(gm.x - gv.x), v.y * s * fast_exp2(gm.y - gv.y));
}

// x·σ(x) for the conv outputs. σ(x) = ½ + ½·tanh(x/2): one MUFU operation instead of two
// (ex2 and rcp), and the conv stage issues four per row and channel pair. tanh.approx has a
// relative error of ~2^-11, a quarter of the bf16 rounding step of the result (the decode
// kernel keeps the accurate sigmoid). The ex2/rcp form took 1-2% longer over the whole
// prefill (session 13: 4.584 vs 4.552 ms at T16384 x 96 heads, bench/NOTES_kda.md).
__device__ __forceinline__ float fast_silu(float x) {
  const float h = 0.5f * x;
  float th;
  asm("tanh.approx.f32 %0, %1;" : "=f"(th) : "f"(h));
  return fmaf(h, th, h);
}

// Row-side factor pair 2^{Γ[c..c+1] − Γm[c..c+1]} (Γ row g, Γ of the block middle gm).
__device__ __forceinline__ float2 row_factor(const float* g, float2 gm) {
  const float2 gv = *reinterpret_cast<const float2*>(g);
  return make_float2(fast_exp2(gv.x - gm.x), fast_exp2(gv.y - gm.y));
}

// bf16x2 of x[c..c+1]·s·e (x a conv output, s its row factor, e the exponential factors).
__device__ __forceinline__ uint32_t scaled_by(const __nv_bfloat16* x, float s, float2 e) {
  const float2 v = load_bf16x2(x);
  return bf16x2_bits(v.x * s * e.x, v.y * s * e.y);
}

// Stage A's per-thread constants: the conv taps of channel pair `pair` (pairs 0..3D/2-1 of
// q|k|v), or for a gate pair dt_bias of its two channels in w0[0], w1[0]. Loaded at the start
// of the kernel, so that their global round trip overlaps the staging copies.
template <int W>
struct PairTaps {
  float w0[W], w1[W];
};

template <int D, int W>
__device__ __forceinline__ PairTaps<W> load_pair_taps(const Params& p, int pair, int h) {
  PairTaps<W> t{};
  if (pair < 3 * D / 2) {
    const int c = 2 * pair, part = c / D;
    const int64_t ch = (int64_t)part * p.num_heads * D + h * D + c % D;
#pragma unroll
    for (int i = 0; i < W; ++i) {
      t.w0[i] = p.conv_weight[ch * W + i];
      t.w1[i] = p.conv_weight[(ch + 1) * W + i];
    }
  } else if (pair < 2 * D) {
    const int c = 2 * (pair - 3 * D / 2);
    t.w0[0] = p.dt_bias[h * D + c];
    t.w1[0] = p.dt_bias[h * D + c + 1];
  }
  return t;
}

// Stage A (conv channels): the thread's channel pair c, c+1 of q|k|v walks the 64 rows; the
// output of row r replaces staged row r, whose raw value the walk has already read.
template <int D, int W>
__device__ __forceinline__ void conv_pair(__nv_bfloat16* sQKV, const float* sBeta, const PairTaps<W>& taps,
                                          int pair, int n) {
  constexpr int LQ = PrepareLayout<D, W>::LQ;
  const int c = 2 * pair, part = c / D;  // 0: q, 1: k, 2: v
  const float* w0 = taps.w0;
  const float* w1 = taps.w1;
  __nv_bfloat16* col = sQKV + c;
  float2 hist[W - 1];
#pragma unroll
  for (int i = 0; i < W - 1; ++i) hist[i] = load_bf16x2(col + i * LQ);
  for (int r0 = 0; r0 < kChunk; r0 += 8) {
    float2 x[8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
      x[i] = r0 + i < n ? load_bf16x2(col + (r0 + i + W - 1) * LQ) : make_float2(0.f, 0.f);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = r0 + i;
      float a0 = 0.f, a1 = 0.f;
#pragma unroll
      for (int j = 0; j < W - 1; ++j) {
        a0 += w0[j] * hist[j].x;
        a1 += w1[j] * hist[j].y;
      }
      a0 += w0[W - 1] * x[i].x;
      a1 += w1[W - 1] * x[i].y;
#pragma unroll
      for (int j = 0; j + 1 < W - 1; ++j) hist[j] = hist[j + 1];
      hist[W - 2] = x[i];
      // q, k: one rounding to bf16 (the model's) straight into the packed pair; v: the bf16
      // value times β, rounded again (β⊙V is an operand)
      float y0 = fast_silu(a0), y1 = fast_silu(a1);
      if (part == 2) {
        y0 = round_bf16(y0) * sBeta[r];
        y1 = round_bf16(y1) * sBeta[r];
      }
      if (r >= n) y0 = y1 = 0.f;
      *reinterpret_cast<__nv_bfloat162*>(col + r * LQ) = pack_bf16(y0, y1);
    }
  }
}

// Stage A (gate channels): gate of channels c, c+1 in log2 units, summed along the chunk
// into Γ (rows past the end add nothing). The chunked path runs only with a lower bound
// (lb·σ(a·z)); the sigmoid uses the intrinsics (Γ stays fp32, a few ulp).
template <int D, int W>
__device__ __forceinline__ void gate_pair(const Params& p, const __nv_bfloat16* sGraw, float* sG,
                                          const PairTaps<W>& taps, int pair, float a_h, int n) {
  constexpr int LG = D + 8;
  const int c = 2 * pair;
  const float b0 = taps.w0[0], b1 = taps.w1[0];
  const float lb2 = p.lower_bound * kLog2e;
  float run0 = 0.f, run1 = 0.f;
  for (int r0 = 0; r0 < kChunk; r0 += 8) {
    float2 x[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = r0 + i < n ? load_bf16x2(sGraw + (r0 + i) * D + c) : make_float2(0.f, 0.f);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (r0 + i < n) {
        run0 += lb2 * fast_sigmoid(a_h * (x[i].x + b0));
        run1 += lb2 * fast_sigmoid(a_h * (x[i].y + b1));
      }
      *reinterpret_cast<float2*>(sG + (r0 + i) * LG + c) = make_float2(run0, run1);
    }
  }
}

template <int D, int W>
__global__ void __launch_bounds__(kPrepThreads, 2)
    chunk_prepare_kernel(Params p, __nv_bfloat16* work, const int* starts) {
  static_assert(D == 32 || D == 64 || D == 128, "head_dim 32, 64 or 128");
  static_assert(W >= 2 && W <= 4, "conv width 2-4");
  using Lay = PrepareLayout<D, W>;
  using Work = ChunkWork<D>;
  constexpr int LQ = Lay::LQ, LG = Lay::LG, LAB = Lay::LAB, LA = kLA;
  extern __shared__ __align__(16) unsigned char smem[];
  __nv_bfloat16* sQKV = reinterpret_cast<__nv_bfloat16*>(smem + Lay::QKV);
  float* sG = reinterpret_cast<float*>(smem + Lay::G);
  float* sT = sG;  // Linv scratch once Γ is no longer read, then the bf16 Linv
  __nv_bfloat16* sLinvB = reinterpret_cast<__nv_bfloat16*>(smem + Lay::G);
  __nv_bfloat16* sGraw = reinterpret_cast<__nv_bfloat16*>(smem + Lay::LR);
  float* sL = reinterpret_cast<float*>(smem + Lay::LR);  // L, then Linv in place
  float* sBeta = reinterpret_cast<float*>(smem + Lay::BETA);
  float* sQn = reinterpret_cast<float*>(smem + Lay::QN);
  float* sKn = reinterpret_cast<float*>(smem + Lay::KN);
  __nv_bfloat16* sQ = sQKV;           // conv outputs, rows 0..63
  __nv_bfloat16* sK = sQKV + D;       // then β⊙K⊙e^Γ
  __nv_bfloat16* sBV = sQKV + 2 * D;  // β⊙V

  const int chunk = blockIdx.x, h = blockIdx.y;
  if (chunk >= starts[p.num_seqs]) return;
  const int b = chunk_sequence(starts, p.num_seqs, chunk);
  const int bos = p.cu_seqlens[b], eos = p.cu_seqlens[b + 1];
  const int t0 = bos + (chunk - starts[b]) * kChunk, n = min(kChunk, eos - t0);
  const int H = p.num_heads, P = H * D, P3 = 3 * P;
  const int slot = p.state_slots[b];
  const bool continues = p.has_initial_state[b] != 0;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  __nv_bfloat16* out = work + ((int64_t)chunk * H + h) * Work::ELEMS;
  const float a_h = expf(p.A_log[h]);
  static_assert(2 * D <= kPrepThreads, "one channel pair (q|k|v or gate) per thread");
  const PairTaps<W> taps = load_pair_taps<D, W>(p, tid, h);

  // ---- 0. stage the raw inputs (16-byte copies, all in flight at once) ----
#pragma unroll
  for (int part = 0; part < 3; ++part)
    stage_rows<W>(p, sQKV + part * D, LQ, D, part * P + h * D, P3, t0, n, bos, slot, continues);
  for (int idx = tid; idx < n * (D / 8); idx += kPrepThreads) {
    const int r = idx / (D / 8), c = (idx % (D / 8)) * 8;
    cp_async16(sGraw + r * D + c, p.gate + (int64_t)(t0 + r) * P + h * D + c);
  }
  cp_async_commit();
  if (tid < kChunk)
    sBeta[tid] = tid < n ? sigmoid(__bfloat162float(p.beta[(int64_t)(t0 + tid) * H + h])) : 0.f;
  cp_async_wait_all();
  __syncthreads();

  // ---- A. conv + SiLU of q, k, v (in place), Γ; then the row norms of q, k ----
  if (tid < 3 * D / 2) conv_pair<D, W>(sQKV, sBeta, taps, tid, n);
  else if (tid < 2 * D) gate_pair<D, W>(p, sGraw, sG, taps, tid - 3 * D / 2, a_h, n);
  __syncthreads();
  {
    const float scale = rsqrtf((float)D);
    for (int r = warp; r < kChunk; r += kPrepWarps) {
      float ssq = 0.f, ssk = 0.f;
#pragma unroll
      for (int c = 2 * lane; c < D; c += 64) {
        const float2 q = load_bf16x2(sQ + r * LQ + c), k = load_bf16x2(sK + r * LQ + c);
        ssq += q.x * q.x + q.y * q.y;
        ssk += k.x * k.x + k.y * k.y;
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        ssq += __shfl_xor_sync(0xffffffffu, ssq, o);
        ssk += __shfl_xor_sync(0xffffffffu, ssk, o);
      }
      if (lane == 0) {
        sQn[r] = rsqrtf(ssq + kL2Eps) * scale;
        sKn[r] = rsqrtf(ssk + kL2Eps);
      }
    }
  }
  __syncthreads();

  // ---- C. A_qk (j <= r) to the workspace, A_kk = β_r·(...) (j < r) to sL ----
  // Warp units (row block a, column blocks cb0..cb0+ncb-1) of both products: q̂ and k̂ rows of
  // block a share the row-side factors e^{Γr−Γm_a}, and every B fragment (k̂ rows of block cb,
  // scaled by e^{Γm_a−Γj}) serves both. 7 units, at most 2 x 8 of exp2 per lane and k-step,
  // spread so that each SM sub-partition (warps w, w+4) gets the same number.
  if (warp < 7) {
    const int a = warp < 2 ? 3 : warp < 4 ? 2 : warp < 6 ? 1 : 0;
    const int cb0 = (warp & 1) ? (a >= 2 ? 2 : 1) : 0;
    const int ncb = a >= 2 ? min(2, a + 1 - cb0) : 1;
    const int g = lane >> 2, t = lane & 3;
    const int ra = 16 * a + g, rb = ra + 8;
    const float qa = sQn[ra], qb = sQn[rb], ka = sKn[ra], kb = sKn[rb];
    const float* Gm = sG + (16 * a + 8) * LG;
    float kn[2][2];
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      kn[s][0] = sKn[16 * (cb0 + s) + g];
      kn[s][1] = sKn[16 * (cb0 + s) + 8 + g];
    }
    float acc[2][2][2][4] = {};  // [kind: qk, kk][unit column block][8-column half][fragment]
#pragma unroll 2
    for (int k0 = 0; k0 < D; k0 += 16) {
      const int c0 = k0 + 2 * t, c1 = c0 + 8;
      const float2 m0 = *reinterpret_cast<const float2*>(Gm + c0);
      const float2 m1 = *reinterpret_cast<const float2*>(Gm + c1);
      const float2 e0 = row_factor(sG + ra * LG + c0, m0), e1 = row_factor(sG + rb * LG + c0, m0);
      const float2 e2 = row_factor(sG + ra * LG + c1, m1), e3 = row_factor(sG + rb * LG + c1, m1);
      uint32_t aq[4], ak[4];
      aq[0] = scaled_by(sQ + ra * LQ + c0, qa, e0);
      aq[1] = scaled_by(sQ + rb * LQ + c0, qb, e1);
      aq[2] = scaled_by(sQ + ra * LQ + c1, qa, e2);
      aq[3] = scaled_by(sQ + rb * LQ + c1, qb, e3);
      ak[0] = scaled_by(sK + ra * LQ + c0, ka, e0);
      ak[1] = scaled_by(sK + rb * LQ + c0, kb, e1);
      ak[2] = scaled_by(sK + ra * LQ + c1, ka, e2);
      ak[3] = scaled_by(sK + rb * LQ + c1, kb, e3);
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        if (s >= ncb) continue;
        const int j0 = 16 * (cb0 + s) + g, j1 = j0 + 8;
        uint32_t bf[4];
        bf[0] = column_pair(sK + j0 * LQ + c0, sG + j0 * LG + c0, m0, kn[s][0]);
        bf[1] = column_pair(sK + j0 * LQ + c1, sG + j0 * LG + c1, m1, kn[s][0]);
        bf[2] = column_pair(sK + j1 * LQ + c0, sG + j1 * LG + c0, m0, kn[s][1]);
        bf[3] = column_pair(sK + j1 * LQ + c1, sG + j1 * LG + c1, m1, kn[s][1]);
        mma_16x16(acc[0][s], aq, bf);
        mma_16x16(acc[1][s], ak, bf);
      }
    }
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      if (s >= ncb) continue;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = 16 * a + acc_row(2 * half), j = 16 * (cb0 + s) + 8 * nt + acc_col(0);
          const float q0 = acc[0][s][nt][2 * half], q1 = acc[0][s][nt][2 * half + 1];
          const float k0 = acc[1][s][nt][2 * half], k1 = acc[1][s][nt][2 * half + 1];
          *reinterpret_cast<__nv_bfloat162*>(out + Work::AQK + r * kChunk + j) =
              pack_bf16(j <= r ? q0 : 0.f, j + 1 <= r ? q1 : 0.f);
          sL[r * LA + j] = j < r ? k0 * sBeta[r] : 0.f;
          sL[r * LA + j + 1] = j + 1 < r ? k1 * sBeta[r] : 0.f;
        }
    }
  }
  __syncthreads();

  // ---- D1. diagonal blocks of Linv, in place over L (warps 0-3; a lane owns a column) ----
  if (warp < 4) {
    // column c of the inverse; rows above c stay 0, so the sums may run over all j < r
    const int c = lane & 15;
    float* Lb = sL + 16 * warp * LA + 16 * warp;
    float Xc[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      float x = r == c ? 1.f : 0.f;
#pragma unroll
      for (int j = 0; j < r; ++j) x -= Lb[r * LA + j] * Xc[j];
      Xc[r] = x;
    }
    __syncwarp();  // every lane has read the block
    if (lane < 16) {
#pragma unroll
      for (int r = 0; r < 16; ++r) Lb[r * LA + c] = Xc[r];
    }
  }

  // ---- D2. Q⊙e^Γ, K⊙e^{Γn−Γ}, e^{Γn} to the workspace; β⊙K⊙e^Γ over k ----
  for (int idx = tid; idx < kChunk * (D / 8); idx += kPrepThreads) {
    const int r = idx / (D / 8), c = (idx % (D / 8)) * 8;
    const uint4 qraw = *reinterpret_cast<const uint4*>(sQ + r * LQ + c);
    const uint4 kraw = *reinterpret_cast<const uint4*>(sK + r * LQ + c);
    const __nv_bfloat162* q2 = reinterpret_cast<const __nv_bfloat162*>(&qraw);
    const __nv_bfloat162* k2 = reinterpret_cast<const __nv_bfloat162*>(&kraw);
    const float* gr = sG + r * LG + c;
    const float* gn = sG + (kChunk - 1) * LG + c;
    const float qn = sQn[r], kn = sKn[r], beta = sBeta[r];
    uint4 qe, kd, kb;
    uint32_t* qe2 = reinterpret_cast<uint32_t*>(&qe);
    uint32_t* kd2 = reinterpret_cast<uint32_t*>(&kd);
    uint32_t* kb2 = reinterpret_cast<uint32_t*>(&kb);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 qv = __bfloat1622float2(q2[e]), kv = __bfloat1622float2(k2[e]);
      const float2 g = *reinterpret_cast<const float2*>(gr + 2 * e);
      const float2 gl = *reinterpret_cast<const float2*>(gn + 2 * e);
      const float q0 = qv.x * qn, q1 = qv.y * qn, k0 = kv.x * kn, k1 = kv.y * kn;
      const float e0 = fast_exp2(g.x), e1 = fast_exp2(g.y);
      qe2[e] = bf16x2_bits(q0 * e0, q1 * e1);
      kd2[e] = bf16x2_bits(k0 * fast_exp2(gl.x - g.x), k1 * fast_exp2(gl.y - g.y));
      kb2[e] = bf16x2_bits(beta * k0 * e0, beta * k1 * e1);
    }
    *reinterpret_cast<uint4*>(out + Work::QE + r * D + c) = qe;
    *reinterpret_cast<uint4*>(out + Work::KD + r * D + c) = kd;
    *reinterpret_cast<uint4*>(sK + r * LQ + c) = kb;
  }
  if (tid < D) reinterpret_cast<float*>(out + Work::DECAY)[tid] = fast_exp2(sG[(kChunk - 1) * LG + tid]);
  __syncthreads();

  // ---- E. off-diagonal blocks: Linv_ab = −Linv_aa · Σ_{c=b}^{a−1} L_ac · Linv_cb, in place
  // (round a reads L only in its block row a, before the second half overwrites it). A thread
  // computes 4 adjacent columns (a float4 of the right operand per k, one scalar of the left):
  // 2 shared loads per 4 FMAs instead of 8, and 4 independent sums; the k order of every sum
  // is unchanged (session 13 measured it against one output per thread, bench/NOTES_kda.md). ----
  static_assert(LA % 4 == 0, "float4 rows of L");
  for (int a = 1; a < 4; ++a) {
    // unit = (column block bb, row i, 4 columns j..j+3); a·64 units, at most 192 threads
    const int bb = tid / 64, i = (tid / 4) % 16, j = 4 * (tid % 4);
    if (bb < a) {
      const float* lrow = sL + (16 * a + i) * LA;
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int k0 = 16 * bb; k0 < 16 * a; k0 += 16)
#pragma unroll
        for (int k = k0; k < k0 + 16; ++k) {
          const float l = lrow[k];
          const float4 x = *reinterpret_cast<const float4*>(sL + k * LA + 16 * bb + j);
          acc.x += l * x.x, acc.y += l * x.y, acc.z += l * x.z, acc.w += l * x.w;
        }
      *reinterpret_cast<float4*>(sT + bb * 256 + i * 16 + j) = acc;
    }
    __syncthreads();
    if (bb < a) {
      const float* lrow = sL + (16 * a + i) * LA + 16 * a;
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        const float l = lrow[k];
        const float4 x = *reinterpret_cast<const float4*>(sT + bb * 256 + k * 16 + j);
        acc.x += l * x.x, acc.y += l * x.y, acc.z += l * x.z, acc.w += l * x.w;
      }
      *reinterpret_cast<float4*>(sL + (16 * a + i) * LA + 16 * bb + j) =
          make_float4(-acc.x, -acc.y, -acc.z, -acc.w);
    }
    __syncthreads();
  }
  // the bf16 copy for step F (blocks above the diagonal are never read)
  for (int idx = tid; idx < kChunk * kChunk / 2; idx += kPrepThreads) {
    const int r = idx / (kChunk / 2), j = 2 * (idx % (kChunk / 2));
    if (j / 16 <= r / 16)
      *reinterpret_cast<__nv_bfloat162*>(sLinvB + r * LAB + j) = pack_bf16(sL[r * LA + j], sL[r * LA + j + 1]);
  }
  __syncthreads();

  // ---- F. W = Linv·Kb, U = Linv·βV: units of 16 rows x 16 columns ----
  constexpr int NB = D / 16;
  for (int u = warp; u < 4 * 2 * NB; u += kPrepWarps) {
    const int mt = u / (2 * NB), which = (u / NB) % 2, nb = u % NB;
    const __nv_bfloat16* B = which ? sBV : sK;
    float acc[2][4] = {};
    for (int k0 = 0; k0 <= 16 * mt; k0 += 16) {
      uint32_t af[4], bfr[4];
      load_a(af, sLinvB, LAB, 16 * mt, k0);
      load_b_kn(bfr, B, LQ, k0, 16 * nb);
      mma_16x16(acc, af, bfr);
    }
    __nv_bfloat16* dst = out + (which ? Work::U : Work::W);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 16 * mt + acc_row(2 * half), col = 16 * nb + 8 * nt + acc_col(0);
        *reinterpret_cast<__nv_bfloat162*>(dst + r * D + col) =
            pack_bf16(acc[nt][2 * half], acc[nt][2 * half + 1]);
      }
  }
}

}  // namespace kda
}  // namespace k3
