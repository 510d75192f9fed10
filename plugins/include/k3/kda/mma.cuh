// Warp-level bf16 tensor-core products (mma.sync m16n8k16, fp32 accumulate) over 16 x 16 tiles
// whose operands ldmatrix fetches from shared memory (the PTX wrappers are in common/ptx.cuh).
//
// Fragment layout (PTX ISA, m16n8k16 bf16), g = lane/4, t = lane%4:
//   A (16 x 16): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 8+2t..), a3 = (g+8, 8+2t..);
//   B (16 x 8):  b0 = (2t..2t+1, g), b1 = (8+2t..8+2t+1, g);
//   C (16 x 8):  c0, c1 = (g, 2t), (g, 2t+1); c2, c3 = (g+8, 2t), (g+8, 2t+1).
// The loaders below take a matrix stored row-major with `ld` elements per row; each lane
// passes the address of one 8-element row of one of the four 8 x 8 matrices of an x4 load
// (16-byte aligned rows; row strides of 8 mod 64 elements keep them free of bank conflicts).
#pragma once

#include <cuda_bf16.h>
#include <cstdint>

#include "../common/ptx.cuh"

namespace k3 {
namespace kda {

// A fragment of the 16 x 16 tile at (m0, k0) of A stored as A[m][k].
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const __nv_bfloat16* A, int ld, int m0,
                                       int k0) {
  const int l = threadIdx.x % 32;
  ldmatrix_x4(a, A + (m0 + (l & 15)) * ld + k0 + (l >> 4) * 8);
}

// A fragment of the 16 x 16 tile at (m0, k0) of A stored transposed, as At[k][m].
__device__ __forceinline__ void load_a_trans(uint32_t (&a)[4], const __nv_bfloat16* At, int ld,
                                             int m0, int k0) {
  const int l = threadIdx.x % 32;
  ldmatrix_x4_trans(a, At + (k0 + (l & 7) + (l >> 4) * 8) * ld + m0 + ((l >> 3) & 1) * 8);
}

// B fragments of two 16 x 8 tiles (columns n0.. and n0+8..) at k0 of B stored as B[k][n]:
// {b[0], b[1]} for the first tile, {b[2], b[3]} for the second.
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const __nv_bfloat16* B, int ld, int k0,
                                          int n0) {
  const int l = threadIdx.x % 32;
  ldmatrix_x4_trans(b, B + (k0 + (l & 7) + ((l >> 3) & 1) * 8) * ld + n0 + (l >> 4) * 8);
}

// The same two B fragments with B stored transposed, as Bt[n][k] (products A·Btᵀ).
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const __nv_bfloat16* Bt, int ld, int k0,
                                          int n0) {
  const int l = threadIdx.x % 32;
  ldmatrix_x4(b, Bt + (n0 + (l & 7) + (l >> 4) * 8) * ld + k0 + ((l >> 3) & 1) * 8);
}

// acc[0..1] (a 16 x 16 tile as two 16 x 8 halves) += A · B over one k16 step.
__device__ __forceinline__ void mma_16x16(float (&acc)[2][4], const uint32_t (&a)[4],
                                          const uint32_t (&b)[4]) {
  mma_bf16(acc[0], a, b[0], b[1]);
  mma_bf16(acc[1], a, b[2], b[3]);
}

// Row / column of accumulator element e (0..3) inside its 16 x 8 tile.
__device__ __forceinline__ int acc_row(int e) { return (threadIdx.x % 32) / 4 + (e >= 2 ? 8 : 0); }
__device__ __forceinline__ int acc_col(int e) { return 2 * (threadIdx.x % 4) + (e & 1); }

__device__ __forceinline__ __nv_bfloat162 pack_bf16(float lo, float hi) {
  return __floats2bfloat162_rn(lo, hi);
}

}  // namespace kda
}  // namespace k3
