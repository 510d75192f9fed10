// Vector loads/stores of VEC bf16 (VEC = 8, 4, 2 or 1 elements: 16, 8, 4 or 2 bytes) as fp32, and
// the fixed-order block sum the norm kernels reduce with.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

namespace k3 {
namespace norm {

template <int VEC> struct Bytes;
template <> struct Bytes<8> { using T = uint4; };
template <> struct Bytes<4> { using T = uint2; };
template <> struct Bytes<2> { using T = uint32_t; };
template <> struct Bytes<1> { using T = uint16_t; };

template <int VEC>
__device__ __forceinline__ void load_bf16(const __nv_bfloat16* p, float (&v)[VEC]) {
  typename Bytes<VEC>::T raw = *reinterpret_cast<const typename Bytes<VEC>::T*>(p);
  const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
  for (int i = 0; i < VEC; ++i) v[i] = __bfloat162float(h[i]);
}

template <int VEC>
__device__ __forceinline__ void store_bf16(__nv_bfloat16* p, const float (&v)[VEC]) {
  typename Bytes<VEC>::T raw;
  __nv_bfloat16* h = reinterpret_cast<__nv_bfloat16*>(&raw);
#pragma unroll
  for (int i = 0; i < VEC; ++i) h[i] = __float2bfloat16_rn(v[i]);
  *reinterpret_cast<typename Bytes<VEC>::T*>(p) = raw;
}

// fp32 rows (the AttnRes query) are read VEC at a time too; 4-byte loads keep any alignment.
template <int VEC>
__device__ __forceinline__ void load_f32(const float* p, float (&v)[VEC]) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) v[i] = p[i];
}

// A norm weight in its stored dtype (bf16 -> fp32 is exact, so no fp32 copy is kept).
template <int VEC>
__device__ __forceinline__ void load_weight(const void* w, int type, int i, float (&v)[VEC]) {
  if (type == 2) {
    load_f32<VEC>(static_cast<const float*>(w) + i, v);
  } else if (type == 1) {
    load_bf16<VEC>(static_cast<const __nv_bfloat16*>(w) + i, v);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = 1.0f;
  }
}

__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// Sum of `v` over the CTA (blockDim.x a multiple of 32, at most 1024), the same order every
// call; every thread gets the result. `scratch`: 32 floats of shared memory, reusable after.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  __syncthreads();  // scratch may still be read by the previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float s = lane < warps ? scratch[lane] : 0.0f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

}  // namespace norm
}  // namespace k3
