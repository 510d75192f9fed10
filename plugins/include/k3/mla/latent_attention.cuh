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
// Over the fp8 latent cache (FP8, fp8_latent.cuh) the producer streams the raw rows (656
// bytes for K3 instead of 1152) into the ring. K3's shape (R 512, scale groups of 128,
// DIRECT) takes its MMA operands straight from the raw stage (latent_attention_direct_fp8);
// other shapes dequantise each tile into one bf16 tile of the bf16 layout before the scores
// (two more consumer barriers per tile).
// Causality: new token i of sequence b sits at position context_lens[b]+i and sees
// positions <= that, so every head of a CTA shares one key range.
#pragma once

#include <cmath>

#include "k3/mla/fp8_latent.cuh"
#include "k3/mla/ptx.cuh"

namespace k3::mla {

struct LatentAttentionParams {
  const bf16* q_lat;  // [T, H, R]
  const bf16* q;      // [T, H, q_head_stride]; q_pe at channel offset rope_offset
  const bf16* cache;  // [num_slots, R+Dr] (bf16 cache)
  const uint8_t* cache8;  // [num_slots, row_bytes] (fp8 cache, fp8_latent.cuh)
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
  int row_bytes, scale_group;                 // fp8 cache only: bytes per row (% 16 == 0), Q
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

// FP8: KV_BYTES is the one dequantised bf16 tile; the ring of raw fp8 rows follows the
// fixed part at RAW_OFFSET, STAGES * NT * row_bytes more (smem_bytes). DIRECT (FP8 only,
// latent_attention_direct_fp8): no bf16 tile; the probabilities once per scale group
// (kMaxDirectGroups = 512/128 f16 tiles) and the tile's scale exponents per group.
constexpr int kMaxDirectGroups = 4;

template <int R, int DR, int MT, int NT_, int STAGES_, bool FP8 = false, bool DIRECT = false>
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
  static constexpr size_t KV_BYTES = size_t(DIRECT ? 0 : FP8 ? 1 : STAGES) * NT * STRIDE * 2;
  static constexpr size_t S_BYTES = size_t(KSPLIT) * M * S_STRIDE * 4;
  static constexpr size_t P_BYTES = size_t(DIRECT ? kMaxDirectGroups : 1) * M * P_STRIDE * 2;
  static constexpr size_t BAR_BYTES = size_t(2) * STAGES * 8;
  static constexpr size_t SMEM_BYTES =
      BAR_BYTES + Q_BYTES + KV_BYTES + S_BYTES + P_BYTES + 3 * M * 4 + (DIRECT ? 4 * kMaxDirectGroups : 0);
  static constexpr size_t RAW_OFFSET = (SMEM_BYTES + 15) / 16 * 16;
  static constexpr size_t smem_bytes(int row_bytes) {
    return FP8 ? RAW_OFFSET + size_t(STAGES) * NT * row_bytes : SMEM_BYTES;
  }
  static_assert(D % 16 == 0 && DR % 8 == 0, "latent width must be a multiple of 16");
  static_assert(CW % 8 == 0 && (NB == 1 || NB % 2 == 0), "R must be 64 or a multiple of 128");
  static_assert(NT % 32 == 0 && NT <= 64 && TN % 16 == 0, "tiles of 32 or 64 tokens");
  static_assert(CPT % 2 == 0, "softmax packs probability pairs");
  static_assert(KSPLIT >= 1 && WARPS % (2 * MT) == 0, "MT must be 1, 2 or 4");
  static_assert(!DIRECT || (FP8 && R == 512 && DR == 64 && MT == 1 && NT == 32),
                "the direct fp8 consumers are written for the K3 latent, 16 heads, 32-token tiles");
};

template <class C>
__device__ void latent_attention_direct_fp8(const LatentAttentionParams& p, unsigned char* smem, const CtaWork& work);

template <int R, int DR, int MT, int NT, int STAGES, int MIN_CTAS, bool FP8 = false, bool DIRECT = false>
__global__ void __launch_bounds__(LatentAttentionConfig<R, DR, MT, NT, STAGES, FP8, DIRECT>::THREADS, MIN_CTAS)
    latent_attention_kernel(const LatentAttentionParams p) {
  using C = LatentAttentionConfig<R, DR, MT, NT, STAGES, FP8, DIRECT>;
  constexpr int D = C::D, M = C::M, STRIDE = C::STRIDE;
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);  // tile landed in stage s
  uint64_t* empty = full + STAGES;                      // consumers are done with stage s
  bf16* s_q = reinterpret_cast<bf16*>(smem + C::BAR_BYTES);
  bf16* s_kv = reinterpret_cast<bf16*>(smem + C::BAR_BYTES + C::Q_BYTES);
  uint8_t* s_raw = smem + C::RAW_OFFSET;  // FP8: the ring of raw rows (s_kv: the dequantised tile)
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
    const uint32_t row_bytes = FP8 ? p.row_bytes : C::ROW_BYTES;
    for (int t = 0; t < n_tiles; ++t) {
      if (t >= STAGES) mbar_wait(empty + stage, phase ^ 1);
      if (lane == 0) mbar_arrive_expect_tx(full + stage, NT * row_bytes);
      __syncwarp();
#pragma unroll
      for (int j = 0; j < RPL; ++j) {
        if constexpr (FP8)
          bulk_copy_g2s(s_raw + (stage * NT + lane + 32 * j) * p.row_bytes, p.cache8 + slot[j] * p.row_bytes,
                        row_bytes, full + stage);
        else
          bulk_copy_g2s(s_kv + (stage * NT + lane + 32 * j) * STRIDE, p.cache + slot[j] * D, C::ROW_BYTES,
                        full + stage);
      }
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
  if constexpr (DIRECT) {
    latent_attention_direct_fp8<C>(p, smem, work);
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
    const bf16* s_k = s_kv + (FP8 ? 0 : stage * NT * STRIDE);
    if constexpr (FP8) {
      named_barrier(1, C::CONSUMERS);  // every warp's P·V of the previous tile is done with s_kv
      const uint8_t* raw = s_raw + stage * NT * p.row_bytes;
      const int groups = R / p.scale_group, shift = __ffs(p.scale_group) - 1;
      for (int id = tid; id < NT * (D / 8); id += C::CONSUMERS) {
        const int row = id / (D / 8), ch = id % (D / 8);
        *reinterpret_cast<uint4*>(s_kv + row * STRIDE + ch * 8) =
            fp8_row_chunk(raw + row * p.row_bytes, ch, R, shift, groups);
      }
      mbar_arrive(empty + stage);  // the raw stage is free for the producer
      named_barrier(1, C::CONSUMERS);
    }

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
    if constexpr (!FP8) mbar_arrive(empty + stage);
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

// The consumer warps of latent_attention_kernel over the fp8 cache without a bf16 tile: the
// MMA operands come straight from the raw stage (f16 MMAs: e4m3 -> f16 is exact, one cvt per
// pair) and the scales go into the fp32 math instead of the operands:
// - scores: warp (nh, ks) owns tokens nh*16.. +16 and latent channels [128ks, 128ks+128)
//   (scale group ks: scale_group == 128, 4 groups) plus rope k-step ks (bf16 MMA over the
//   bf16 rope bytes). Its latent partial is q . codes, times the token's group scale. The k
//   order inside an MMA is free when A and B agree: thread quad cq takes channels
//   [32cq, 32cq+32) of the warp's 128 as two 16-byte loads (rows 656 B apart = 16 mod 128: the
//   8 lanes of a load phase hit distinct banks), k-step kk its bytes 4kk..4kk+3.
// - queries: f16 of q_lat * 2^k per head row (row maximum in [2^14, 2^15): no overflow,
//   bf16 -> f16 exact apart from values under 2^-14 of the row maximum), undone on the score.
// - P.V: softmax writes P' = p * s_(t,g) * 2^(127-E_g) per scale group g (E_g: the largest
//   scale exponent among the tile's tokens, so P' < 2 in f16); warp w (output columns
//   [64w, 64w+64), one group) multiplies its accumulator by 2^(E_old - E_new) with alpha and
//   by 2^(E-127) at the end. B fragments: lane (g, cq) loads 8 codes (columns 64w + 8g + nb,
//   nb = block) of tokens 2cq, 2cq+1, 2cq+8, 2cq+9 (rows 2 x 656 B = 32 mod 128 apart: no
//   conflicts), byte-permutes them into token pairs and converts; block nb's column n is
//   physical column 64w + 8n + nb, so a thread's outputs are 2 runs of 8 columns.
// The raw stage is released after P.V (like the bf16 path): no extra barriers.
template <class C>
__device__ void latent_attention_direct_fp8(const LatentAttentionParams& p, unsigned char* smem, const CtaWork& work) {
  constexpr int R = C::D - 64, M = C::M, NT = C::NT, STRIDE = C::STRIDE, STAGES = C::STAGES;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + STAGES;
  const bf16* s_q = reinterpret_cast<const bf16*>(smem + C::BAR_BYTES);
  const uint8_t* s_raw = smem + C::RAW_OFFSET;
  float* s_s = reinterpret_cast<float*>(smem + C::BAR_BYTES + C::Q_BYTES);
  __half* s_p = reinterpret_cast<__half*>(smem + C::BAR_BYTES + C::Q_BYTES + C::S_BYTES);
  float* s_alpha = reinterpret_cast<float*>(smem + C::BAR_BYTES + C::Q_BYTES + C::S_BYTES + C::P_BYTES);
  float* s_m = s_alpha + M;
  float* s_l = s_m + M;
  int* s_e = reinterpret_cast<int*>(s_l + M);  // this tile's scale exponent per group

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, cq = lane & 3;
  const int sm_row = tid / C::TPR, sm_part = tid % C::TPR;
  const int nh = warp & 1, ks = warp >> 1;  // KSPLIT = 4 warps of 128 latent channels x 2 token halves
  constexpr int GROUPS = R / 128;  // scale groups of 128 channels (the launcher's condition)
  constexpr int rope_off = R + 4 * GROUPS, rb = rope_off + 2 * 64;  // == p.row_bytes (656)
  const int sgroup = ks, vgroup = (warp * C::CW) / 128;
  const int head0 = work.head_group * M;

  {  // per-row query exponent: 2^k with the q_lat row maximum times 2^k in [2^14, 2^15)
    float amax = 0.f;
    const bf16* qr = s_q + sm_row * STRIDE + sm_part * (R / C::TPR);
#pragma unroll
    for (int c = 0; c < R / C::TPR; c += 8) {
      const uint4 v = *reinterpret_cast<const uint4*>(qr + c);
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
        amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
      }
    }
#pragma unroll
    for (int off = C::TPR / 2; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const int e = amax > 0.f ? (__float_as_int(amax) >> 23) : 127;
    const int k = min(126, max(-126, 141 - e));
    if (sm_part == 0) s_m[sm_row] = __int_as_float((127 + k) << 23);
  }
  named_barrier(1, C::CONSUMERS);
  const float qs0 = s_m[g], qs1 = s_m[g + 8];
  constexpr int kInvBits = 254 << 23;  // the float bits of 2^-k: these minus those of 2^k
  const float qinv0 = __int_as_float(kInvBits - __float_as_int(qs0));
  const float qinv1 = __int_as_float(kInvBits - __float_as_int(qs1));
  uint32_t qf[8][4];  // f16 latent fragments, permuted k order (above)
  uint32_t qp[4];     // bf16 rope fragment of rope k-step ks
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const bf16* src = s_q + (g + 8 * half) * STRIDE + ks * 128 + 32 * cq;
    const float qs = half ? qs1 : qs0;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const uint4 v = *reinterpret_cast<const uint4*>(src + 8 * c);
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
        const __half2 h = __floats2half2_rn(f.x * qs, f.y * qs);
        const int word = 4 * c + i;  // channels 2word, 2word+1: k-step word/2, a0/a2 by parity
        qf[word >> 1][(word & 1) * 2 + half] = *reinterpret_cast<const uint32_t*>(&h);
      }
    }
    const uint2 r = *reinterpret_cast<const uint2*>(s_q + (g + 8 * half) * STRIDE + R + 16 * ks + 4 * cq);
    qp[half] = r.x;
    qp[2 + half] = r.y;
  }

  float m_run = -INFINITY, l_run = 0.f;
  float acc[C::NB][4] = {};
  int e_acc = 127;  // acc holds the true sum times 2^(127 - e_acc)
  int stage = 0;
  uint32_t phase = 0;
  for (int it = 0; it < work.n_tiles; ++it) {
    mbar_wait(full + stage, phase);
    const uint8_t* raw = s_raw + stage * NT * rb;

    {  // scores: 16 heads x 16 tokens over latent group share ks and rope k-step ks
      float sl[2][4] = {}, sr[2][4] = {};
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint8_t* row = raw + (nh * 16 + 8 * j + g) * rb;
        const uint4 c0 = *reinterpret_cast<const uint4*>(row + ks * 128 + 32 * cq);
        const uint4 c1 = *reinterpret_cast<const uint4*>(row + ks * 128 + 32 * cq + 16);
        const uint32_t w[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
          uint32_t b0, b1;
          e4m3x4_to_f16x4(w[kk], b0, b1);
          mma_f16(sl[j], qf[kk], b0, b1);
        }
        const uint2 pe = *reinterpret_cast<const uint2*>(row + rope_off + 32 * ks + 8 * cq);
        mma_bf16(sr[j], qp, pe.x, pe.y);
      }
      float* srow = s_s + (ks * M + g) * C::S_STRIDE + nh * C::TN + 2 * cq;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint8_t* srow0 = raw + (nh * 16 + 8 * j + 2 * cq) * rb + R + 4 * sgroup;
        const float s0 = *reinterpret_cast<const float*>(srow0), s1 = *reinterpret_cast<const float*>(srow0 + rb);
        *reinterpret_cast<float2*>(srow + j * 8) =
            make_float2(sl[j][0] * (s0 * qinv0) + sr[j][0], sl[j][1] * (s1 * qinv0) + sr[j][1]);
        *reinterpret_cast<float2*>(srow + 8 * C::S_STRIDE + j * 8) =
            make_float2(sl[j][2] * (s0 * qinv1) + sr[j][2], sl[j][3] * (s1 * qinv1) + sr[j][3]);
      }
    }
    named_barrier(1, C::CONSUMERS);

    {  // online softmax (as the bf16 path), then P' per scale group
      const int col0 = sm_part * C::CPT;
      const int valid_cols = work.kv_end - (work.kv_begin + it * NT);
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
      const float m_new = fmaxf(m_run, mx);
      const float alpha = fast_exp2(m_run - m_new);
      float e[C::CPT];
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < C::CPT; ++j) {
        e[j] = fast_exp2(v[j] - m_new);
        sum += e[j];
      }
#pragma unroll
      for (int off = C::TPR / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      l_run = l_run * alpha + sum;
      m_run = m_new;
      // the tile's largest scale exponent per group: one byte per group, max over the row's lanes
      float sc[GROUPS][C::CPT];
      uint32_t ex = 0;
#pragma unroll
      for (int j = 0; j < C::CPT; ++j) {
        const float4 s4 = *reinterpret_cast<const float4*>(raw + (col0 + j) * rb + R);
        sc[0][j] = s4.x; sc[1][j] = s4.y; sc[2][j] = s4.z; sc[3][j] = s4.w;
      }
#pragma unroll
      for (int gi = 0; gi < GROUPS; ++gi) {
        uint32_t eg = 0;
#pragma unroll
        for (int j = 0; j < C::CPT; ++j) eg = max(eg, static_cast<uint32_t>(__float_as_int(sc[gi][j])) >> 23);
        ex |= eg << (8 * gi);
      }
#pragma unroll
      for (int off = C::TPR / 2; off > 0; off >>= 1) ex = __vmaxu4(ex, __shfl_xor_sync(0xffffffffu, ex, off));
#pragma unroll
      for (int gi = 0; gi < GROUPS; ++gi) {
        const int eg = min(245, max(1, static_cast<int>((ex >> (8 * gi)) & 0xffu)));
        const float r = __int_as_float((254 - eg) << 23);  // 2^(127 - eg)
        uint32_t* prow = reinterpret_cast<uint32_t*>(s_p + (gi * M + sm_row) * C::P_STRIDE + col0);
#pragma unroll
        for (int j = 0; j < C::CPT; j += 2) {
          const __half2 h = __floats2half2_rn(e[j] * sc[gi][j] * r, e[j + 1] * sc[gi][j + 1] * r);
          prow[j / 2] = *reinterpret_cast<const uint32_t*>(&h);
        }
        if (tid == 0) s_e[gi] = eg;
      }
      if (sm_part == 0) s_alpha[sm_row] = alpha;
    }
    named_barrier(1, C::CONSUMERS);

    {  // acc = alpha * 2^(e_acc - e_new) * acc + P' . codes over this warp's 64 columns
      const int col0 = warp * C::CW;
      const int e_new = s_e[vgroup];
      const float f = __int_as_float((127 + min(127, max(-126, e_acc - e_new))) << 23);
      e_acc = e_new;
      const float a0 = s_alpha[g] * f, a1 = s_alpha[g + 8] * f;
      if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) {  // most tiles raise no maximum
#pragma unroll
        for (int nb = 0; nb < C::NB; ++nb) {
          acc[nb][0] *= a0; acc[nb][1] *= a0;
          acc[nb][2] *= a1; acc[nb][3] *= a1;
        }
      }
      const __half* pg = s_p + vgroup * M * C::P_STRIDE;
#pragma unroll
      for (int kk = 0; kk < NT / 16; ++kk) {
        uint32_t pa[4];
        ldmatrix_x4(pa, pg + (lane & 15) * C::P_STRIDE + kk * 16 + (lane >> 4) * 8);
        const uint8_t* vrow = raw + (kk * 16 + 2 * cq) * rb + col0 + 8 * g;
        const uint2 t0 = *reinterpret_cast<const uint2*>(vrow);
        const uint2 t1 = *reinterpret_cast<const uint2*>(vrow + rb);
        const uint2 t2 = *reinterpret_cast<const uint2*>(vrow + 8 * rb);
        const uint2 t3 = *reinterpret_cast<const uint2*>(vrow + 9 * rb);
        uint32_t b[C::NB][2];
#pragma unroll
        for (int hw = 0; hw < 2; ++hw) {
          const uint32_t x0 = hw ? t0.y : t0.x, x1 = hw ? t1.y : t1.x;
          const uint32_t x2 = hw ? t2.y : t2.x, x3 = hw ? t3.y : t3.x;
          // [tok0 byte c, tok1 byte c, tok0 byte c+1, tok1 byte c+1]: two k pairs per word (the
          // hardware cvt: converting the codes by integer ops, here or here and in the scores,
          // ran 18-21% or 38-42% slower at 12 heads, B 64; session 16, bench/NOTES_mla.md)
          e4m3x4_to_f16x4(__byte_perm(x0, x1, 0x5140), b[4 * hw + 0][0], b[4 * hw + 1][0]);
          e4m3x4_to_f16x4(__byte_perm(x0, x1, 0x7362), b[4 * hw + 2][0], b[4 * hw + 3][0]);
          e4m3x4_to_f16x4(__byte_perm(x2, x3, 0x5140), b[4 * hw + 0][1], b[4 * hw + 1][1]);
          e4m3x4_to_f16x4(__byte_perm(x2, x3, 0x7362), b[4 * hw + 2][1], b[4 * hw + 3][1]);
        }
#pragma unroll
        for (int nb = 0; nb < C::NB; ++nb) mma_f16(acc[nb], pa, b[nb][0], b[nb][1]);
      }
    }
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
  const int token = work.token, split = work.split;
  if (p.num_splits > 1 && sm_part == 0 && head0 + sm_row < p.num_heads) {
    const float l = s_l[sm_row];
    p.lse_part[split * rows + static_cast<int64_t>(token) * p.num_heads + head0 + sm_row] =
        l > 0.f ? s_m[sm_row] + log2f(l) : -INFINITY;
  }
  const float unit = __int_as_float(e_acc << 23);  // 2^(e_acc - 127)
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = g + half * 8, head = head0 + row;
    if (head >= p.num_heads) continue;
    const float l = s_l[row];
    const float inv = l > 0.f ? unit / l : 0.f;
    const int64_t out_row = static_cast<int64_t>(token) * p.num_heads + head;
#pragma unroll
    for (int run = 0; run < 2; ++run) {  // columns 64w + 16cq + 8run + nb, nb = 0..7
      const int col = warp * C::CW + 16 * cq + 8 * run;
      float x[C::NB];
#pragma unroll
      for (int nb = 0; nb < C::NB; ++nb) x[nb] = acc[nb][2 * half + run] * inv;
      if (p.num_splits == 1) {
        *reinterpret_cast<uint4*>(p.a_lat + out_row * R + col) =
            make_uint4(pack_bf16(x[0], x[1]), pack_bf16(x[2], x[3]), pack_bf16(x[4], x[5]), pack_bf16(x[6], x[7]));
      } else {
        float4* dst = reinterpret_cast<float4*>(p.o_part + (split * rows + out_row) * R + col);
        dst[0] = make_float4(x[0], x[1], x[2], x[3]);
        dst[1] = make_float4(x[4], x[5], x[6], x[7]);
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
