// chunk_prepare_kernel: one CTA per (chunk, head), everything of a chunk that does not depend
// on the state (chunk.cuh has the overview).
//   0. conv + SiLU (bf16) of q, k, v, l2-norm of q, k, gate (log2 units), beta;
//   1. Γ = cumulative log2-decay along the chunk;
//   2. bf16 operands, then A_qk, A_kk (64 x 64, causal) on tensor cores. For rows r of the
//      16-row block a and columns j of block b <= a, exp(Γ_r − Γ_j) is split around the
//      middle rows m_a, m_b of the blocks: e^{Γ_r−Γ_{m_a}} on the row side,
//      e^{Γ_{m_a}−Γ_{m_b}}·e^{Γ_{m_b}−Γ_j} on the column side, so no factor exceeds
//      e^{8·|lb|} (§7.3, needs |lb| <= 10) and the fills are products of per-row and
//      per-block factors rather than one exponential per (row, column, channel);
//   3. Linv = (I + A_kk)^{-1} in fp32: 16 x 16 diagonal blocks by forward substitution,
//      then the off-diagonal blocks block-row by block-row;
//   4. W = Linv·(β⊙K⊙e^Γ), U = Linv·(β⊙V) on tensor cores.
#pragma once

#include "k3/kda/chunk.cuh"

namespace k3 {
namespace kda {

constexpr int kPrepThreads = 512;
constexpr int kPrepWarps = kPrepThreads / 32;
constexpr int kLA = 68;  // fp32 row stride of the 64 x 64 matrices of step 3

// Shared memory of the prepare kernel, byte offsets. Row strides are padded so that the
// fp32 column walks and the ldmatrix row fetches hit distinct banks.
template <int D>
struct PrepareLayout {
  static constexpr int LD = D + 4;          // fp32 rows of q̂, k̂, Γ
  static constexpr int LB = D + 8;          // bf16 operand rows
  static constexpr int LAB = kChunk + 8;    // bf16 rows of Linv
  // region 1: q̂, k̂, Γ (fp32) up to step 2's fills; then L, Linv, Linv (bf16), block products
  static constexpr int Q = 0;
  static constexpr int K = Q + kChunk * LD * 4;
  static constexpr int G = K + kChunk * LD * 4;
  static constexpr int L = 0;
  static constexpr int LINV = L + kChunk * kLA * 4;
  static constexpr int LINV_BF = LINV + kChunk * kLA * 4;
  static constexpr int TMP = LINV_BF + kChunk * LAB * 2;
  static constexpr int R1 = (G + kChunk * LD * 4 > TMP + 3 * 256 * 4) ? G + kChunk * LD * 4
                                                                       : TMP + 3 * 256 * 4;
  // region 2: the raw inputs (bf16) during step 0, then step 2's operands:
  // X = per block a: 16 rows q̂⊙e^{Γr−Γm_a}, 16 rows k̂⊙e^{Γr−Γm_a};
  // Y = per block a, rows j < 16(a+1) from row 8a(a+1): k̂⊙e^{Γm_a−Γj}
  static constexpr int X = R1;
  static constexpr int Y = X + 4 * 32 * LB * 2;
  static constexpr int R2 = Y + 160 * LB * 2;
  static constexpr int QKRAW = X;                              // [64 + W-1][2D] q|k
  static constexpr int VRAW = QKRAW + (kChunk + 3) * 2 * D * 2;  // [64 + W-1][D]
  static constexpr int GRAW = VRAW + (kChunk + 3) * D * 2;     // [64][D]
  static_assert(GRAW + kChunk * D * 2 <= R2, "staging fits the operand region");
  static constexpr int BV = R2;                   // [64][LB] bf16 β ⊙ V
  static constexpr int KB = BV + kChunk * LB * 2;  // [64][LB] bf16 β ⊙ K ⊙ e^Γ
  static constexpr int BETA = KB + kChunk * LB * 2;
  static constexpr int TOT = BETA + kChunk * 4;
  static constexpr size_t BYTES = TOT + kPrepThreads * 4;
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

template <int D, int W>
__global__ void __launch_bounds__(kPrepThreads, 1)
    chunk_prepare_kernel(Params p, __nv_bfloat16* work, const int* starts) {
  static_assert(D == 32 || D == 64 || D == 128, "head_dim 32, 64 or 128");
  static_assert(W >= 2 && W <= 4, "conv width 2-4");
  using Lay = PrepareLayout<D>;
  using Work = ChunkWork<D>;
  constexpr int LD = Lay::LD, LB = Lay::LB, LAB = Lay::LAB, LA = kLA;
  extern __shared__ __align__(16) unsigned char smem[];
  float* sQ = reinterpret_cast<float*>(smem + Lay::Q);
  float* sK = reinterpret_cast<float*>(smem + Lay::K);
  float* sG = reinterpret_cast<float*>(smem + Lay::G);
  float* sL = reinterpret_cast<float*>(smem + Lay::L);
  float* sLinv = reinterpret_cast<float*>(smem + Lay::LINV);
  __nv_bfloat16* sLinvB = reinterpret_cast<__nv_bfloat16*>(smem + Lay::LINV_BF);
  float* sT = reinterpret_cast<float*>(smem + Lay::TMP);
  __nv_bfloat16* sX = reinterpret_cast<__nv_bfloat16*>(smem + Lay::X);
  __nv_bfloat16* sY = reinterpret_cast<__nv_bfloat16*>(smem + Lay::Y);
  __nv_bfloat16* sQKraw = reinterpret_cast<__nv_bfloat16*>(smem + Lay::QKRAW);
  __nv_bfloat16* sVraw = reinterpret_cast<__nv_bfloat16*>(smem + Lay::VRAW);
  __nv_bfloat16* sGraw = reinterpret_cast<__nv_bfloat16*>(smem + Lay::GRAW);
  __nv_bfloat16* sBV = reinterpret_cast<__nv_bfloat16*>(smem + Lay::BV);
  __nv_bfloat16* sKB = reinterpret_cast<__nv_bfloat16*>(smem + Lay::KB);
  float* sBeta = reinterpret_cast<float*>(smem + Lay::BETA);
  float* sTot = reinterpret_cast<float*>(smem + Lay::TOT);

  if ((int)blockIdx.x >= starts[p.num_seqs]) return;
  const int b = chunk_sequence(starts, p.num_seqs, blockIdx.x);
  const int bos = p.cu_seqlens[b], eos = p.cu_seqlens[b + 1];
  const int t0 = bos + (blockIdx.x - starts[b]) * kChunk, n = min(kChunk, eos - t0);
  const int h = blockIdx.y;
  const int H = p.num_heads, P = H * D, P3 = 3 * P;
  const int slot = p.state_slots[b];
  const bool continues = p.has_initial_state[b] != 0;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  __nv_bfloat16* out = work + ((int64_t)blockIdx.x * H + h) * Work::ELEMS;
  const float a_h = expf(p.A_log[h]);
  const float scale = rsqrtf((float)D);

  // ---- 0a. stage the raw inputs (16-byte loads, all in flight at once) ----
  stage_rows<W>(p, sQKraw, 2 * D, D, h * D, P3, t0, n, bos, slot, continues);
  stage_rows<W>(p, sQKraw + D, 2 * D, D, P + h * D, P3, t0, n, bos, slot, continues);
  stage_rows<W>(p, sVraw, D, D, 2 * P + h * D, P3, t0, n, bos, slot, continues);
  for (int idx = tid; idx < n * (D / 8); idx += kPrepThreads) {
    const int r = idx / (D / 8), c = (idx % (D / 8)) * 8;
    cp_async16(sGraw + r * D + c, p.gate + (int64_t)(t0 + r) * P + h * D + c);
  }
  cp_async_commit();
  if (tid < kChunk)
    sBeta[tid] = tid < n ? sigmoid(__bfloat162float(p.beta[(int64_t)(t0 + tid) * H + h])) : 0.f;
  float wq[D / 32][W], wk[D / 32][W], wv[D / 32][W];  // this lane's conv taps
#pragma unroll
  for (int j = 0; j < D / 32; ++j)
#pragma unroll
    for (int i = 0; i < W; ++i) {
      const int ch = h * D + lane + 32 * j;
      wq[j][i] = p.conv_weight[(int64_t)ch * W + i];
      wk[j][i] = p.conv_weight[(int64_t)(P + ch) * W + i];
      wv[j][i] = p.conv_weight[(int64_t)(2 * P + ch) * W + i];
    }
  cp_async_wait_all();
  __syncthreads();

  // ---- 0b. conv + SiLU (bf16) of q, k, v; l2-norm of q, k; gate in log2 units ----
  for (int r = warp; r < kChunk; r += kPrepWarps) {
    float qv[D / 32], kv[D / 32];
    float ssq = 0.f, ssk = 0.f;
#pragma unroll
    for (int j = 0; j < D / 32; ++j) {
      const int c = lane + 32 * j;
      float g = 0.f, aq = 0.f, ak = 0.f, av = 0.f;
      if (r < n) {
#pragma unroll
        for (int i = 0; i < W; ++i) {
          aq += wq[j][i] * __bfloat162float(sQKraw[(r + i) * 2 * D + c]);
          ak += wk[j][i] * __bfloat162float(sQKraw[(r + i) * 2 * D + D + c]);
          av += wv[j][i] * __bfloat162float(sVraw[(r + i) * D + c]);
        }
        aq = round_bf16(aq * fast_sigmoid(aq));
        ak = round_bf16(ak * fast_sigmoid(ak));
        av = av * fast_sigmoid(av);
        g = decay_gate(__bfloat162float(sGraw[r * D + c]) + p.dt_bias[h * D + c], a_h,
                       p.lower_bound) * kLog2e;
      }
      sBV[r * LB + c] = __float2bfloat16_rn(sBeta[r] * round_bf16(av));
      qv[j] = aq;
      kv[j] = ak;
      sG[r * LD + c] = g;
      ssq += aq * aq;
      ssk += ak * ak;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      ssq += __shfl_xor_sync(0xffffffffu, ssq, o);
      ssk += __shfl_xor_sync(0xffffffffu, ssk, o);
    }
    const float qn = rsqrtf(ssq + kL2Eps) * scale, kn = rsqrtf(ssk + kL2Eps);
#pragma unroll
    for (int j = 0; j < D / 32; ++j) {
      sQ[r * LD + lane + 32 * j] = qv[j] * qn;
      sK[r * LD + lane + 32 * j] = kv[j] * kn;
    }
  }
  __syncthreads();

  // ---- 1. Γ: inclusive cumulative sum along the chunk, per key channel ----
  {
    constexpr int kParts = kPrepThreads / D, kRows = kChunk / kParts;
    const int c = tid % D, part = tid / D;
    float run = 0.f;
    for (int i = 0; i < kRows; ++i) {
      float* x = &sG[(part * kRows + i) * LD + c];
      run += *x;
      *x = run;
    }
    sTot[part * D + c] = run;
    __syncthreads();
    float pre = 0.f;
    for (int pp = 0; pp < part; ++pp) pre += sTot[pp * D + c];
    for (int i = 0; i < kRows; ++i) sG[(part * kRows + i) * LD + c] += pre;
    __syncthreads();
  }

  // ---- 2a. bf16 operands; Q⊙e^Γ, K⊙e^{Γn−Γ} and e^{Γn} straight to the workspace ----
  {
    // a thread owns one channel of D/8 consecutive rows (all in one 16-row block bb)
    constexpr int RPT = kChunk * D / kPrepThreads;
    const int c = tid % D, r0 = (tid / D) * RPT, bb = r0 / 16;
    const float gm = sG[(16 * bb + 8) * LD + c], gn = sG[(kChunk - 1) * LD + c];
    float cross[4];  // e^{Γm_a − Γm_bb} for the later blocks a (<= 1)
#pragma unroll
    for (int a = 0; a < 4; ++a) cross[a] = a > bb ? fast_exp2(sG[(16 * a + 8) * LD + c] - gm) : 1.f;
#pragma unroll 4
    for (int i = 0; i < RPT; ++i) {
      const int r = r0 + i;
      const float gr = sG[r * LD + c], q = sQ[r * LD + c], k = sK[r * LD + c];
      const float to_mid = fast_exp2(gr - gm), from_mid = k * fast_exp2(gm - gr);
      const float er = fast_exp2(gr);
      sX[(32 * bb + r - 16 * bb) * LB + c] = __float2bfloat16_rn(q * to_mid);
      sX[(32 * bb + 16 + r - 16 * bb) * LB + c] = __float2bfloat16_rn(k * to_mid);
#pragma unroll
      for (int a = 0; a < 4; ++a)
        if (a >= bb) sY[(8 * a * (a + 1) + r) * LB + c] = __float2bfloat16_rn(from_mid * cross[a]);
      sKB[r * LB + c] = __float2bfloat16_rn(sBeta[r] * k * er);
      out[Work::QE + r * D + c] = __float2bfloat16_rn(q * er);
      out[Work::KD + r * D + c] = __float2bfloat16_rn(k * fast_exp2(gn - gr));
    }
    if (tid < D) reinterpret_cast<float*>(out + Work::DECAY)[tid] = fast_exp2(sG[(kChunk - 1) * LD + tid]);
  }
  __syncthreads();

  // ---- 2b. A_qk (j <= r) to the workspace, A_kk = β_r·(...) (j < r) to sL ----
  // 20 units of 16 x 16: block a, kind (qk, kk), column block <= a
  for (int u = warp; u < 20; u += kPrepWarps) {
    const int a = u < 2 ? 0 : u < 6 ? 1 : u < 12 ? 2 : 3;
    const int v = u - a * (a + 1), kind = v / (a + 1), cb = v % (a + 1);
    const __nv_bfloat16* A = sX + (32 * a + 16 * kind) * LB;
    const __nv_bfloat16* B = sY + (8 * a * (a + 1) + 16 * cb) * LB;
    float acc[2][4] = {};
#pragma unroll
    for (int k0 = 0; k0 < D; k0 += 16) {
      uint32_t af[4], bfr[4];
      load_a(af, A, LB, 0, k0);
      load_b_nk(bfr, B, LB, k0, 0);
      mma_16x16(acc, af, bfr);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 16 * a + acc_row(2 * half), j = 16 * cb + 8 * nt + acc_col(0);
        const float x0 = acc[nt][2 * half], x1 = acc[nt][2 * half + 1];
        if (kind == 0) {
          *reinterpret_cast<__nv_bfloat162*>(out + Work::AQK + r * kChunk + j) =
              pack_bf16(j <= r ? x0 : 0.f, j + 1 <= r ? x1 : 0.f);
        } else {
          sL[r * LA + j] = j < r ? x0 * sBeta[r] : 0.f;
          sL[r * LA + j + 1] = j + 1 < r ? x1 * sBeta[r] : 0.f;
        }
      }
  }
  __syncthreads();

  // ---- 3a. diagonal blocks of Linv (warps 0-3; a lane owns a column, in registers) ----
  if (warp < 4 && lane < 16) {
    // column c of the inverse; rows above c stay 0, so the sums may run over all j < r
    const int a = warp, c = lane;
    const float* Lb = sL + 16 * a * LA + 16 * a;
    float Xc[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      float x = r == c ? 1.f : 0.f;
#pragma unroll
      for (int j = 0; j < r; ++j) x -= Lb[r * LA + j] * Xc[j];
      Xc[r] = x;
    }
#pragma unroll
    for (int r = 0; r < 16; ++r) sLinv[(16 * a + r) * LA + 16 * a + c] = Xc[r];
  }
  __syncthreads();

  // ---- 3b. off-diagonal blocks: Linv_ab = −Linv_aa · Σ_{c=b}^{a−1} L_ac · Linv_cb ----
  for (int a = 1; a < 4; ++a) {
    for (int idx = tid; idx < a * 256; idx += kPrepThreads) {
      const int bb = idx / 256, i = (idx / 16) % 16, j = idx % 16;
      float acc = 0.f;
      for (int k0 = 16 * bb; k0 < 16 * a; k0 += 16)
#pragma unroll
        for (int k = k0; k < k0 + 16; ++k)
          acc += sL[(16 * a + i) * LA + k] * sLinv[k * LA + 16 * bb + j];
      sT[idx] = acc;
    }
    __syncthreads();
    for (int idx = tid; idx < a * 256; idx += kPrepThreads) {
      const int bb = idx / 256, i = (idx / 16) % 16, j = idx % 16;
      float acc = 0.f;
#pragma unroll
      for (int k = 0; k < 16; ++k)
        acc += sLinv[(16 * a + i) * LA + 16 * a + k] * sT[bb * 256 + k * 16 + j];
      sLinv[(16 * a + i) * LA + 16 * bb + j] = -acc;
    }
    __syncthreads();
  }
  // the bf16 copy for step 4 (blocks above the diagonal are never read)
  for (int idx = tid; idx < kChunk * kChunk / 2; idx += kPrepThreads) {
    const int r = idx / (kChunk / 2), j = 2 * (idx % (kChunk / 2));
    if (j / 16 <= r / 16)
      *reinterpret_cast<__nv_bfloat162*>(sLinvB + r * LAB + j) =
          pack_bf16(sLinv[r * LA + j], sLinv[r * LA + j + 1]);
  }
  __syncthreads();

  // ---- 4. W = Linv·Kb, U = Linv·βV: units of 16 rows x 16 columns ----
  constexpr int NB = D / 16;
  for (int u = warp; u < 4 * 2 * NB; u += kPrepWarps) {
    const int mt = u / (2 * NB), which = (u / NB) % 2, nb = u % NB;
    const __nv_bfloat16* B = which ? sBV : sKB;
    float acc[2][4] = {};
    for (int k0 = 0; k0 <= 16 * mt; k0 += 16) {
      uint32_t af[4], bfr[4];
      load_a(af, sLinvB, LAB, 16 * mt, k0);
      load_b_kn(bfr, B, LB, k0, 16 * nb);
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
