// Grouped GEMMs of the routed experts on mma.sync m16n8k16 (bf16 in, fp32 accumulate).
//   gate_up: h[r, :] = glu(z[token(r)] · w1[e]ᵀ, z[token(r)] · w3[e]ᵀ), fp32 epilogue, h rounded to bf16
//   down:    part[r, :] = weight(r) · (h[r] · w2[e]ᵀ) in fp32, one row per (token, slot) assignment
//   combine: out[t, :] = bf16(Σ_slot part[slot_row(t, slot), :]), summed in slot order
// CTA tile: BM = 64 sorted rows of one expert x BN = 64 output columns (gate_up: 64 gate and
// the matching 64 up columns), BK = 32, 4 warps of 32 x 32, 3-stage cp.async pipeline.
// MXFP4 weights (W4A16): the packed bytes go through cp.async into a staging buffer and are
// dequantised to a bf16 tile in shared memory just before the MMAs of that k-step.
#pragma once

#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

#include "../common/ptx.cuh"
#include "mxfp4.cuh"
#include "pdl.cuh"
#include "permute.cuh"

namespace k3 {
namespace moe {

constexpr int BM = 64, BN = 64, BK = 32, kStages = 3, kGemmThreads = 128;
constexpr int kLds = BK + 8;  // 80-byte rows: the 8 rows of an ldmatrix hit distinct banks
static_assert(kMxGroup == BK, "one MXFP4 scale per weight row and k-step");

// Weight tile source of one GEMM: kMats matrices of BN rows each (gate_up: the gate rows
// n0.. and the up rows I+n0..; down: rows n0..), K contiguous inputs per row.
struct WeightTile {
  const __nv_bfloat16* bf16;  // bf16 weights: first row of matrix 0 of this expert/column tile
  const uint8_t* packed;      // MXFP4: same, packed bytes (K/2 per row)
  const uint8_t* scale;       // MXFP4: same, scale bytes (K/32 per row)
  int64_t mat_stride_rows;    // rows between matrix 0 and matrix 1 (gate_up: I)
};

template <int kMats, bool kMxfp4>
struct SmemTiles;

template <int kMats>
struct SmemTiles<kMats, false> {
  __nv_bfloat16 a[kStages][BM][kLds];
  __nv_bfloat16 b[kStages][kMats * BN][kLds];
};

template <int kMats>
struct SmemTiles<kMats, true> {
  __nv_bfloat16 a[kStages][BM][kLds];
  uint8_t raw[kStages][kMats * BN][BK / 2];
  __nv_bfloat16 b[1][kMats * BN][kLds];
};

// acc[mat][mi][ni][4] += A[64 x K] · B_mat[64 x K]ᵀ for the 32 x 32 quarter of warp (wm, wn).
// a_rows[j]: global row of A for this thread's chunk rows (t/4 + 32j), nullptr = zero row
// (its cp.async reads nothing but still gets the valid address a_base).
template <int kMats, bool kMxfp4>
__device__ __forceinline__ void gemm_mainloop(float (&acc)[kMats][2][4][4], SmemTiles<kMats, kMxfp4>& sm,
                                              const __nv_bfloat16* const* a_rows, const __nv_bfloat16* a_base,
                                              const WeightTile& w, int K) {
  constexpr int kRowsB = kMats * BN;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, wm = warp / 2, wn = warp % 2;
  const int chunk = tid % 4;  // 16-byte chunk (8 bf16) of a 32-wide k row
  const int nk = K / BK;
  static_assert(kGemmThreads % kRowsB == 0, "whole threads per B row in the MXFP4 dequantisation");

  // MXFP4: each thread dequantises one whole row (kRowsB == 128) or half a row (kRowsB == 64).
  constexpr int kThreadsPerRow = kGemmThreads / kRowsB;
  constexpr int kBytesPerThread = (BK / 2) / kThreadsPerRow;
  const int dq_row = tid / kThreadsPerRow, dq_part = tid % kThreadsPerRow;
  const int dq_mat = dq_row / BN;
  const uint8_t* scale_row =
      kMxfp4 ? w.scale + (dq_mat * w.mat_stride_rows + dq_row % BN) * (int64_t)(K / kMxGroup) : nullptr;

  auto load_stage = [&](int stage, int kt) {
    const int k0 = kt * BK;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int r = tid / 4 + 32 * j;
      const __nv_bfloat16* src = a_rows[j];
      cp_async16(&sm.a[stage][r][chunk * 8], src != nullptr ? src + k0 + chunk * 8 : a_base,
                 src != nullptr ? 16 : 0);
    }
    if constexpr (kMxfp4) {
      if (tid < kRowsB) {
        const int mat = tid / BN, r = tid % BN;
        const uint8_t* src = w.packed + (mat * w.mat_stride_rows + r) * (int64_t)(K / 2) + k0 / 2;
        cp_async16(&sm.raw[stage][tid][0], src, 16);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kRowsB / 32; ++j) {
        const int row = tid / 4 + 32 * j, mat = row / BN, r = row % BN;
        const __nv_bfloat16* src = w.bf16 + (mat * w.mat_stride_rows + r) * (int64_t)K + k0 + chunk * 8;
        cp_async16(&sm.b[stage][row][chunk * 8], src, 16);
      }
    }
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nk) load_stage(s, s);
    cp_async_commit();
  }
  uint32_t scale_cur = kMxfp4 ? scale_row[0] : 0u;

  for (int kt = 0; kt < nk; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int stage = kt % kStages;
    const __nv_bfloat16(*tb)[kLds] = sm.b[kMxfp4 ? 0 : stage];
    if constexpr (kMxfp4) {
      const uint32_t scale_next = kt + 1 < nk ? scale_row[kt + 1] : 0u;  // lands during this k-step
      const Mxfp4Scale s = mxfp4_scale(scale_cur);
      const uint32_t* raw = reinterpret_cast<const uint32_t*>(&sm.raw[stage][dq_row][dq_part * kBytesPerThread]);
      uint4* dst = reinterpret_cast<uint4*>(&sm.b[0][dq_row][dq_part * kBytesPerThread * 2]);
#pragma unroll
      for (int i = 0; i < kBytesPerThread / 4; ++i) {
        uint32_t w[4];
        mxfp4_dequant8(raw[i], s, w);
        dst[i] = make_uint4(w[0], w[1], w[2], w[3]);
      }
      scale_cur = scale_next;
      __syncthreads();
    }
    // The stage refilled now was last read in k-step kt-1, which every warp has finished.
    if (kt + kStages - 1 < nk) load_stage((kt + kStages - 1) % kStages, kt + kStages - 1);
    cp_async_commit();

#pragma unroll
    for (int ks = 0; ks < BK; ks += 16) {
      uint32_t af[2][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
        ldmatrix_x4(af[mi], &sm.a[stage][wm * 32 + mi * 16 + (lane % 8) + 8 * ((lane / 8) % 2)][ks + 8 * (lane / 16)]);
#pragma unroll
      for (int mat = 0; mat < kMats; ++mat) {
#pragma unroll
        for (int nj = 0; nj < 2; ++nj) {
          uint32_t bf[4];  // n-tiles 2nj (bf[0], bf[1]) and 2nj+1 (bf[2], bf[3])
          ldmatrix_x4(bf, &tb[mat * BN + wn * 32 + nj * 16 + (lane % 8) + 8 * (lane / 16)][ks + 8 * ((lane / 8) % 2)]);
#pragma unroll
          for (int mi = 0; mi < 2; ++mi) {
            mma_bf16(acc[mat][mi][2 * nj], af[mi], bf[0], bf[1]);
            mma_bf16(acc[mat][mi][2 * nj + 1], af[mi], bf[2], bf[3]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();
}

struct GluParams {
  int activation;  // 1 = SiTU, 0 = SiLU
  float beta, linear_beta;
};

// common.situ_glu / silu_glu in fp32.
__device__ __forceinline__ float glu(float g, float u, const GluParams& p) {
  const float sig = 1.f / (1.f + expf(-g));
  if (p.activation == 0) return g * sig * u;
  const float gate = p.beta * tanhf(g / p.beta) * sig;
  const float up = p.linear_beta != 0.f ? p.linear_beta * tanhf(u / p.linear_beta) : u;
  return gate * up;
}

// Resolves blockIdx.x to an M tile of up to bm rows; false for the grid's spare tiles.
struct TileInfo {
  int expert, row0, rows;
};
__device__ __forceinline__ bool tile_info(const Schedule& s, int bm, TileInfo& t) {
  const int tile = blockIdx.x;
  if (tile >= *s.num_tiles) return false;
  t.expert = s.tile_expert[tile];
  t.row0 = s.tile_row[tile];
  const int end = s.offsets[t.expert + 1];
  t.rows = end - t.row0 < bm ? end - t.row0 : bm;
  return true;
}

// The A rows this thread copies in gemm_mainloop (tile rows tid/4 and tid/4 + 32):
// row_of(sorted row), nullptr past the tile's rows.
template <typename RowOf>
__device__ __forceinline__ void tile_a_rows(const __nv_bfloat16* (&a_rows)[2], const TileInfo& t, int tid,
                                            RowOf row_of) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int r = tid / 4 + 32 * j;
    a_rows[j] = r < t.rows ? row_of(t.row0 + r) : nullptr;
  }
}

struct ExpertWeights {
  const __nv_bfloat16* bf16;                // [El, rows, K]
  const uint8_t* packed;                    // [El, rows, K/2]
  const uint8_t* scale;                     // [El, rows, K/32]
};

__device__ __forceinline__ WeightTile weight_tile(const ExpertWeights& w, int expert, int64_t rows_per_expert,
                                                  int64_t first_row, int K, int64_t mat_stride_rows) {
  const int64_t row = expert * rows_per_expert + first_row;
  WeightTile t;
  t.bf16 = w.bf16 != nullptr ? w.bf16 + row * K : nullptr;
  t.packed = w.packed != nullptr ? w.packed + row * (K / 2) : nullptr;
  t.scale = w.scale != nullptr ? w.scale + row * (K / kMxGroup) : nullptr;
  t.mat_stride_rows = mat_stride_rows;
  return t;
}

// grid (max M tiles, I / BN).
template <bool kMxfp4>
__global__ void __launch_bounds__(kGemmThreads) gate_up_kernel(const __nv_bfloat16* __restrict__ z,
                                                               ExpertWeights w13, __nv_bfloat16* __restrict__ h,
                                                               Schedule s, int L, int I, GluParams act) {
  __shared__ __align__(16) SmemTiles<2, kMxfp4> sm;
  TileInfo t;
  if (!tile_info(s, BM, t)) return;
  const int n0 = blockIdx.y * BN, tid = threadIdx.x;
  const __nv_bfloat16* a_rows[2];
  tile_a_rows(a_rows, t, tid, [&](int row) { return z + (int64_t)s.sorted_token[row] * L; });
  float acc[2][2][4][4] = {};
  gemm_mainloop<2, kMxfp4>(acc, sm, a_rows, z, weight_tile(w13, t.expert, 2 * (int64_t)I, n0, L, I), L);

  const int lane = tid % 32, warp = tid / 32, wm = warp / 2, wn = warp % 2;
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = wm * 32 + mi * 16 + lane / 4 + 8 * half;
      if (r >= t.rows) continue;
      __nv_bfloat16* out_row = h + (int64_t)(t.row0 + r) * I + n0;
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const int c = wn * 32 + ni * 8 + 2 * (lane % 4);
        const float h0 = glu(acc[0][mi][ni][2 * half], acc[1][mi][ni][2 * half], act);
        const float h1 = glu(acc[0][mi][ni][2 * half + 1], acc[1][mi][ni][2 * half + 1], act);
        *reinterpret_cast<__nv_bfloat162*>(out_row + c) = __floats2bfloat162_rn(h0, h1);
      }
    }
}

// grid (max M tiles, L / BN).
template <bool kMxfp4>
__global__ void __launch_bounds__(kGemmThreads) down_kernel(const __nv_bfloat16* __restrict__ h, ExpertWeights w2,
                                                            float* __restrict__ part, Schedule s, int L, int I) {
  __shared__ __align__(16) SmemTiles<1, kMxfp4> sm;
  TileInfo t;
  if (!tile_info(s, BM, t)) return;
  const int n0 = blockIdx.y * BN, tid = threadIdx.x;
  const __nv_bfloat16* a_rows[2];
  tile_a_rows(a_rows, t, tid, [&](int row) { return h + (int64_t)row * I; });
  float acc[1][2][4][4] = {};
  gemm_mainloop<1, kMxfp4>(acc, sm, a_rows, h, weight_tile(w2, t.expert, L, n0, I, 0), I);

  const int lane = tid % 32, warp = tid / 32, wm = warp / 2, wn = warp % 2;
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = wm * 32 + mi * 16 + lane / 4 + 8 * half;
      if (r >= t.rows) continue;
      const int p = t.row0 + r;
      const float weight = s.sorted_weight[p];
      float* out_row = part + (int64_t)p * L + n0;
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const int c = wn * 32 + ni * 8 + 2 * (lane % 4);
        *reinterpret_cast<float2*>(out_row + c) =
            make_float2(weight * acc[0][mi][ni][2 * half], weight * acc[0][mi][ni][2 * half + 1]);
      }
    }
}

// The combine: out[t, :] = bf16(Σ_j part[slot_row[t·k + j], :]), j = 0..k-1 in order, slots
// whose expert is not local skipped. The sum of each token's slots in one fixed order makes the
// output the same bits whatever order the GEMM CTAs ran in (fp32 atomics into one row did not).
// grid T · ceil(L / (4 · kCombineThreads)); L % 4 == 0. One fp32 rounding of each product (as
// the atomics had), the slot sum in fp32, one rounding to bf16.
constexpr int kCombineThreads = 128, kCombineUnroll = 8;  // partial rows in flight per thread
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(const float* __restrict__ part,
                                                                  const int* __restrict__ slot_row,
                                                                  __nv_bfloat16* __restrict__ out, int L, int k) {
  pdl_wait();  // part, when launched as a programmatic dependent (decode)
  const int col_blocks = (L / 4 + kCombineThreads - 1) / kCombineThreads;
  const int64_t t = blockIdx.x / col_blocks;
  const int c4 = (blockIdx.x % col_blocks) * kCombineThreads + threadIdx.x;
  if (4 * c4 >= L) return;
  const int* rows = slot_row + t * k;
  float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int j0 = 0; j0 < k; j0 += kCombineUnroll) {
    float4 v[kCombineUnroll];
    bool have[kCombineUnroll];
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {
      const int r = j0 + u < k ? rows[j0 + u] : -1;
      have[u] = r >= 0;
      if (have[u]) v[u] = __ldcs(reinterpret_cast<const float4*>(part + (int64_t)r * L) + c4);  // read once
    }
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u)
      if (have[u]) sum.x += v[u].x, sum.y += v[u].y, sum.z += v[u].z, sum.w += v[u].w;
  }
  const __nv_bfloat162 lo = __floats2bfloat162_rn(sum.x, sum.y), hi = __floats2bfloat162_rn(sum.z, sum.w);
  reinterpret_cast<uint2*>(out + t * L)[c4] =
      make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
}

}  // namespace moe
}  // namespace k3
