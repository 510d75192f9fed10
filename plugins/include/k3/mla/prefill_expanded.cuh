// The expanded (non-absorbed) MLA prefill, spec §4.4.3, minus the attention itself
// (flash_attention.cuh): per-step offsets, expansion of the cached latents into per-head
// keys and values one pass of keys at a time, and the fp32 accumulators that merge passes.
//
// The keys of all sequences of a step are numbered one after the other ("flattened":
// sequence b's position j is key key_offsets[b] + j, the latents already inserted into the
// paged cache). A pass expands the flattened keys [pass_begin, pass_begin + pass_keys):
//   k_nope[r, h, :] = W_UK,h · ĉ_kv,   v[r, h, :] = W_UV,h · ĉ_kv,   k_pe[r, :] = k_pe
// as one GEMM [keys, R] x [R, H·(DN+DV)] whose A rows are read straight from the paged
// cache (the block table lookup done once per row and CTA tile). The pass buffers hold
// bf16, as the reference's bf16 model would (it rounds K and V to bf16 too).
#pragma once

#include <cmath>

#include "k3/mla/ptx.cuh"
#include "k3/mla/step_offsets.cuh"

namespace k3::mla {

// key_offsets[b] = Σ_{b'<b} (context_lens[b'] + new tokens of b'), tile_offsets[b] the same
// over ceil(new tokens / tile_rows); entry [B] holds the totals. One CTA of 256 threads,
// each scanning a contiguous run of sequences, then a block scan of the run totals.
__global__ void __launch_bounds__(256) prefill_offsets_kernel(const int* __restrict__ cu_seqlens,
                                                              const int* __restrict__ context_lens, int num_seqs,
                                                              int tile_rows, int* __restrict__ key_offsets,
                                                              int* __restrict__ tile_offsets) {
  __shared__ int keys_scan[256], tiles_scan[256];
  const int tid = threadIdx.x;
  const int per = (num_seqs + 255) / 256;
  const int b0 = min(num_seqs, tid * per), b1 = min(num_seqs, b0 + per);
  int keys = 0, tiles = 0;
  for (int b = b0; b < b1; ++b) {
    const int n = cu_seqlens[b + 1] - cu_seqlens[b];
    keys += context_lens[b] + n;
    tiles += (n + tile_rows - 1) / tile_rows;
  }
  keys_scan[tid] = keys;
  tiles_scan[tid] = tiles;
  __syncthreads();
  for (int step = 1; step < 256; step <<= 1) {  // inclusive Hillis-Steele scan
    const int k = tid >= step ? keys_scan[tid - step] : 0;
    const int t = tid >= step ? tiles_scan[tid - step] : 0;
    __syncthreads();
    keys_scan[tid] += k;
    tiles_scan[tid] += t;
    __syncthreads();
  }
  keys = keys_scan[tid] - keys;  // exclusive prefix of this thread's run
  tiles = tiles_scan[tid] - tiles;
  for (int b = b0; b < b1; ++b) {
    key_offsets[b] = keys;
    tile_offsets[b] = tiles;
    const int n = cu_seqlens[b + 1] - cu_seqlens[b];
    keys += context_lens[b] + n;
    tiles += (n + tile_rows - 1) / tile_rows;
  }
  if (tid == 0) {
    key_offsets[num_seqs] = keys_scan[255];
    tile_offsets[num_seqs] = tiles_scan[255];
  }
}

struct ExpandParams {
  const bf16* cache;  // [num_slots, R+DR]
  const bf16* flat;   // or null; else the pass's rows [pass_keys, R+DR] (the fp8 cache, dequantised)
  const int* block_tables;
  const int* key_offsets;
  const bf16* w_uk;  // [H·DN, R]
  const bf16* w_uv;  // [H·DV, R]
  bf16* k_nope;      // [pass_keys, H·DN]
  bf16* v;           // [pass_keys, H·DV]
  bf16* k_pe;        // [pass_keys, DR]
  int num_seqs, max_blocks, block_size;
  int n_k, n_v;     // H·DN, H·DV (multiples of 8)
  int rank, rope;   // rank % 32 == 0, rope % 8 == 0
  int pass_begin, pass_keys;
};

constexpr int kExpandBM = 128, kExpandBN = 128, kExpandBK = 32, kExpandStages = 3, kExpandThreads = 256;
constexpr int kExpandStride = kExpandBK + 8;  // 80-B rows: conflict-free ldmatrix
constexpr size_t kExpandSmemBytes =
    static_cast<size_t>(kExpandStages) * (kExpandBM + kExpandBN) * kExpandStride * sizeof(bf16);

// Persistent: CTAs walk (key tile, column tile) items, key tile fastest, and skip key tiles
// at or past the step's last key (the host launches passes for an upper bound of keys).
// Columns [0, n_k) produce k_nope, the next n_v columns v; column tile 0 also copies k_pe.
// 8 warps of 64 x 32 outputs; 3-stage cp.async pipeline over K = R; two CTAs per SM.
__global__ void __launch_bounds__(kExpandThreads, 2) expand_latents_kernel(const ExpandParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* const sa = reinterpret_cast<bf16*>(smem_raw);
  bf16* const sb = sa + kExpandStages * kExpandBM * kExpandStride;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = (warp >> 2) * 64, wn = (warp & 3) * 32;
  const int g = lane >> 2, cq = lane & 3;
  const int total_keys = __ldg(p.key_offsets + p.num_seqs);
  const int valid = min(p.pass_keys, total_keys - p.pass_begin);
  if (valid <= 0) return;
  const int m_tiles = (p.pass_keys + kExpandBM - 1) / kExpandBM;
  const int k_tiles_n = (p.n_k + kExpandBN - 1) / kExpandBN;
  const int n_tiles = k_tiles_n + (p.n_v + kExpandBN - 1) / kExpandBN;
  const int64_t items = static_cast<int64_t>(m_tiles) * n_tiles;
  const int width = p.rank + p.rope;
  const int k_steps = p.rank / kExpandBK;

  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int m0 = static_cast<int>(item % m_tiles) * kExpandBM;
    const int n_tile = static_cast<int>(item / m_tiles);
    if (m0 >= valid) continue;
    const bool is_k = n_tile < k_tiles_n;
    const int n0 = (is_k ? n_tile : n_tile - k_tiles_n) * kExpandBN;
    const int n_cols = is_k ? p.n_k : p.n_v;
    const bf16* w = is_k ? p.w_uk : p.w_uv;

    // This thread loads rows (tid>>2) and (tid>>2)+64 of both operands, 16-B chunk tid&3.
    const bf16* a_row[2];
    const bf16* b_row[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = (tid >> 2) + 64 * i;
      a_row[i] = nullptr;
      if (m0 + r < valid && p.flat != nullptr) {
        a_row[i] = p.flat + static_cast<int64_t>(m0 + r) * width;
      } else if (m0 + r < valid) {
        a_row[i] = p.cache + key_slot(p.key_offsets, p.block_tables, p.num_seqs, p.max_blocks, p.block_size,
                                      p.pass_begin + m0 + r) * width;
      }
      b_row[i] = n0 + r < n_cols ? w + static_cast<int64_t>(n0 + r) * p.rank : nullptr;
    }

    if (n_tile == 0) {  // k_pe rows of this key tile
#pragma unroll
      for (int i = 0; i < 2; ++i)
        for (int ch = tid & 3; ch < p.rope / 8; ch += 4)
          if (a_row[i] != nullptr)
            *reinterpret_cast<uint4*>(p.k_pe + static_cast<int64_t>(m0 + (tid >> 2) + 64 * i) * p.rope + ch * 8) =
                *reinterpret_cast<const uint4*>(a_row[i] + p.rank + ch * 8);
    }

    auto load = [&](int kt, int stage) {
      const int k0 = kt * kExpandBK + (tid & 3) * 8;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = (tid >> 2) + 64 * i;
        cp_async16(sa + (stage * kExpandBM + r) * kExpandStride + (tid & 3) * 8,
                   a_row[i] != nullptr ? a_row[i] + k0 : w, a_row[i] != nullptr ? 16 : 0);
        cp_async16(sb + (stage * kExpandBN + r) * kExpandStride + (tid & 3) * 8,
                   b_row[i] != nullptr ? b_row[i] + k0 : w, b_row[i] != nullptr ? 16 : 0);
      }
    };

    float acc[4][4][4] = {};
    load(0, 0);
    cp_async_commit();
    if (k_steps > 1) load(1, 1);
    cp_async_commit();
    for (int kt = 0; kt < k_steps; ++kt) {
      cp_async_wait<1>();
      __syncthreads();  // step kt has landed everywhere; step kt-1's stage is free
      if (kt + 2 < k_steps) load(kt + 2, (kt + 2) % kExpandStages);
      cp_async_commit();
      const bf16* ta = sa + (kt % kExpandStages) * kExpandBM * kExpandStride;
      const bf16* tb = sb + (kt % kExpandStages) * kExpandBN * kExpandStride;
#pragma unroll
      for (int ks = 0; ks < kExpandBK; ks += 16) {
        uint32_t af[4][4], bfr[2][4];
#pragma unroll
        for (int mi = 0; mi < 4; ++mi)
          ldmatrix_x4(af[mi], ta + (wm + mi * 16 + (lane & 15)) * kExpandStride + ks + (lane >> 4) * 8);
#pragma unroll
        for (int nj = 0; nj < 2; ++nj)
          ldmatrix_x4(bfr[nj], tb + (wn + nj * 16 + (lane & 7) + ((lane >> 4) << 3)) * kExpandStride + ks +
                                   ((lane >> 3) & 1) * 8);
#pragma unroll
        for (int mi = 0; mi < 4; ++mi)
#pragma unroll
          for (int nj = 0; nj < 2; ++nj) {
            mma_bf16(acc[mi][2 * nj], af[mi], bfr[nj][0], bfr[nj][1]);
            mma_bf16(acc[mi][2 * nj + 1], af[mi], bfr[nj][2], bfr[nj][3]);
          }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // the next item's first loads reuse stages 0 and 1

    bf16* c = is_k ? p.k_nope : p.v;
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const int col = n0 + wn + ni * 8 + 2 * cq;
        if (col >= n_cols) continue;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = m0 + wm + mi * 16 + g + half * 8;
          if (row < valid)
            *reinterpret_cast<uint32_t*>(c + static_cast<int64_t>(row) * n_cols + col) =
                pack_bf16(acc[mi][ni][2 * half], acc[mi][ni][2 * half + 1]);
        }
      }
  }
}

// Marks the pass accumulators empty (log2-sum-exp -inf) before the first pass.
__global__ void fill_neg_inf_kernel(float* __restrict__ x, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] = -INFINITY;
}

// out = bf16(acc) after the last pass (acc is normalised; every row saw at least itself).
__global__ void finalize_passes_kernel(const float* __restrict__ acc, bf16* __restrict__ out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; 2 * i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float2 v = reinterpret_cast<const float2*>(acc)[i];
    reinterpret_cast<uint32_t*>(out)[i] = pack_bf16(v.x, v.y);
  }
}

}  // namespace k3::mla
