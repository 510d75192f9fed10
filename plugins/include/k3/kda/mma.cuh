// Warp-level tf32 tensor-core products over fp32 shared-memory operands (mma.sync m16n8k8).
// Operands are addressed through (row, col) strides so one routine serves A·B, A·Bᵀ and
// Aᵀ·B. tf32 keeps 10 mantissa bits (truncation < 1e-3), finer than the bf16 inputs.
#pragma once

#include <cstdint>

namespace k3 {
namespace kda {

// fp32 bits go in as they are: the tensor cores read the top 19 bits (round toward zero,
// relative error < 2^-10), which saves a cvt per operand element (CUTLASS's fast path).
__device__ __forceinline__ uint32_t to_tf32(float x) { return __float_as_uint(x); }

__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// acc[j] (a 16 x 8 tile, j-th of NT along n) += A[16 x K] · B[K x 8·NT].
// A(m, k) = A[m*sam + k*sak], B(k, n) = B[k*sbk + n*sbn]; K a multiple of 8.
// Fragment layout (PTX ISA, m16n8k8 tf32): g = lane/4, t = lane%4;
// a = {(g,t), (g+8,t), (g,t+4), (g+8,t+4)}, b = {(t,g), (t+4,g)},
// c = {(g,2t), (g,2t+1), (g+8,2t), (g+8,2t+1)}.
template <int NT>
__device__ __forceinline__ void warp_mma(float (&acc)[NT][4], const float* A, int sam, int sak,
                                         const float* B, int sbk, int sbn, int K) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const float* a_ptr = A + g * sam + t * sak;
  const float* b_ptr = B + t * sbk + g * sbn;
  for (int k0 = 0; k0 < K; k0 += 8) {
    uint32_t a[4];
    a[0] = to_tf32(a_ptr[k0 * sak]);
    a[1] = to_tf32(a_ptr[8 * sam + k0 * sak]);
    a[2] = to_tf32(a_ptr[(k0 + 4) * sak]);
    a[3] = to_tf32(a_ptr[8 * sam + (k0 + 4) * sak]);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const float* bj = b_ptr + j * 8 * sbn;
      mma_tf32(acc[j], a, to_tf32(bj[k0 * sbk]), to_tf32(bj[(k0 + 4) * sbk]));
    }
  }
}

// Row / column of accumulator element e (0..3) inside its 16 x 8 tile.
__device__ __forceinline__ int acc_row(int e) { return (threadIdx.x % 32) / 4 + (e >= 2 ? 8 : 0); }
__device__ __forceinline__ int acc_col(int e) { return 2 * (threadIdx.x % 4) + (e & 1); }

}  // namespace kda
}  // namespace k3
