// Warp-level building blocks of the MLA kernels beyond common/ptx.cuh (cp.async, ldmatrix, bf16
// mma.sync): bulk global->shared copies completing on mbarriers (sm_90; the barriers are in
// common/mbarrier.cuh), named barriers, ex2.approx and bf16x2 packing.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "../common/mbarrier.cuh"
#include "../common/ptx.cuh"

namespace k3::mla {

using bf16 = __nv_bfloat16;

// Bulk copy (copy engine, no registers) of `bytes` (a multiple of 16, both addresses 16-B
// aligned) from global to this CTA's shared memory; completes `bytes` on the mbarrier.
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// Barrier over the first `threads` threads of the CTA (id 0 is __syncthreads').
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx: 2^-inf = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

}  // namespace k3::mla
