// Chunked KDA prefill (spec §4.5.7, C = 64) with the short conv, gate, beta and q/k
// l2-norm fused in (§4.5.2-§4.5.5), in two kernels:
//
// chunk_prepare_kernel, one CTA per (chunk, head), all chunks at once: everything that does
// not depend on the state.
//   0. conv+SiLU (bf16) of q, k, v, l2-norm of q, k, gate, beta;
//   1. Γ = cumulative log2-decay along the chunk;
//   2. A_qk, A_kk (64 x 64, causal) on tensor cores. exp(Γ_r − Γ_j) is split as
//      exp(Γ_r − Γ_m)·exp(Γ_m − Γ_j) around a reference row m in the middle of the
//      16-row block of r, so every factor stays below e^{8·|lb|} (§7.3); needs |lb| <= 10;
//   3. Linv = (I + A_kk)^{-1}: 16 x 16 diagonal blocks by forward substitution, then the
//      off-diagonal blocks block-row by block-row;
//   and writes Q⊙e^Γ, β⊙K⊙e^Γ, K⊙e^{Γn−Γ}, β⊙V, A_qk, Linv, e^{Γn} to the workspace.
// chunk_walk_kernel, one CTA per (sequence, head, 32 value columns), walks the chunks with
// its D x 32 slice of the fp32 state in shared memory:
//   U' = Linv·(β⊙V − (β⊙K⊙e^Γ)·S),  O = (Q⊙e^Γ)·S + A_qk·U',  S ← e^{Γn}⊙S + (K⊙e^{Γn−Γ})ᵀ·U'.
#pragma once

#include "k3/kda/mma.cuh"
#include "k3/kda/params.cuh"

namespace k3 {
namespace kda {

constexpr int kChunk = 64;
constexpr int kChunkThreads = 512;
constexpr int kWarps = kChunkThreads / 32;
constexpr int kLA = 68;  // padded row stride of 64 x 64 matrices in shared memory

// Upper bound on the chunks of a varlen batch: Σ ceil(len/64) <= T/64 + B.
__host__ __device__ inline int max_chunks(int num_tokens, int num_seqs) {
  return (num_tokens + kChunk - 1) / kChunk + num_seqs;
}

// Workspace of one (chunk, head), in floats, row-major.
template <int D>
struct ChunkWork {
  static constexpr int QE = 0;                   // [64][D] Q ⊙ e^Γ
  static constexpr int KB = QE + kChunk * D;     // [64][D] β ⊙ K ⊙ e^Γ
  static constexpr int KD = KB + kChunk * D;     // [64][D] K ⊙ e^{Γn−Γ}
  static constexpr int BVAL = KD + kChunk * D;   // [64][D] β ⊙ V
  static constexpr int AQK = BVAL + kChunk * D;  // [64][64]
  static constexpr int LINV = AQK + kChunk * kChunk;
  static constexpr int DECAY = LINV + kChunk * kChunk;  // [D] e^{Γn}
  static constexpr int FLOATS = DECAY + D;
};

// Shared memory of the prepare kernel, in floats. Row strides are padded so that the mma
// fragment loads (8 rows x 4 columns per warp) hit distinct banks.
template <int D>
struct PrepareLayout {
  static constexpr int LD = D + 4;
  static constexpr int Q = 0;
  static constexpr int K = Q + kChunk * LD;
  static constexpr int G = K + kChunk * LD;
  static constexpr int Y = G + kChunk * LD;   // column operand of step 2
  static constexpr int X = Y + kChunk * LD;   // row operands of step 2, then Linv
  static constexpr int X_SIZE = (32 * LD > kChunk * kLA) ? 32 * LD : kChunk * kLA;
  static constexpr int AQK = X + X_SIZE;
  static constexpr int L = AQK + kChunk * kLA;
  static constexpr int TMP = L + kChunk * kLA;  // three 16 x 16 blocks for Linv
  static constexpr int BETA = TMP + 3 * 256;
  static constexpr int TOT = BETA + kChunk;
  static constexpr int FLOATS = TOT + kChunkThreads;
  static constexpr size_t BYTES = (size_t)FLOATS * sizeof(float);
  // staging of the raw inputs during step 0, in buffers that are free then (bf16)
  static constexpr int QKRAW = AQK;  // [64 + W-1][2D] q|k
  static constexpr int VRAW = Y;     // [64 + W-1][D]
  static constexpr int GRAW = X;     // [64][D]
  static_assert((kChunk + 3) * 2 * D / 2 <= 2 * kChunk * kLA, "q/k staging fits A_qk + L");
  static_assert((kChunk + 3) * D / 2 <= kChunk * LD, "v staging fits Y");
  static_assert(kChunk * D / 2 <= X_SIZE, "gate staging fits X");
};

// 16-byte copy of 8 bf16 values.
__device__ __forceinline__ void copy8(__nv_bfloat16* dst, const __nv_bfloat16* src) {
  *reinterpret_cast<uint4*>(dst) = __ldg(reinterpret_cast<const uint4*>(src));
}

// Stage rows t0-(W-1) .. t0+n-1 of `width` consecutive channels from `ch0` (multiples of
// 8) into dst[row * stride + channel]; rows before the sequence come from the conv state.
template <int W>
__device__ __forceinline__ void stage_rows(const Params& p, __nv_bfloat16* dst, int stride,
                                           int width, int ch0, int P3, int t0, int n, int bos,
                                           int slot, bool continues) {
  for (int idx = threadIdx.x; idx < (n + W - 1) * (width / 8); idx += kChunkThreads) {
    const int rho = idx / (width / 8), c = (idx % (width / 8)) * 8;
    const int s = t0 - (W - 1) + rho;
    __nv_bfloat16* d = dst + rho * stride + c;
    if (s >= bos) {
      copy8(d, p.qkv + (int64_t)s * P3 + ch0 + c);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e)
        d[e] = __float2bfloat16_rn(conv_input<W>(p, P3, s, bos, ch0 + c + e, slot, continues));
    }
  }
}

// Which sequence and chunk the CTA's global chunk index is (-1 past the last chunk).
__device__ __forceinline__ int4 locate_chunk(const Params& p, int index) {
  for (int b = 0; b < p.num_seqs; ++b) {
    const int bos = p.cu_seqlens[b], eos = p.cu_seqlens[b + 1];
    const int chunks = (eos - bos + kChunk - 1) / kChunk;
    if (index < chunks) return make_int4(b, bos + index * kChunk, min(kChunk, eos - bos - index * kChunk), bos);
    index -= chunks;
  }
  return make_int4(-1, 0, 0, 0);
}

template <int D, int W>
__global__ void __launch_bounds__(kChunkThreads, 1) chunk_prepare_kernel(Params p, float* work) {
  static_assert(D == 32 || D == 64 || D == 128, "head_dim 32, 64 or 128");
  using Lay = PrepareLayout<D>;
  using Work = ChunkWork<D>;
  constexpr int LD = Lay::LD, LA = kLA;
  extern __shared__ float smem[];
  float* sQ = smem + Lay::Q;
  float* sK = smem + Lay::K;
  float* sG = smem + Lay::G;
  float* sY = smem + Lay::Y;
  float* sX = smem + Lay::X;
  float* sLinv = smem + Lay::X;
  float* sAqk = smem + Lay::AQK;
  float* sL = smem + Lay::L;
  float* sT = smem + Lay::TMP;
  float* sBeta = smem + Lay::BETA;
  float* sTot = smem + Lay::TOT;
  __nv_bfloat16* sQKraw = reinterpret_cast<__nv_bfloat16*>(smem + Lay::QKRAW);
  __nv_bfloat16* sVraw = reinterpret_cast<__nv_bfloat16*>(smem + Lay::VRAW);
  __nv_bfloat16* sGraw = reinterpret_cast<__nv_bfloat16*>(smem + Lay::GRAW);

  const int4 where = locate_chunk(p, blockIdx.x);
  const int b = where.x, t0 = where.y, n = where.z, bos = where.w;
  if (b < 0) return;
  const int h = blockIdx.y;
  const int H = p.num_heads, P = H * D, P3 = 3 * P;
  const int slot = p.state_slots[b];
  const bool continues = p.has_initial_state[b] != 0;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  float* out = work + ((int64_t)blockIdx.x * H + h) * Work::FLOATS;
  const float a_h = expf(p.A_log[h]);
  const float scale = rsqrtf((float)D);

  // ---- 0a. stage the raw inputs (16-byte loads, all in flight at once) ----
  stage_rows<W>(p, sQKraw, 2 * D, D, h * D, P3, t0, n, bos, slot, continues);
  stage_rows<W>(p, sQKraw + D, 2 * D, D, P + h * D, P3, t0, n, bos, slot, continues);
  stage_rows<W>(p, sVraw, D, D, 2 * P + h * D, P3, t0, n, bos, slot, continues);
  for (int idx = tid; idx < n * (D / 8); idx += kChunkThreads) {
    const int r = idx / (D / 8), c = (idx % (D / 8)) * 8;
    copy8(sGraw + r * D + c, p.gate + (int64_t)(t0 + r) * P + h * D + c);
  }
  if (tid < kChunk)
    sBeta[tid] = tid < n ? sigmoid(__bfloat162float(p.beta[(int64_t)(t0 + tid) * H + h])) : 0.f;
  __syncthreads();

  // ---- 0b. conv + SiLU (bf16) of q, k, v; l2-norm of q, k; gate in log2 units ----
  for (int r = warp; r < kChunk; r += kWarps) {
    float qv[D / 32], kv[D / 32];
    float ssq = 0.f, ssk = 0.f;
#pragma unroll
    for (int j = 0; j < D / 32; ++j) {
      const int c = lane + 32 * j, ch = h * D + c;
      float g = 0.f, aq = 0.f, ak = 0.f, av = 0.f;
      if (r < n) {
#pragma unroll
        for (int i = 0; i < W; ++i) {
          aq += p.conv_weight[(int64_t)ch * W + i] * __bfloat162float(sQKraw[(r + i) * 2 * D + c]);
          ak += p.conv_weight[(int64_t)(P + ch) * W + i] *
                __bfloat162float(sQKraw[(r + i) * 2 * D + D + c]);
          av += p.conv_weight[(int64_t)(2 * P + ch) * W + i] * __bfloat162float(sVraw[(r + i) * D + c]);
        }
        aq = round_bf16(aq * fast_sigmoid(aq));
        ak = round_bf16(ak * fast_sigmoid(ak));
        av = round_bf16(av * fast_sigmoid(av));
        g = decay_gate(__bfloat162float(sGraw[r * D + c]) + p.dt_bias[ch], a_h, p.lower_bound) * kLog2e;
      }
      out[Work::BVAL + r * D + c] = sBeta[r] * av;
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
    constexpr int kParts = kChunkThreads / D, kRows = kChunk / kParts;
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

  // ---- 2. A_qk (j <= r) and A_kk = β_r·(...) (j < r), one 16-row block at a time ----
  for (int a = 0; a < 4; ++a) {
    const int m = 16 * a + 8, ncol = 16 * (a + 1);
    for (int idx = tid; idx < (32 + ncol) * D; idx += kChunkThreads) {
      const int row = idx / D, c = idx % D;
      const float gm = sG[m * LD + c];
      if (row < 32) {
        const int r = 16 * a + (row & 15);
        const float f = fast_exp2(sG[r * LD + c] - gm);
        sX[row * LD + c] = (row < 16 ? sQ[r * LD + c] : sK[r * LD + c]) * f;
      } else {
        const int j = row - 32;
        sY[j * LD + c] = sK[j * LD + c] * fast_exp2(gm - sG[j * LD + c]);
      }
    }
    for (int idx = tid; idx < 16 * (kChunk - ncol); idx += kChunkThreads) {
      const int r = 16 * a + idx / (kChunk - ncol), j = ncol + idx % (kChunk - ncol);
      sAqk[r * LA + j] = 0.f;
      sL[r * LA + j] = 0.f;
    }
    __syncthreads();
    const int ntile = 2 * (a + 1);
    for (int tile = warp; tile < 2 * ntile; tile += kWarps) {
      const bool is_qk = tile < ntile;
      const int j0 = (tile % ntile) * 8;
      float acc[1][4] = {};
      warp_mma<1>(acc, sX + (is_qk ? 0 : 16) * LD, LD, 1, sY + j0 * LD, 1, LD, D);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = 16 * a + acc_row(e), j = j0 + acc_col(e);
        if (is_qk) sAqk[r * LA + j] = j <= r ? acc[0][e] : 0.f;
        else sL[r * LA + j] = j < r ? acc[0][e] * sBeta[r] : 0.f;
      }
    }
    __syncthreads();
  }

  // ---- decay-scaled operands of the state products, straight to the workspace ----
  for (int idx = tid; idx < kChunk * D; idx += kChunkThreads) {
    const int r = idx / D, c = idx % D;
    const float gr = sG[r * LD + c], gn = sG[(kChunk - 1) * LD + c];
    const float k = sK[r * LD + c], er = fast_exp2(gr);
    out[Work::QE + idx] = sQ[r * LD + c] * er;
    out[Work::KB + idx] = sBeta[r] * k * er;
    out[Work::KD + idx] = k * fast_exp2(gn - gr);
    if (r == kChunk - 1) out[Work::DECAY + c] = fast_exp2(gn);
  }
  for (int idx = tid; idx < kChunk * kChunk; idx += kChunkThreads)
    out[Work::AQK + idx] = sAqk[(idx / kChunk) * LA + idx % kChunk];
  for (int idx = tid; idx < kChunk * LA; idx += kChunkThreads) sLinv[idx] = 0.f;
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
    for (int idx = tid; idx < a * 256; idx += kChunkThreads) {
      const int bb = idx / 256, i = (idx / 16) % 16, j = idx % 16;
      float acc = 0.f;
      for (int k = 16 * bb; k < 16 * a; ++k)
        acc += sL[(16 * a + i) * LA + k] * sLinv[k * LA + 16 * bb + j];
      sT[idx] = acc;
    }
    __syncthreads();
    for (int idx = tid; idx < a * 256; idx += kChunkThreads) {
      const int bb = idx / 256, i = (idx / 16) % 16, j = idx % 16;
      float acc = 0.f;
#pragma unroll
      for (int k = 0; k < 16; ++k)
        acc += sLinv[(16 * a + i) * LA + 16 * a + k] * sT[bb * 256 + k * 16 + j];
      sLinv[(16 * a + i) * LA + 16 * bb + j] = -acc;
    }
    __syncthreads();
  }
  for (int idx = tid; idx < kChunk * kChunk; idx += kChunkThreads)
    out[Work::LINV + idx] = sLinv[(idx / kChunk) * LA + idx % kChunk];
}

// Shared memory of the walk kernel, in floats.
template <int D, int BV>
struct WalkLayout {
  static constexpr int LD = D + 4;
  static constexpr int LS = BV + 8;  // state and value tiles
  static constexpr int QE = 0;
  static constexpr int KB = QE + kChunk * LD;
  static constexpr int KD = KB + kChunk * LD;
  static constexpr int AQK = KD + kChunk * LD;
  static constexpr int LINV = AQK + kChunk * kLA;
  static constexpr int S = LINV + kChunk * kLA;
  static constexpr int V = S + D * LS;  // β⊙V, then R in place
  static constexpr int U = V + kChunk * LS;
  static constexpr int DECAY = U + kChunk * LS;
  static constexpr int FLOATS = DECAY + D;
  static constexpr size_t BYTES = (size_t)FLOATS * sizeof(float);
};

// rows x cols floats from a dense global matrix into a padded shared one (16-byte loads).
__device__ __forceinline__ void load_tile(float* dst, int ld_dst, const float* src, int ld_src,
                                          int rows, int cols) {
  for (int idx = threadIdx.x; idx < rows * cols / 4; idx += kChunkThreads) {
    const int r = idx / (cols / 4), c = (idx % (cols / 4)) * 4;
    *reinterpret_cast<float4*>(dst + r * ld_dst + c) =
        __ldg(reinterpret_cast<const float4*>(src + r * ld_src + c));
  }
}

template <int D, int BV>
__global__ void __launch_bounds__(kChunkThreads, 1) chunk_walk_kernel(Params p, const float* work) {
  static_assert(BV == 32, "value tile of 32 columns");
  using Lay = WalkLayout<D, BV>;
  using Work = ChunkWork<D>;
  constexpr int LD = Lay::LD, LA = kLA, LS = Lay::LS;
  extern __shared__ float smem[];
  float* sQe = smem + Lay::QE;
  float* sKb = smem + Lay::KB;
  float* sKd = smem + Lay::KD;
  float* sAqk = smem + Lay::AQK;
  float* sLinv = smem + Lay::LINV;
  float* sS = smem + Lay::S;
  float* sV = smem + Lay::V;
  float* sU = smem + Lay::U;
  float* sDecay = smem + Lay::DECAY;
  __shared__ int s_first_chunk;

  const int b = blockIdx.x, h = blockIdx.y, vt = blockIdx.z;
  const int H = p.num_heads, P = H * D;
  const int bos = p.cu_seqlens[b], eos = p.cu_seqlens[b + 1];
  if (eos <= bos) return;
  const int slot = p.state_slots[b];
  const bool continues = p.has_initial_state[b] != 0;
  const int tid = threadIdx.x, warp = tid / 32;
  float* state = p.recurrent_state + ((int64_t)slot * H + h) * D * D + vt * BV;
  if (tid == 0) {  // global index of this sequence's first chunk
    int first = 0;
    for (int s = 0; s < b; ++s) first += (p.cu_seqlens[s + 1] - p.cu_seqlens[s] + kChunk - 1) / kChunk;
    s_first_chunk = first;
  }
  for (int idx = tid; idx < D * BV; idx += kChunkThreads) {
    const int c = idx / BV, v = idx % BV;
    sS[c * LS + v] = continues ? state[c * D + v] : 0.f;
  }
  __syncthreads();

  for (int t0 = bos, chunk = s_first_chunk; t0 < eos; t0 += kChunk, ++chunk) {
    const int n = min(kChunk, eos - t0);
    const float* w = work + ((int64_t)chunk * H + h) * Work::FLOATS;
    load_tile(sQe, LD, w + Work::QE, D, kChunk, D);
    load_tile(sKb, LD, w + Work::KB, D, kChunk, D);
    load_tile(sKd, LD, w + Work::KD, D, kChunk, D);
    load_tile(sAqk, LA, w + Work::AQK, kChunk, kChunk, kChunk);
    load_tile(sLinv, LA, w + Work::LINV, kChunk, kChunk, kChunk);
    load_tile(sV, LS, w + Work::BVAL + vt * BV, D, kChunk, BV);
    for (int c = tid; c < D; c += kChunkThreads) sDecay[c] = w[Work::DECAY + c];
    __syncthreads();

    // R = β⊙V − (β⊙K⊙e^Γ)·S (in place of β⊙V) and O = (Q⊙e^Γ)·S
    constexpr int NTW = (4 * BV / 8) / kWarps > 0 ? (4 * BV / 8) / kWarps : 1;
    constexpr int WPR = (BV / 8) / NTW;  // warps per 16-row block
    const int mt = warp / WPR, nb = (warp % WPR) * NTW * 8;
    float accO[NTW][4] = {};
    {
      float accR[NTW][4] = {};
      warp_mma<NTW>(accR, sKb + 16 * mt * LD, LD, 1, sS + nb, LS, 1, D);
      warp_mma<NTW>(accO, sQe + 16 * mt * LD, LD, 1, sS + nb, LS, 1, D);
#pragma unroll
      for (int j = 0; j < NTW; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float* x = &sV[(16 * mt + acc_row(e)) * LS + nb + 8 * j + acc_col(e)];
          *x -= accR[j][e];
        }
    }
    __syncthreads();
    {  // U' = Linv·R (Linv is lower triangular: columns up to the diagonal block)
      float accU[NTW][4] = {};
      warp_mma<NTW>(accU, sLinv + 16 * mt * LA, LA, 1, sV + nb, LS, 1, 16 * (mt + 1));
#pragma unroll
      for (int j = 0; j < NTW; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          sU[(16 * mt + acc_row(e)) * LS + nb + 8 * j + acc_col(e)] = accU[j][e];
    }
    __syncthreads();
    warp_mma<NTW>(accO, sAqk + 16 * mt * LA, LA, 1, sU + nb, LS, 1, 16 * (mt + 1));
#pragma unroll
    for (int j = 0; j < NTW; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = 16 * mt + acc_row(e), v = nb + 8 * j + acc_col(e);
        if (r < n) p.out[(int64_t)(t0 + r) * P + h * D + vt * BV + v] = __float2bfloat16_rn(accO[j][e]);
      }
    {  // S ← e^{Γn}⊙S + (K⊙e^{Γn−Γ})ᵀ·U': warp = 16 key rows x NTS·8 columns
      constexpr int MT = D / 16, kTiles = MT * (BV / 8);
      constexpr int NTS = kTiles / kWarps > 0 ? kTiles / kWarps : 1;
      constexpr int WPM = (BV / 8) / NTS;  // warps per 16-row block of the state
      const int smt = warp / WPM, sn = (warp % WPM) * NTS * 8;
      if (smt < MT) {
        float accS[NTS][4];
#pragma unroll
        for (int j = 0; j < NTS; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int c = 16 * smt + acc_row(e), v = sn + 8 * j + acc_col(e);
            accS[j][e] = sDecay[c] * sS[c * LS + v];
          }
        warp_mma<NTS>(accS, sKd + 16 * smt, 1, LD, sU + sn, LS, 1, kChunk);
#pragma unroll
        for (int j = 0; j < NTS; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            sS[(16 * smt + acc_row(e)) * LS + sn + 8 * j + acc_col(e)] = accS[j][e];
      }
    }
    __syncthreads();
  }

  for (int idx = tid; idx < D * BV; idx += kChunkThreads) {
    const int c = idx / BV, v = idx % BV;
    state[c * D + v] = sS[c * LS + v];
  }
}

}  // namespace kda
}  // namespace k3
