// Hopper (sm_90a) absorbed MLA attention for the K3 latent (R = 512, Dr = 64): the same
// work split and outputs as latent_attention_kernel (one token x 64 heads x one KV split
// per CTA, split-KV partials merged by combine_splits_kernel), on warpgroup MMAs.
//
// Two warpgroups share each 64-token tile: warpgroup w computes the scores of tokens
// 32w..32w+31 for all 64 heads (wgmma m64n32, both operands in 128B-swizzled shared
// memory), the warpgroups exchange their row maxima through shared memory, each writes its
// half of P (bf16) into a swizzled 64x64 tile, and each then computes P·V for its half of
// the 512 latent output columns (m64n256k16, P and V from shared memory). Row sums stay
// per warpgroup (both rescale with the same running maximum) and are added at the end.
#pragma once

#include <cmath>

#include "k3/mla/latent_attention.cuh"
#include "k3/mla/wgmma.cuh"

namespace k3::mla {

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
  static_assert(NT == 8 * (THREADS / 32), "the tile loader gives each warp 8 rows");
};

// Element offset of 16-byte chunk c of row r in a tile of swizzled column blocks.
__device__ __forceinline__ int sw128_offset(int row, int chunk) {
  return (chunk >> 3) * WgmmaAttentionConfig::BLOCK_ELEMS + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
}

__global__ void __launch_bounds__(256, 1) latent_attention_wgmma_kernel(const LatentAttentionParams p) {
  using C = WgmmaAttentionConfig;
  constexpr int R = C::R, NT = C::NT;
  extern __shared__ unsigned char smem_raw[];
  // wgmma's swizzle atoms must be 1024-byte aligned in the shared window.
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  bf16* s_q = reinterpret_cast<bf16*>(smem);
  bf16* s_kv = s_q + C::TILE_ELEMS;
  bf16* s_p = s_kv + 2 * C::TILE_ELEMS;
  float* s_max = reinterpret_cast<float*>(s_p + C::BLOCK_ELEMS);  // [warpgroup][head row]
  float* s_sum = s_max + 2 * C::M;

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

  if (n_tiles > 0) load_tile(0, 0);
  cp_async_commit();

  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // rows g and g+8

  for (int it = 0; it < n_tiles; ++it) {
    if (it + 1 < n_tiles) load_tile(it + 1, (it + 1) & 1);
    cp_async_commit();
    cp_async_wait<1>();
    fence_proxy_async();
    __syncthreads();
    const bf16* kv = s_kv + (it & 1) * C::TILE_ELEMS;

    float s[16];  // rows 16wq+g (+8), tokens 32wg + 8j + 2cq + {0,1}
#pragma unroll
    for (int i = 0; i < 16; ++i) s[i] = 0.f;
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < C::D / 16; ++k) {
      const int off = (k >> 2) * C::BLOCK_ELEMS + (k & 3) * 16;
      wgmma_m64n32k16_ss(s, sw128_desc(s_q + off, 16, 1024), sw128_desc(kv + off + 32 * wg * 64, 16, 1024), k > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();

    // Online softmax (log2 domain); the 4 lanes of a quad share rows g and g+8.
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
    __syncthreads();
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 16 * wq + g + 8 * r;
      // Both warpgroups form the same maximum; token 0 of a tile is always valid.
      const float m_new = fmaxf(m_run[r], fmaxf(mx[r], s_max[(wg ^ 1) * C::M + row]));
      alpha[r] = m_run[r] == -INFINITY ? 0.f : fast_exp2(m_run[r] - m_new);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int idx = 4 * j + 2 * r + e;
          s[idx] = s[idx] == -INFINITY ? 0.f : fast_exp2(s[idx] - m_new);
          sum += s[idx];
        }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      l_run[r] = l_run[r] * alpha[r] + sum;
      m_run[r] = m_new;
      // P row `row`, tokens 32wg + 8j + 2cq: 16-byte chunk 4wg + j of the swizzled tile.
#pragma unroll
      for (int j = 0; j < 4; ++j)
        *reinterpret_cast<uint32_t*>(s_p + row * 64 + (((4 * wg + j) ^ (row & 7)) << 3) + 2 * cq) =
            pack_bf16(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]);
    }
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      o[4 * j] *= alpha[0]; o[4 * j + 1] *= alpha[0];
      o[4 * j + 2] *= alpha[1]; o[4 * j + 3] *= alpha[1];
    }
    fence_proxy_async();  // P, written by st.shared, is read by wgmma next
    __syncthreads();
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      // V = c_kv columns [256 wg, 256 wg + 256): column blocks 4wg..4wg+3 (8192 B apart),
      // tokens 16kk.. (8-token groups 1024 B apart).
      wgmma_m64n256k16_ss_mn(o, sw128_desc(s_p + kk * 16, 16, 1024),
                             sw128_desc(kv + 4 * wg * C::BLOCK_ELEMS + kk * 16 * 64, 8192, 1024));
    }
    wgmma_commit();
    wgmma_wait<0>();
    __syncthreads();  // both warpgroups are done with this stage, P and s_max before reuse
  }
  cp_async_wait<0>();

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
      p.lse_part[split * rows + out_row] = l > 0.f ? m_run[r] + log2f(l) : -INFINITY;
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

}  // namespace k3::mla
