// Decode-sized grouped GEMMs: a few sorted rows (tokens) per expert, so every weight byte is
// read once and the kernels are streams over the touched experts' weights (W4A16 / W16A16).
// Roles are swapped on mma.sync m16n8k16: a warp's 16 weight rows are the MMA's M side and
// the tile's tokens its N side (kTiles n8 tiles: 8 rows per tile for T <= 8, where no expert
// can get more rows, else 16). A lane then loads whole 16-byte
// (bf16) or 8-byte (MXFP4) runs of its weight rows from global memory straight into A
// fragments (shared memory only for the MXFP4 table), kDecodeUnroll slabs of loads in flight
// per lane. (Two register stages, the next stage loaded during the current MMAs, measured
// slower: fewer CTAs fit and the activations are then loaded per slab, exposing their latency.)
// The k order inside a slab is permuted the same way for weights and activations (a dot
// product does not depend on it): lane (r = lane/4, q = lane%4) holds elements
// [slab·W + q·E, +E) of weight rows r and r+8 and of tokens r (and 8+r), and MMA j of the slab
// takes the lane's elements 4j..4j+3 (A/B register pairs 2j, 2j+1).
#pragma once

#include "grouped_gemm.cuh"
#include "pdl.cuh"

namespace k3 {
namespace moe {

constexpr int kDecodeMaxRows = 16;  // sorted rows per tile: at most two n8 MMA tiles
constexpr int kDecodeWarps = 4, kDecodeThreads = 32 * kDecodeWarps;
constexpr int kDecodeFeatures = 16 * kDecodeWarps;  // output features (per matrix) per CTA
// k3_moe_supported checks multiples of BN for latent and inter: whole CTAs and whole MXFP4 slabs.
static_assert(kDecodeFeatures == BN && BN % 64 == 0, "decode grids and slabs rely on multiples of BN");
constexpr int kDecodeUnroll = 4;                    // slabs whose loads are issued together
// CTAs per SM the register allocation must allow: 4 (<= 128 registers, 16 warps of loads in
// flight) with one n tile; 3 with two, whose activation registers would spill at 128.
constexpr int decode_min_blocks(int n_tiles) { return n_tiles == 1 ? 4 : 3; }

// Elements per lane and row in one slab: bf16 8 (16 bytes), MXFP4 16 (8 bytes, one scale).
template <bool kMxfp4>
struct DecodeSlab {
  static constexpr int kElems = kMxfp4 ? 16 : 8;
  static constexpr int kWidth = 4 * kElems;                  // k covered by a slab
  static constexpr int kWords = kElems / 2;                  // bf16x2 words per lane and row
  static constexpr int kRawWords = kMxfp4 ? 2 : 4;           // loaded words per lane and row
  static constexpr int kRowBytes = kMxfp4 ? kWidth / 2 : 2 * kWidth;  // weight bytes per row and slab
};

// Weights are read once: keep them out of L1.
__device__ __forceinline__ void ld_weights(uint32_t (&v)[4], const uint8_t* p) {
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
               : "l"(p));
}
__device__ __forceinline__ void ld_weights(uint32_t (&v)[2], const uint8_t* p) {
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];\n" : "=r"(v[0]), "=r"(v[1]) : "l"(p));
}

// A lane's operands at slab 0 (each advanced by the slab index inside the loop).
template <int kMats, int kTiles>
struct DecodeOperands {
  const uint8_t* w[kMats][2];      // weight rows r and r+8 of each matrix, at the lane's first element
  const uint8_t* scale[kMats][2];  // MXFP4: the scale byte of that first element
  const __nv_bfloat16* x[kTiles];  // tokens r (and 8+r) at the lane's first element; nullptr = no token
  const uint32_t* lane_table;      // MXFP4: the CTA's dequantisation table + lane
};

// The MMAs of one slab: four words (two MMAs) at a time, MXFP4 dequantising one packed word
// per row for them through the CTA's table (mxfp4.cuh: measured 10-20% faster here than the
// bit-move form, which the prefill GEMMs keep since their MMAs, not dequantisation, bound them).
template <int kMats, int kTiles, bool kMxfp4>
__device__ __forceinline__ void decode_slab(float (&acc)[kMats][kTiles][4],
                                            const uint32_t (&raw)[kMats][2][DecodeSlab<kMxfp4>::kRawWords],
                                            const uint32_t (&scale)[kMats][2],
                                            const uint32_t (&x)[kTiles][DecodeSlab<kMxfp4>::kWords],
                                            const uint32_t* lane_table) {
  using S = DecodeSlab<kMxfp4>;
  __nv_bfloat162 sc[kMats][2];
  if constexpr (kMxfp4) {
#pragma unroll
    for (int mat = 0; mat < kMats; ++mat)
#pragma unroll
      for (int h = 0; h < 2; ++h) sc[mat][h] = mxfp4_scale_bf16x2(scale[mat][h]);
  }
#pragma unroll
  for (int g = 0; g < S::kWords / 4; ++g) {
    uint32_t w[kMats][2][4];
#pragma unroll
    for (int mat = 0; mat < kMats; ++mat)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if constexpr (kMxfp4) {
          mxfp4_dequant8_table(raw[mat][h][g], lane_table, sc[mat][h], w[mat][h]);
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) w[mat][h][i] = raw[mat][h][i];
        }
      }
#pragma unroll
    for (int jj = 0; jj < 2; ++jj)
#pragma unroll
      for (int mat = 0; mat < kMats; ++mat) {
        const uint32_t a[4] = {w[mat][0][2 * jj], w[mat][1][2 * jj], w[mat][0][2 * jj + 1], w[mat][1][2 * jj + 1]};
        const int j = 2 * g + jj;
#pragma unroll
        for (int t = 0; t < kTiles; ++t) mma_bf16(acc[mat][t], a, x[t][2 * j], x[t][2 * j + 1]);
      }
  }
}

// acc[mat][n tile][c] += W_mat[16 rows] · X[16 tokens]ᵀ over nslab slabs.
template <int kMats, bool kMxfp4, int kTiles>
__device__ __forceinline__ void decode_mainloop(float (&acc)[kMats][kTiles][4],
                                                const DecodeOperands<kMats, kTiles>& op, int nslab) {
  using S = DecodeSlab<kMxfp4>;
  constexpr int U = kDecodeUnroll;
  for (int s0 = 0; s0 < nslab; s0 += U) {
    uint32_t raw[U][kMats][2][S::kRawWords];
    uint32_t scale[U][kMats][2];
    uint32_t x[U][kTiles][S::kWords];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (s0 + u >= nslab) continue;
      const int64_t s = s0 + u;
#pragma unroll
      for (int mat = 0; mat < kMats; ++mat)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          ld_weights(raw[u][mat][h], op.w[mat][h] + s * S::kRowBytes);
          if constexpr (kMxfp4) scale[u][mat][h] = __ldg(op.scale[mat][h] + s * (S::kWidth / kMxGroup));
        }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (s0 + u >= nslab) continue;
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
        const __nv_bfloat16* p = op.x[t];
#pragma unroll
        for (int i = 0; i < S::kWords / 4; ++i) {
          uint4 v = make_uint4(0u, 0u, 0u, 0u);
          if (p != nullptr) v = __ldg(reinterpret_cast<const uint4*>(p + (int64_t)(s0 + u) * S::kWidth) + i);
          x[u][t][4 * i] = v.x, x[u][t][4 * i + 1] = v.y, x[u][t][4 * i + 2] = v.z, x[u][t][4 * i + 3] = v.w;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (s0 + u >= nslab) continue;
      decode_slab<kMats, kTiles, kMxfp4>(acc, raw[u], scale[u], x[u], op.lane_table);
    }
  }
}

// The lane's operands for weight rows first_row + {r, r+8} (+ mat·mat_stride_rows) of K inputs.
template <int kMats, bool kMxfp4, int kTiles>
__device__ __forceinline__ DecodeOperands<kMats, kTiles> decode_operands(const ExpertWeights& ew, int64_t first_row,
                                                                         int64_t mat_stride_rows, int K) {
  using S = DecodeSlab<kMxfp4>;
  const int lane = threadIdx.x % 32, r = lane / 4, q = lane % 4;
  DecodeOperands<kMats, kTiles> op{};
#pragma unroll
  for (int mat = 0; mat < kMats; ++mat)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = first_row + mat * mat_stride_rows + r + 8 * h;
      if constexpr (kMxfp4) {
        op.w[mat][h] = ew.packed + row * (K / 2) + q * (S::kElems / 2);
        op.scale[mat][h] = ew.scale + row * (K / kMxGroup) + q * S::kElems / kMxGroup;
      } else {
        op.w[mat][h] = reinterpret_cast<const uint8_t*>(ew.bf16 + row * K + q * S::kElems);
      }
    }
  return op;
}

// The rest of a kernel's operands: the MXFP4 table (filled by the whole CTA) and the lane's
// activation rows, row_of(sorted row) for the tile's rows r (and 8+r), nullptr past its end.
template <bool kMxfp4, int kMats, int kTiles, typename RowOf>
__device__ __forceinline__ void attach_table_and_rows(DecodeOperands<kMats, kTiles>& op, uint32_t* table,
                                                      const TileInfo& t, RowOf row_of) {
  const int lane = threadIdx.x % 32;
  if constexpr (kMxfp4) {
    mxfp4_table_fill(table);
    __syncthreads();
    op.lane_table = table + lane;
  }
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
    const int n = 8 * i + lane / 4;
    op.x[i] = n < t.rows ? row_of(t.row0 + n) + (lane % 4) * DecodeSlab<kMxfp4>::kElems : nullptr;
  }
}

// Accumulator element c of n tile t: feature r + 8·(c/2), tile row 8t + 2q + c%2.
struct FragmentPos {
  int feature, row;
};
__device__ __forceinline__ FragmentPos fragment_pos(int t, int c) {
  const int lane = threadIdx.x % 32;
  return {lane / 4 + 8 * (c / 2), 8 * t + 2 * (lane % 4) + c % 2};
}

// grid (max tiles of 8·kTiles rows, I / kDecodeFeatures): h[row] = glu(z[token(row)] · w1ᵀ, · w3ᵀ).
template <bool kMxfp4, int kTiles>
__global__ void __launch_bounds__(kDecodeThreads, decode_min_blocks(kTiles)) gate_up_decode_kernel(const __nv_bfloat16* __restrict__ z,
                                                                        ExpertWeights w13,
                                                                        __nv_bfloat16* __restrict__ h, Schedule s,
                                                                        int L, int I, GluParams act) {
  __shared__ uint32_t table[kMxfp4 ? kMxfp4TableWords : 1];
  pdl_launch_dependents();
  pdl_wait();  // the schedule and z come from the kernels before
  TileInfo t;
  if (!tile_info(s, 8 * kTiles, t)) return;
  const int f0 = blockIdx.y * kDecodeFeatures + threadIdx.x / 32 * 16;
  auto op = decode_operands<2, kMxfp4, kTiles>(w13, 2 * (int64_t)t.expert * I + f0, I, L);
  attach_table_and_rows<kMxfp4>(op, table, t, [&](int row) { return z + (int64_t)s.sorted_token[row] * L; });
  float acc[2][kTiles][4] = {};
  decode_mainloop<2, kMxfp4, kTiles>(acc, op, L / DecodeSlab<kMxfp4>::kWidth);
#pragma unroll
  for (int i = 0; i < kTiles; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const FragmentPos p = fragment_pos(i, c);
      if (p.row < t.rows)
        h[(int64_t)(t.row0 + p.row) * I + f0 + p.feature] = __float2bfloat16_rn(glu(acc[0][i][c], acc[1][i][c], act));
    }
}

// grid (max tiles of 8·kTiles rows, L / kDecodeFeatures): part[row] = weight(row) · h[row] · w2ᵀ in
// fp32, one partial row per (token, slot) assignment; combine_kernel sums them in slot order.
template <bool kMxfp4, int kTiles>
__global__ void __launch_bounds__(kDecodeThreads, decode_min_blocks(kTiles)) down_decode_kernel(const __nv_bfloat16* __restrict__ h,
                                                                     ExpertWeights w2, float* __restrict__ part,
                                                                     Schedule s, int L, int I) {
  __shared__ uint32_t table[kMxfp4 ? kMxfp4TableWords : 1];
  pdl_launch_dependents();
  pdl_wait();  // the schedule and h come from the kernels before
  TileInfo t;
  if (!tile_info(s, 8 * kTiles, t)) return;
  const int f0 = blockIdx.y * kDecodeFeatures + threadIdx.x / 32 * 16;
  auto op = decode_operands<1, kMxfp4, kTiles>(w2, (int64_t)t.expert * L + f0, 0, I);
  attach_table_and_rows<kMxfp4>(op, table, t, [&](int row) { return h + (int64_t)row * I; });
  float acc[1][kTiles][4] = {};
  decode_mainloop<1, kMxfp4, kTiles>(acc, op, I / DecodeSlab<kMxfp4>::kWidth);
#pragma unroll
  for (int i = 0; i < kTiles; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const FragmentPos p = fragment_pos(i, c);
      if (p.row < t.rows) {
        const int row = t.row0 + p.row;
        part[(int64_t)row * L + f0 + p.feature] = s.sorted_weight[row] * acc[0][i][c];
      }
    }
}

}  // namespace moe
}  // namespace k3
