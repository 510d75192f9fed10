// Absorbed MLA attention over the paged latent cache (spec §4.4.5): MQA with one
// (R+Dr)-wide key head [c_kv | k_pe] shared by all query heads; values are the c_kv part.
//
// One CTA = one new token x one group of M = 16*MT heads x one KV split. A producer warp
// streams NT-token KV tiles into a ring of STAGES shared-memory stages with one bulk copy
// per cache row (the copy engine: no per-thread address work, whole-row requests to L2),
// completing on a "full" mbarrier; 8 consumer warps wait on it, use the tile for all M
// heads (scores on tensor cores with the queries held in registers, fp32 online softmax,
// P·V on tensor cores with the R-wide output accumulator spread over the 8 warps) and
// release the stage on an "empty" mbarrier. Split-KV (flash-decoding) lets a few sequences
// fill the GPU; the partial results (normalised output + log2-sum-exp) are merged by
// combine_splits_kernel.
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

// The work of one CTA, shared by both attention kernels: blockIdx.x =
// (token · num_splits + split) · head_groups + head_group; the token's sequence (the last b
// with cu_seqlens[b] <= token, so empty sequences are skipped) and its causal key range
// inside this split, in tiles of tile_tokens.
struct CtaWork {
  int head_group, split, token, seq, kv_begin, kv_end, n_tiles;
};

__device__ __forceinline__ CtaWork cta_work(const LatentAttentionParams& p, int tile_tokens) {
  CtaWork w;
  w.head_group = blockIdx.x % p.head_groups;
  const int rest = blockIdx.x / p.head_groups;
  w.split = rest % p.num_splits;
  w.token = rest / p.num_splits;
  int lo = 0, hi = p.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(p.cu_seqlens + mid) <= w.token) lo = mid; else hi = mid - 1;
  }
  w.seq = lo;
  const int position = __ldg(p.context_lens + w.seq) + w.token - __ldg(p.cu_seqlens + w.seq);
  w.kv_begin = w.split * p.split_tokens;
  w.kv_end = min(position + 1, w.kv_begin + p.split_tokens);
  w.n_tiles = w.kv_end > w.kv_begin ? (w.kv_end - w.kv_begin + tile_tokens - 1) / tile_tokens : 0;
  return w;
}

template <int R, int DR, int MT, int NT_, int STAGES_>
struct LatentAttentionConfig {
  static constexpr int D = R + DR;
  static constexpr int M = 16 * MT;         // heads per CTA
  static constexpr int NT = NT_;            // KV tokens per tile
  static constexpr int STAGES = STAGES_;    // KV tiles in the shared-memory ring
  static constexpr int WARPS = 8;           // consumer warps
  static constexpr int CONSUMERS = 32 * WARPS;
  static constexpr int THREADS = CONSUMERS + 32;  // + the producer warp
  static constexpr int ROW_BYTES = D * 2;
  static constexpr int STRIDE = D + 8;      // smem row (bf16): an odd count of 16 B chunks
  static constexpr int TN = NT / 2;         // tokens of one score task
  static constexpr int KSPLIT = WARPS / (2 * MT);  // warps sharing one 16 x TN score tile over D
  static constexpr int KSTEPS = D / 16;
  static constexpr int KSTEPS_PER_WARP = (KSTEPS + KSPLIT - 1) / KSPLIT;
  static constexpr int S_STRIDE = NT + 8;   // fp32 scores; 8 rows of a half-warp hit distinct banks
  static constexpr int P_STRIDE = NT + 8;   // bf16 probabilities
  static constexpr int TPR = CONSUMERS / M; // softmax threads per row
  static constexpr int CPT = NT / TPR;      // softmax columns per thread
  static constexpr int CW = R / WARPS;      // output columns per warp
  static constexpr int NB = CW / 8;         // n8 blocks per warp
  static constexpr size_t Q_BYTES = size_t(M) * STRIDE * 2;
  static constexpr size_t KV_BYTES = size_t(STAGES) * NT * STRIDE * 2;
  static constexpr size_t S_BYTES = size_t(KSPLIT) * M * S_STRIDE * 4;
  static constexpr size_t P_BYTES = size_t(M) * P_STRIDE * 2;
  static constexpr size_t BAR_BYTES = size_t(2) * STAGES * 8;
  static constexpr size_t SMEM_BYTES = BAR_BYTES + Q_BYTES + KV_BYTES + S_BYTES + P_BYTES + 3 * M * 4;
  static_assert(D % 16 == 0 && DR % 8 == 0, "latent width must be a multiple of 16");
  static_assert(CW % 8 == 0 && (NB == 1 || NB % 2 == 0), "R must be 64 or a multiple of 128");
  static_assert(NT % 32 == 0 && NT <= 64 && TN % 16 == 0, "tiles of 32 or 64 tokens");
  static_assert(CPT % 2 == 0, "softmax packs probability pairs");
  static_assert(KSPLIT >= 1 && WARPS % (2 * MT) == 0, "MT must be 1, 2 or 4");
};

template <int R, int DR, int MT, int NT, int STAGES, int MIN_CTAS>
__global__ void __launch_bounds__(LatentAttentionConfig<R, DR, MT, NT, STAGES>::THREADS, MIN_CTAS)
    latent_attention_kernel(const LatentAttentionParams p) {
  using C = LatentAttentionConfig<R, DR, MT, NT, STAGES>;
  constexpr int D = C::D, M = C::M, STRIDE = C::STRIDE;
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);  // tile landed in stage s
  uint64_t* empty = full + STAGES;                      // consumers are done with stage s
  bf16* s_q = reinterpret_cast<bf16*>(smem + C::BAR_BYTES);
  bf16* s_kv = reinterpret_cast<bf16*>(smem + C::BAR_BYTES + C::Q_BYTES);
  float* s_s = reinterpret_cast<float*>(smem + C::BAR_BYTES + C::Q_BYTES + C::KV_BYTES);
  bf16* s_p = reinterpret_cast<bf16*>(smem + C::BAR_BYTES + C::Q_BYTES + C::KV_BYTES + C::S_BYTES);
  float* s_alpha =
      reinterpret_cast<float*>(smem + C::BAR_BYTES + C::Q_BYTES + C::KV_BYTES + C::S_BYTES + C::P_BYTES);
  float* s_m = s_alpha + M;
  float* s_l = s_m + M;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const CtaWork work = cta_work(p, NT);
  const int split = work.split, token = work.token, seq = work.seq, kv_begin = work.kv_begin;
  const int kv_end = work.kv_end, n_tiles = work.n_tiles;
  const int head0 = work.head_group * M;

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full + s, 1);
      mbar_init(empty + s, C::CONSUMERS);
    }
    fence_mbar_init();
  }
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
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  if (warp == C::WARPS) {
    // Producer: lane l copies rows l, l+32, ... of each tile. Rows past the key range are
    // filled with the tile's first row (a finite cache row, read from L2) so that every tile
    // is NT rows of bytes and the zero probabilities of those rows meet no stale NaN.
    // Block-table lookups for tile t+1 are issued before waiting for its stage.
    constexpr int RPL = NT / 32;
    const int* block_row = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks;
    auto slot_of = [&](int tile, int row) {
      const int base = kv_begin + tile * NT;
      const int pos = base + row < kv_end ? base + row : base;
      return static_cast<int64_t>(__ldg(block_row + pos / p.block_size)) * p.block_size + pos % p.block_size;
    };
    int64_t slot[RPL];
    if (n_tiles > 0)
#pragma unroll
      for (int j = 0; j < RPL; ++j) slot[j] = slot_of(0, lane + 32 * j);
    int stage = 0;
    uint32_t phase = 0;
    for (int t = 0; t < n_tiles; ++t) {
      if (t >= STAGES) mbar_wait(empty + stage, phase ^ 1);
      if (lane == 0) mbar_arrive_expect_tx(full + stage, NT * C::ROW_BYTES);
      __syncwarp();
#pragma unroll
      for (int j = 0; j < RPL; ++j)
        bulk_copy_g2s(s_kv + (stage * NT + lane + 32 * j) * STRIDE, p.cache + slot[j] * D, C::ROW_BYTES,
                      full + stage);
      if (t + 1 < n_tiles)
#pragma unroll
        for (int j = 0; j < RPL; ++j) slot[j] = slot_of(t + 1, lane + 32 * j);
      if (++stage == STAGES) {
        stage = 0;
        phase ^= 1;
      }
    }
    return;
  }

  const int g = lane >> 2, cq = lane & 3;
  const int sm_row = tid / C::TPR, sm_part = tid % C::TPR;  // softmax ownership
  const int task = warp % (2 * MT), ks = warp / (2 * MT);   // score task: 16 heads x TN tokens
  const int mt_s = task >> 1, nh = task & 1;
  uint32_t qf[C::KSTEPS_PER_WARP][4];  // this warp's query fragments, for every tile
#pragma unroll
  for (int i = 0; i < C::KSTEPS_PER_WARP; ++i) {
    const int kstep = ks + i * C::KSPLIT;
    if (kstep < C::KSTEPS)
      ldmatrix_x4(qf[i], s_q + (mt_s * 16 + (lane & 15)) * STRIDE + (lane >> 4) * 8 + kstep * 16);
  }
  float m_run = -INFINITY, l_run = 0.f;
  float acc[MT][C::NB][4] = {};

  int stage = 0;
  uint32_t phase = 0;
  for (int it = 0; it < n_tiles; ++it) {
    mbar_wait(full + stage, phase);
    const bf16* s_k = s_kv + stage * NT * STRIDE;

    {  // scores: 16 heads x TN tokens over a 1/KSPLIT share of D
      float sc[C::TN / 8][4] = {};
      const bf16* kb = s_k + (nh * C::TN + (lane & 7) + ((lane >> 4) << 3)) * STRIDE + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int i = 0; i < C::KSTEPS_PER_WARP; ++i) {
        const int kstep = ks + i * C::KSPLIT;
        if (kstep < C::KSTEPS) {
#pragma unroll
          for (int x = 0; x < C::TN / 16; ++x) {
            uint32_t b[4];
            ldmatrix_x4(b, kb + x * 16 * STRIDE + kstep * 16);
            mma_bf16(sc[2 * x], qf[i], b[0], b[1]);
            mma_bf16(sc[2 * x + 1], qf[i], b[2], b[3]);
          }
        }
      }
      float* srow = s_s + (ks * M + mt_s * 16 + g) * C::S_STRIDE + nh * C::TN + 2 * cq;
#pragma unroll
      for (int j = 0; j < C::TN / 8; ++j) {
        *reinterpret_cast<float2*>(srow + j * 8) = make_float2(sc[j][0], sc[j][1]);
        *reinterpret_cast<float2*>(srow + 8 * C::S_STRIDE + j * 8) = make_float2(sc[j][2], sc[j][3]);
      }
    }
    named_barrier(1, C::CONSUMERS);

    {  // online softmax in fp32 (log2 domain); TPR consecutive lanes own one row
      const int col0 = sm_part * C::CPT;
      const int valid_cols = kv_end - (kv_begin + it * NT);
      float v[C::CPT];
#pragma unroll
      for (int j = 0; j < C::CPT; ++j) v[j] = 0.f;
#pragma unroll
      for (int k = 0; k < C::KSPLIT; ++k) {
        const float* src = s_s + (k * M + sm_row) * C::S_STRIDE + col0;
#pragma unroll
        for (int j = 0; j < C::CPT; j += 2) {
          const float2 x = *reinterpret_cast<const float2*>(src + j);
          v[j] += x.x;
          v[j + 1] += x.y;
        }
      }
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < C::CPT; ++j) {
        v[j] = col0 + j < valid_cols ? v[j] * p.scale_log2 : -INFINITY;
        mx = fmaxf(mx, v[j]);
      }
#pragma unroll
      for (int off = C::TPR / 2; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_new = fmaxf(m_run, mx);  // finite: column 0 of a tile is always valid
      const float alpha = fast_exp2(m_run - m_new);
      float sum = 0.f;
      uint32_t packed[C::CPT / 2];
#pragma unroll
      for (int j = 0; j < C::CPT; j += 2) {
        const float e0 = fast_exp2(v[j] - m_new), e1 = fast_exp2(v[j + 1] - m_new);
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
    named_barrier(1, C::CONSUMERS);

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
    // The next scores overwrite s_s only after the barrier that ended this softmax, and the
    // next softmax overwrites s_p / s_alpha only after every warp passed the next barrier.
    mbar_arrive(empty + stage);
    if (++stage == STAGES) {
      stage = 0;
      phase ^= 1;
    }
  }

  if (sm_part == 0) {
    s_m[sm_row] = m_run;
    s_l[sm_row] = l_run;
  }
  named_barrier(1, C::CONSUMERS);

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
