// Hopper (sm_90a) absorbed MLA attention for the K3 latent (R = 512, Dr = 64): the same
// work split and outputs as latent_attention_kernel (one token x 64 heads x one KV split
// per CTA), on warpgroup MMAs; split-KV partials are merged by combine_splits_wgmma_kernel.
//
// Two warpgroups share each 64-token tile (2-stage cp.async ring, all 256 threads load):
// warpgroup w computes the scores of tokens 32w..32w+31 for all 64 heads (wgmma m64n32,
// both operands in 128B-swizzled shared memory) and their probabilities P against a
// reference row maximum that both warpgroups share and raise only when a score exceeds it
// by more than kRescaleSlack (lazy rescaling: the common tile needs no maximum exchange and
// no rescale of O). Each writes its half of P (bf16) into a swizzled 64x64 tile, then
// computes P·V for its half of the 512 latent output columns: its own 32 tokens with P
// from registers (m64n256k16, A in registers), the other warpgroup's from shared memory.
// Two CTA barriers per tile: tile landed, and P published (its OR tells whether a row rose).
// Over the fp8 latent cache (FP8) the cp.async ring holds one tile of raw fp8 rows (656 bytes
// each for K3), which all threads dequantise into one bf16 tile (the swizzled layout above)
// after it landed; the next tile's raw rows then stream in during this tile's MMAs. One more
// CTA barrier per tile; 200 KB of shared memory instead of 226.
#pragma once

#include <cmath>

#include "k3/mla/latent_attention.cuh"
#include "k3/mla/wgmma.cuh"

namespace k3::mla {

// Log2 units a score may exceed the shared reference maximum before it is raised (P <= 256:
// as exact in bf16 as P <= 1); 6-9% less time at 96/128 heads than raising it on every new
// maximum (bench/NOTES_mla.md, session 13).
constexpr float kRescaleSlack = 8.f;

struct WgmmaAttentionConfig {
  static constexpr int R = 512, DR = 64, D = R + DR;
  static constexpr int M = 64;                  // heads per CTA: one wgmma row block
  static constexpr int NT = 64;                 // KV tokens per tile
  static constexpr int THREADS = 256;           // two warpgroups, R/2 output columns each
  static constexpr int CHUNKS = D / 8;          // 16-byte chunks per row
  static constexpr int BLOCK_ELEMS = 64 * 64;   // one swizzled column block: 64 rows x 128 B
  static constexpr int TILE_ELEMS = (D / 64) * BLOCK_ELEMS;
  static constexpr size_t TILE_BYTES = size_t(TILE_ELEMS) * 2;
  static constexpr size_t P_BYTES = size_t(BLOCK_ELEMS) * 2;   // one swizzled 64x64 bf16 tile
  // Q + two KV stages + P + row maxima / sums of both warpgroups + alignment.
  static constexpr size_t SMEM_BYTES = 3 * TILE_BYTES + P_BYTES + 2 * 2 * M * 4 + 1024;
  // FP8: Q + one bf16 KV tile + P + maxima / sums, then the raw tile (fp8_smem_bytes).
  static constexpr size_t FP8_RAW_OFFSET = 2 * TILE_BYTES + P_BYTES + 2 * 2 * M * 4;
  static constexpr size_t fp8_smem_bytes(int row_bytes) {
    return FP8_RAW_OFFSET + size_t(NT) * row_bytes + 1024;
  }
  static_assert(NT == 8 * (THREADS / 32), "the tile loader gives each warp 8 rows");
};

// Element offset of 16-byte chunk c of row r in a tile of swizzled column blocks.
__device__ __forceinline__ int sw128_offset(int row, int chunk) {
  return (chunk >> 3) * WgmmaAttentionConfig::BLOCK_ELEMS + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
}

template <bool FP8 = false>
__global__ void __launch_bounds__(256, 1) latent_attention_wgmma_kernel(const LatentAttentionParams p) {
  using C = WgmmaAttentionConfig;
  constexpr int R = C::R, NT = C::NT;
  extern __shared__ unsigned char smem_raw[];
  // wgmma's swizzle atoms must be 1024-byte aligned in the shared window.
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  bf16* s_q = reinterpret_cast<bf16*>(smem);
  bf16* s_kv = s_q + C::TILE_ELEMS;
  bf16* s_p = s_kv + (FP8 ? 1 : 2) * C::TILE_ELEMS;
  float* s_max = reinterpret_cast<float*>(s_p + C::BLOCK_ELEMS);  // [warpgroup][head row]
  float* s_sum = s_max + 2 * C::M;
  uint8_t* s_raw = smem + C::FP8_RAW_OFFSET;  // FP8 only

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, wq = warp & 3;
  const int g = lane >> 2, cq = lane & 3;
  const CtaWork work = cta_work(p, NT);
  const int split = work.split, token = work.token, seq = work.seq, kv_begin = work.kv_begin;
  const int kv_end = work.kv_end, n_tiles = work.n_tiles;
  const int head0 = work.head_group * C::M;
  const int* block_row = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks;

  for (int id = tid; id < C::M * C::CHUNKS; id += C::THREADS) {
    const int row = id / C::CHUNKS, ch = id % C::CHUNKS, head = head0 + row;
    const bool ok = head < p.num_heads;
    const int64_t th = static_cast<int64_t>(token) * p.num_heads + head;
    const bf16* src = !ok ? p.q_lat
                      : ch < R / 8 ? p.q_lat + th * R + ch * 8
                                   : p.q + th * p.q_head_stride + p.rope_offset + (ch - R / 8) * 8;
    cp_async16(s_q + sw128_offset(row, ch), src, ok ? 16 : 0);
  }

  // Warp w copies tile rows 8w..8w+7 as one run of 8*CHUNKS 16-byte chunks, 32 consecutive
  // chunks per instruction, so each request covers whole 128-byte lines of a cache row.
  // Lane r < 8 looks up row 8w+r; the others take its cache slot by shuffle (-1: past the
  // key range, zero-filled).
  auto load_tile = [&](int tile, int stage) {
    const int pos = kv_begin + tile * NT + 8 * warp + (lane & 7);
    int slot = -1;
    if (lane < 8 && pos < kv_end) slot = __ldg(block_row + pos / p.block_size) * p.block_size + pos % p.block_size;
    bf16* dst = s_kv + stage * C::TILE_ELEMS;
#pragma unroll
    for (int i = 0; i < 8 * C::CHUNKS / 32; ++i) {
      const int chunk = 32 * i + lane, row = chunk / C::CHUNKS, ch = chunk % C::CHUNKS;
      const int row_slot = __shfl_sync(0xffffffffu, slot, row);
      const bf16* src = row_slot < 0 ? p.cache : p.cache + static_cast<int64_t>(row_slot) * C::D + ch * 8;
      cp_async16(dst + sw128_offset(8 * warp + row, ch), src, row_slot < 0 ? 0 : 16);
    }
  };

  // FP8: the raw rows of a tile, row-major at row_bytes (a multiple of 16), loaded the same
  // way (warp w: rows 8w..8w+7); rows past the key range are zero (codes 0, scale 0: finite).
  const int raw_chunks = p.row_bytes / 16;
  auto load_raw = [&](int tile) {
    const int pos = kv_begin + tile * NT + 8 * warp + (lane & 7);
    int slot = -1;
    if (lane < 8 && pos < kv_end) slot = __ldg(block_row + pos / p.block_size) * p.block_size + pos % p.block_size;
    uint8_t* dst = s_raw + 8 * warp * p.row_bytes;
    for (int i = 0; i < (8 * raw_chunks + 31) / 32; ++i) {  // uniform trip count: the shuffle
      const int chunk = 32 * i + lane, row = min(chunk / raw_chunks, 7);
      const int row_slot = __shfl_sync(0xffffffffu, slot, row);
      if (chunk < 8 * raw_chunks) {
        const uint8_t* src = row_slot < 0 ? p.cache8
                                          : p.cache8 + static_cast<int64_t>(row_slot) * p.row_bytes +
                                                (chunk - row * raw_chunks) * 16;
        cp_async16(dst + chunk * 16, src, row_slot < 0 ? 0 : 16);
      }
    }
  };

  if (n_tiles > 0) {
    if constexpr (FP8) load_raw(0); else load_tile(0, 0);
  }
  cp_async_commit();

  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  // Descriptors: Q k-step k at (k/4) column blocks + 32 B per k within a 128-B row; the
  // stage's score rows (tokens 32wg..) 4 KB in; V columns 256wg.. 4 column blocks in; the
  // address field (bytes / 16) takes the stage and k offsets without carries.
  const uint64_t q_desc = sw128_desc(s_q, 16, 1024);
  const uint64_t p_desc = sw128_desc(s_p, 16, 1024);
  const uint64_t k_desc0 = sw128_desc(s_kv + 32 * wg * 64, 16, 1024);
  const uint64_t v_desc0 = sw128_desc(s_kv + 4 * wg * C::BLOCK_ELEMS, 8192, 1024);
  // Lazy rescaling: P = 2^(s - m_ref) with a reference maximum per head row that both
  // warpgroups share and raise only when a score exceeds it by more than kRescaleSlack
  // (P <= 2^slack, harmless in bf16 and fp32). Row sums stay per thread until the end.
  float m_ref[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // rows g and g+8

  for (int it = 0; it < n_tiles; ++it) {
    cp_async_wait<0>();   // this thread's part of tile `it` (and of Q) landed
    fence_proxy_async();  // ... visible to wgmma
    // All of tile `it` landed, and both warpgroups are done with tile it-1 (its stage is
    // refilled below) and with the P tile and row maxima of it-1.
    __syncthreads();
    if constexpr (FP8) {  // dequantise the raw tile into the bf16 tile, then fetch the next raw one
      const int groups = R / p.scale_group, shift = __ffs(p.scale_group) - 1;
      for (int id = tid; id < NT * C::CHUNKS; id += C::THREADS) {
        const int row = id / C::CHUNKS, ch = id % C::CHUNKS;
        *reinterpret_cast<uint4*>(s_kv + sw128_offset(row, ch)) =
            fp8_row_chunk(s_raw + row * p.row_bytes, ch, R, shift, groups);
      }
      fence_proxy_async();  // st.shared writes, read by wgmma
      __syncthreads();      // the tile is whole; the raw tile is free
      if (it + 1 < n_tiles) load_raw(it + 1);
      cp_async_commit();
    }
    const int stage = FP8 ? 0 : it & 1;
    const uint64_t stage_off = stage * (C::TILE_BYTES / 16);
    const uint64_t k_desc = k_desc0 + stage_off, v_desc = v_desc0 + stage_off;

    float s[16];  // rows 16wq+g (+8), tokens 32wg + 8j + 2cq + {0,1}
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < C::D / 16; ++k) {
      const uint64_t off = (k >> 2) * (C::BLOCK_ELEMS * 2 / 16) + (k & 3) * 2;
      wgmma_m64n32k16_ss(s, q_desc + off, k_desc + off, k > 0);
    }
    wgmma_commit();
    // The next tile streams in while the scores are computed.
    if constexpr (!FP8) {
      if (it + 1 < n_tiles) load_tile(it + 1, stage ^ 1);
      cp_async_commit();
    }
    wgmma_wait<0>();

    const int valid = kv_end - (kv_begin + it * NT);
    float mx[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = -INFINITY;
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int idx = 4 * j + 2 * r + e;
          s[idx] = 32 * wg + 8 * j + 2 * cq + e < valid ? s[idx] * p.scale_log2 : -INFINITY;
          mx[r] = fmaxf(mx[r], s[idx]);
        }
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      if (cq == 0) s_max[wg * C::M + 16 * wq + g + 8 * r] = mx[r];
    }
    const bool raise = mx[0] > m_ref[0] + kRescaleSlack || mx[1] > m_ref[1] + kRescaleSlack;

    // P for the current reference (the common case: final), written for the other
    // warpgroup; the barrier below both publishes it and tells whether any row rose.
    uint32_t pk[4][2];
    float sum[2];
    auto make_p = [&]() {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = 16 * wq + g + 8 * r;
        sum[r] = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float p0 = fast_exp2(s[4 * j + 2 * r] - m_ref[r]), p1 = fast_exp2(s[4 * j + 2 * r + 1] - m_ref[r]);
          sum[r] += p0 + p1;
          pk[j][r] = pack_bf16(p0, p1);
          // Row `row`, tokens 32wg + 8j + 2cq: 16-byte chunk 4wg + j of the swizzled tile.
          *reinterpret_cast<uint32_t*>(s_p + row * 64 + (((4 * wg + j) ^ (row & 7)) << 3) + 2 * cq) = pk[j][r];
        }
      }
      fence_proxy_async();  // P, written by st.shared, is read by wgmma next
    };
    make_p();
    if (__syncthreads_or(raise)) {  // uniform: every thread saw the same flags
      // Both warpgroups form the same new maximum from the same two values per row.
      float alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float m_new = fmaxf(m_ref[r], fmaxf(mx[r], s_max[(wg ^ 1) * C::M + 16 * wq + g + 8 * r]));
        alpha[r] = m_ref[r] == -INFINITY ? 0.f : fast_exp2(m_ref[r] - m_new);
        l_run[r] *= alpha[r];
        m_ref[r] = m_new;
      }
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        o[4 * j] *= alpha[0]; o[4 * j + 1] *= alpha[0];
        o[4 * j + 2] *= alpha[1]; o[4 * j + 3] *= alpha[1];
      }
      make_p();
      __syncthreads();  // the other warpgroup's P is rewritten too
    }
    l_run[0] += sum[0];
    l_run[1] += sum[1];

    // O(:, 256wg..) += P(own tokens, registers) V + P(other tokens, shared) V.
    const int own = 2 * wg, other = 2 - 2 * wg;
    wgmma_fence();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      wgmma_m64n256k16_rs_mn(o, pk[2 * h][0], pk[2 * h][1], pk[2 * h + 1][0], pk[2 * h + 1][1],
                             v_desc + (own + h) * (16 * 64 * 2 / 16));
    }
#pragma unroll
    for (int h = 0; h < 2; ++h)
      wgmma_m64n256k16_ss_mn(o, p_desc + (other + h) * 2, v_desc + (other + h) * (16 * 64 * 2 / 16));
    wgmma_commit();
    wgmma_wait<0>();
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
  }
  if (cq == 0) {
    s_sum[wg * C::M + 16 * wq + g] = l_run[0];
    s_sum[wg * C::M + 16 * wq + g + 8] = l_run[1];
  }
  __syncthreads();

  const int64_t rows = static_cast<int64_t>(p.num_tokens) * p.num_heads;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = 16 * wq + g + 8 * r, head = head0 + row;
    if (head >= p.num_heads) continue;
    const float l = s_sum[row] + s_sum[C::M + row];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int64_t out_row = static_cast<int64_t>(token) * p.num_heads + head;
    if (p.num_splits > 1 && wg == 0 && cq == 0)
      p.lse_part[split * rows + out_row] = l > 0.f ? m_ref[r] + log2f(l) : -INFINITY;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int col = wg * (R / 2) + 8 * j + 2 * cq;
      const float x0 = o[4 * j + 2 * r] * inv, x1 = o[4 * j + 2 * r + 1] * inv;
      if (p.num_splits == 1) {
        *reinterpret_cast<uint32_t*>(p.a_lat + out_row * R + col) = pack_bf16(x0, x1);
      } else {
        *reinterpret_cast<float2*>(p.o_part + (split * rows + out_row) * R + col) = make_float2(x0, x1);
      }
    }
  }
}

// Warp-specialised variant (three warpgroups, 384 threads, one CTA per SM) over 32-token
// tiles in a 4-stage ring:
// - warpgroup 0 computes the scores of tile t (wgmma m64n32, Q and K from shared memory),
//   the online softmax with a lazily raised reference maximum, and writes P(t) (bf16) plus
//   per-row rescale factors into one of two P slots; it owns the row maxima and sums;
// - warpgroups 1 and 2 load the tiles (cp.async, 9 16-byte chunks per thread per tile,
//   completing on the stage's `full` mbarrier) and accumulate O(:, 256(w-1)..+256) +=
//   P(t)·V(t) (m64n256k16, both from shared memory), rescaling their O rows first when
//   warpgroup 0 raised a maximum in that warp's 16 rows.
// So the scores and softmax of tile t+1 run while the tensor cores do P·V of tile t.
// Ordering (no cycle): P(t) needs full(t), which needs P·V(t-4) done (stage reuse); P slot
// t%2 is rewritten only after P·V(t-2) arrived on p_empty.
// Merges the split-KV partials of one (token, head) row for the wgmma kernel, whose long
// sequences run up to 1024 splits: the split weights 2^(lse_s - max) go to shared memory
// first, so each thread's loads over the splits (4 columns each) are independent and
// several are in flight (no branch per split: empty splits wrote zeros with weight 0).
constexpr int kMaxCombineSplits = 1024;

template <int R>
__global__ void __launch_bounds__(R / 4) combine_splits_wgmma_kernel(const float* __restrict__ o_part,
                                                                     const float* __restrict__ lse_part,
                                                                     bf16* __restrict__ a_lat, int64_t rows,
                                                                     int num_splits) {
  constexpr int THREADS = R / 4, WARPS = THREADS / 32;
  __shared__ float s_w[kMaxCombineSplits];
  __shared__ float s_red[2][WARPS];
  const int64_t row = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float mx = -INFINITY;
  for (int s = tid; s < num_splits; s += THREADS) {
    const float lse = lse_part[s * rows + row];
    s_w[s] = lse;
    mx = fmaxf(mx, lse);
  }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, d));
  if (lane == 0) s_red[0][warp] = mx;
  __syncthreads();
  mx = s_red[0][0];
#pragma unroll
  for (int w = 1; w < WARPS; ++w) mx = fmaxf(mx, s_red[0][w]);
  float wsum = 0.f;
  for (int s = tid; s < num_splits; s += THREADS) {
    const float w = s_w[s] == -INFINITY ? 0.f : exp2f(s_w[s] - mx);
    s_w[s] = w;
    wsum += w;
  }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) wsum += __shfl_xor_sync(0xffffffffu, wsum, d);
  if (lane == 0) s_red[1][warp] = wsum;
  __syncthreads();
  wsum = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) wsum += s_red[1][w];
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
  for (int s = 0; s < num_splits; ++s) {
    const float w = s_w[s];
    const float4 o = __ldcs(reinterpret_cast<const float4*>(o_part + (s * rows + row) * R) + tid);
    acc.x += w * o.x; acc.y += w * o.y; acc.z += w * o.z; acc.w += w * o.w;
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  reinterpret_cast<uint2*>(a_lat + row * R)[tid] =
      make_uint2(pack_bf16(acc.x * inv, acc.y * inv), pack_bf16(acc.z * inv, acc.w * inv));
}

}  // namespace k3::mla
