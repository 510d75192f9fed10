// Absorbed MLA attention over the paged latent cache (spec §4.4.5): MQA with one
// (R+Dr)-wide key head [c_kv | k_pe] shared by all query heads; values are the c_kv part.
//
// One CTA = one new token x one group of M = 16*MT heads x one KV split. It loads the
// token's M queries [q_lat | q_pe] once, then streams 64-token KV tiles (two cp.async
// stages) and uses each tile for all M heads: scores on tensor cores, fp32 online softmax,
// P·V on tensor cores with the R-wide output accumulator spread over the 8 warps
// (R/8 columns each). Split-KV (flash-decoding) lets a few sequences fill the GPU; the
// partial results (normalised output + log2-sum-exp) are merged by combine_splits_kernel.
// Causality: new token i of sequence b sits at position context_lens[b]+i and sees
// positions <= that, so every head of a CTA shares one key range.
#pragma once

#include <cmath>

#include "k3/mla/ptx.cuh"

namespace k3::mla {

struct LatentAttentionParams {
  const bf16* q_lat;  // [T, H, R]
  const bf16* q;      // [T, H, q_head_stride]; q_pe at channel offset rope_offset
  const bf16* cache;  // [num_slots, R+Dr]
  const int* cu_seqlens;
  const int* context_lens;
  const int* block_tables;  // [B, max_blocks]
  bf16* a_lat;              // [T, H, R] written when num_splits == 1
  float* o_part;            // [num_splits, T*H, R] normalised partial outputs
  float* lse_part;          // [num_splits, T*H] log2-sum-exp of scaled scores
  int num_tokens, num_seqs, num_heads, q_head_stride, rope_offset;
  int max_blocks, block_size;
  int head_groups, num_splits, split_tokens;  // split_tokens % 64 == 0
  float scale_log2;                           // softmax_scale * log2(e)
};

template <int R, int DR, int MT>
struct LatentAttentionConfig {
  static constexpr int D = R + DR;
  static constexpr int M = 16 * MT;         // heads per CTA
  static constexpr int NT = 64;             // KV tokens per tile
  static constexpr int WARPS = 8, THREADS = 32 * WARPS;
  static constexpr int STRIDE = D + 8;      // smem row (bf16): an odd count of 16 B chunks
  static constexpr int KSPLIT = WARPS / (2 * MT);  // warps sharing one 16x32 score tile over D
  static constexpr int KSTEPS = D / 16;
  static constexpr int KSTEPS_PER_WARP = (KSTEPS + KSPLIT - 1) / KSPLIT;
  static constexpr int S_STRIDE = NT + 8;   // fp32 scores; 8 rows of a half-warp hit distinct banks
  static constexpr int P_STRIDE = NT + 8;   // bf16 probabilities
  static constexpr int TPR = THREADS / M;   // softmax threads per row
  static constexpr int CPT = NT / TPR;      // softmax columns per thread
  static constexpr int CW = R / WARPS;      // output columns per warp
  static constexpr int NB = CW / 8;         // n8 blocks per warp
  static constexpr size_t Q_BYTES = size_t(M) * STRIDE * 2;
  static constexpr size_t KV_BYTES = size_t(2) * NT * STRIDE * 2;
  static constexpr size_t S_BYTES = size_t(KSPLIT) * M * S_STRIDE * 4;
  static constexpr size_t P_BYTES = size_t(M) * P_STRIDE * 2;
  static constexpr size_t SMEM_BYTES = Q_BYTES + KV_BYTES + S_BYTES + P_BYTES + 3 * M * 4;
  static_assert(D % 16 == 0 && DR % 8 == 0, "latent width must be a multiple of 16");
  static_assert(CW % 8 == 0 && (NB == 1 || NB % 2 == 0), "R must be 64 or a multiple of 128");
  static_assert(THREADS == 4 * NT, "tile loader maps 4 threads to each KV row");
  static_assert(KSPLIT >= 1 && WARPS % (2 * MT) == 0, "MT must be 1, 2 or 4");
};

template <int R, int DR, int MT>
__global__ void __launch_bounds__(256, 1) latent_attention_kernel(const LatentAttentionParams p) {
  using C = LatentAttentionConfig<R, DR, MT>;
  constexpr int D = C::D, M = C::M, NT = C::NT, STRIDE = C::STRIDE;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* s_q = reinterpret_cast<bf16*>(smem);
  bf16* s_kv = reinterpret_cast<bf16*>(smem + C::Q_BYTES);
  float* s_s = reinterpret_cast<float*>(smem + C::Q_BYTES + C::KV_BYTES);
  bf16* s_p = reinterpret_cast<bf16*>(smem + C::Q_BYTES + C::KV_BYTES + C::S_BYTES);
  float* s_alpha = reinterpret_cast<float*>(smem + C::Q_BYTES + C::KV_BYTES + C::S_BYTES + C::P_BYTES);
  float* s_m = s_alpha + M;
  float* s_l = s_m + M;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int head_group = blockIdx.x % p.head_groups;
  const int rest = blockIdx.x / p.head_groups;
  const int split = rest % p.num_splits;
  const int token = rest / p.num_splits;

  // Sequence of this token: the last b with cu_seqlens[b] <= token (skips empty sequences).
  int lo = 0, hi = p.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(p.cu_seqlens + mid) <= token) lo = mid; else hi = mid - 1;
  }
  const int seq = lo;
  const int position = __ldg(p.context_lens + seq) + token - __ldg(p.cu_seqlens + seq);
  const int kv_begin = split * p.split_tokens;
  const int kv_end = min(position + 1, kv_begin + p.split_tokens);
  const int n_tiles = kv_end > kv_begin ? (kv_end - kv_begin + NT - 1) / NT : 0;
  const int head0 = head_group * M;
  const int* block_row = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks;

  // Queries: M rows of [q_lat (R) | q_pe (DR)]; rows past num_heads are zero.
  for (int id = tid; id < M * (D / 8); id += C::THREADS) {
    const int row = id / (D / 8), ch = id % (D / 8), head = head0 + row;
    const bool ok = head < p.num_heads;
    const int64_t th = static_cast<int64_t>(token) * p.num_heads + head;
    const bf16* src = !ok ? p.q_lat
                      : ch < R / 8 ? p.q_lat + th * R + ch * 8
                                   : p.q + th * p.q_head_stride + p.rope_offset + (ch - R / 8) * 8;
    cp_async16(s_q + row * STRIDE + ch * 8, src, ok ? 16 : 0);
  }

  auto load_tile = [&](int tile, int stage) {
    const int row = tid >> 2, part = tid & 3;
    const int pos = kv_begin + tile * NT + row;
    const bool ok = pos < kv_end;
    const bf16* src = p.cache;
    if (ok) {
      const int block = __ldg(block_row + pos / p.block_size);
      src = p.cache + (static_cast<int64_t>(block) * p.block_size + pos % p.block_size) * D;
    }
    bf16* dst = s_kv + (stage * NT + row) * STRIDE;
#pragma unroll
    for (int ch = part; ch < D / 8; ch += 4) cp_async16(dst + ch * 8, src + (ok ? ch * 8 : 0), ok ? 16 : 0);
  };

  if (n_tiles > 0) load_tile(0, 0);
  cp_async_commit();

  const int g = lane >> 2, cq = lane & 3;
  const int sm_row = tid / C::TPR, sm_part = tid % C::TPR;  // softmax ownership
  float m_run = -INFINITY, l_run = 0.f;
  float acc[MT][C::NB][4] = {};

  for (int it = 0; it < n_tiles; ++it) {
    if (it + 1 < n_tiles) load_tile(it + 1, (it + 1) & 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const bf16* s_k = s_kv + (it & 1) * NT * STRIDE;

    {  // scores: warp task = 16 heads x 32 tokens over a 1/KSPLIT share of D
      const int task = warp % (2 * MT), ks = warp / (2 * MT);
      const int mt = task >> 1, nh = task & 1;
      float sc[4][4] = {};
      const bf16* qa = s_q + (mt * 16 + (lane & 15)) * STRIDE + (lane >> 4) * 8;
      const bf16* kb = s_k + (nh * 32 + (lane & 7) + ((lane >> 4) << 3)) * STRIDE + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int i = 0; i < C::KSTEPS_PER_WARP; ++i) {
        const int kstep = ks + i * C::KSPLIT;
        if (kstep < C::KSTEPS) {
          uint32_t a[4], b0[4], b1[4];
          ldmatrix_x4(a, qa + kstep * 16);
          ldmatrix_x4(b0, kb + kstep * 16);
          ldmatrix_x4(b1, kb + 16 * STRIDE + kstep * 16);
          mma_bf16(sc[0], a, b0[0], b0[1]);
          mma_bf16(sc[1], a, b0[2], b0[3]);
          mma_bf16(sc[2], a, b1[0], b1[1]);
          mma_bf16(sc[3], a, b1[2], b1[3]);
        }
      }
      float* srow = s_s + (ks * M + mt * 16 + g) * C::S_STRIDE + nh * 32 + 2 * cq;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        *reinterpret_cast<float2*>(srow + j * 8) = make_float2(sc[j][0], sc[j][1]);
        *reinterpret_cast<float2*>(srow + 8 * C::S_STRIDE + j * 8) = make_float2(sc[j][2], sc[j][3]);
      }
    }
    __syncthreads();

    {  // online softmax in fp32 (log2 domain); TPR consecutive lanes own one row
      const int col0 = sm_part * C::CPT;
      const int valid_cols = kv_end - (kv_begin + it * NT);
      float v[C::CPT];
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < C::CPT; ++j) {
        float s = 0.f;
#pragma unroll
        for (int ks = 0; ks < C::KSPLIT; ++ks) s += s_s[(ks * M + sm_row) * C::S_STRIDE + col0 + j];
        v[j] = col0 + j < valid_cols ? s * p.scale_log2 : -INFINITY;
        mx = fmaxf(mx, v[j]);
      }
#pragma unroll
      for (int off = C::TPR / 2; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_new = fmaxf(m_run, mx);
      const float alpha = m_run == -INFINITY ? 0.f : exp2f(m_run - m_new);
      float sum = 0.f;
      uint32_t packed[C::CPT / 2];
#pragma unroll
      for (int j = 0; j < C::CPT; j += 2) {
        const float e0 = v[j] == -INFINITY ? 0.f : exp2f(v[j] - m_new);
        const float e1 = v[j + 1] == -INFINITY ? 0.f : exp2f(v[j + 1] - m_new);
        sum += e0 + e1;
        packed[j / 2] = pack_bf16(e0, e1);
      }
#pragma unroll
      for (int off = C::TPR / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      l_run = l_run * alpha + sum;
      m_run = m_new;
      uint32_t* prow = reinterpret_cast<uint32_t*>(s_p + sm_row * C::P_STRIDE + col0);
#pragma unroll
      for (int j = 0; j < C::CPT / 2; ++j) prow[j] = packed[j];
      if (sm_part == 0) s_alpha[sm_row] = alpha;
    }
    __syncthreads();

    {  // acc = alpha * acc + P · V over this warp's R/8 output columns
      const int col0 = warp * C::CW;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const float a0 = s_alpha[mt * 16 + g], a1 = s_alpha[mt * 16 + g + 8];
#pragma unroll
        for (int nb = 0; nb < C::NB; ++nb) {
          acc[mt][nb][0] *= a0; acc[mt][nb][1] *= a0;
          acc[mt][nb][2] *= a1; acc[mt][nb][3] *= a1;
        }
      }
#pragma unroll
      for (int kk = 0; kk < NT / 16; ++kk) {
        uint32_t pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          ldmatrix_x4(pa[mt], s_p + (mt * 16 + (lane & 15)) * C::P_STRIDE + kk * 16 + (lane >> 4) * 8);
        const bf16* vrow = s_k + (kk * 16 + (lane & 15)) * STRIDE + col0;
        if constexpr (C::NB == 1) {
          uint32_t vb[2];
          ldmatrix_x2_trans(vb, vrow);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) mma_bf16(acc[mt][0], pa[mt], vb[0], vb[1]);
        } else {
#pragma unroll
          for (int nb = 0; nb < C::NB; nb += 2) {
            uint32_t vb[4];
            ldmatrix_x4_trans(vb, vrow + nb * 8 + (lane >> 4) * 8);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
              mma_bf16(acc[mt][nb], pa[mt], vb[0], vb[1]);
              mma_bf16(acc[mt][nb + 1], pa[mt], vb[2], vb[3]);
            }
          }
        }
      }
    }
    __syncthreads();  // the next iteration's load overwrites this stage and s_p
  }
  cp_async_wait<0>();

  if (sm_part == 0) {
    s_m[sm_row] = m_run;
    s_l[sm_row] = l_run;
  }
  __syncthreads();

  const int64_t rows = static_cast<int64_t>(p.num_tokens) * p.num_heads;
  if (p.num_splits > 1 && sm_part == 0 && head0 + sm_row < p.num_heads) {
    const float l = s_l[sm_row];
    p.lse_part[split * rows + static_cast<int64_t>(token) * p.num_heads + head0 + sm_row] =
        l > 0.f ? s_m[sm_row] + log2f(l) : -INFINITY;
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = mt * 16 + g + half * 8, head = head0 + row;
      if (head >= p.num_heads) continue;
      const float l = s_l[row];
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const int64_t out_row = static_cast<int64_t>(token) * p.num_heads + head;
#pragma unroll
      for (int nb = 0; nb < C::NB; ++nb) {
        const int col = warp * C::CW + nb * 8 + 2 * cq;
        const float x0 = acc[mt][nb][2 * half] * inv, x1 = acc[mt][nb][2 * half + 1] * inv;
        if (p.num_splits == 1) {
          *reinterpret_cast<uint32_t*>(p.a_lat + out_row * R + col) = pack_bf16(x0, x1);
        } else {
          *reinterpret_cast<float2*>(p.o_part + (split * rows + out_row) * R + col) = make_float2(x0, x1);
        }
      }
    }
}

// Merges the splits of one (token, head) row: weights 2^(lse_s - max), empty splits skipped.
// Block = R/4 threads, 4 columns each; grid = T*H rows.
template <int R>
__global__ void combine_splits_kernel(const float* __restrict__ o_part, const float* __restrict__ lse_part,
                                      bf16* __restrict__ a_lat, int64_t rows, int num_splits) {
  const int64_t row = blockIdx.x;
  float mx = -INFINITY;
  for (int s = 0; s < num_splits; ++s) mx = fmaxf(mx, lse_part[s * rows + row]);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float wsum = 0.f;
  for (int s = 0; s < num_splits; ++s) {
    const float lse = lse_part[s * rows + row];
    if (lse == -INFINITY) continue;
    const float w = exp2f(lse - mx);
    const float4 o = reinterpret_cast<const float4*>(o_part + (s * rows + row) * R)[threadIdx.x];
    wsum += w;
    acc.x += w * o.x; acc.y += w * o.y; acc.z += w * o.z; acc.w += w * o.w;
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  uint2 packed = make_uint2(pack_bf16(acc.x * inv, acc.y * inv), pack_bf16(acc.z * inv, acc.w * inv));
  reinterpret_cast<uint2*>(a_lat + row * R)[threadIdx.x] = packed;
}

}  // namespace k3::mla
