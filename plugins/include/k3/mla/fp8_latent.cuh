// The fp8 latent cache (contracts K3MlaPrefillFp8 / K3MlaDecodeFp8; the layout and the
// readable quantiser are k3_trtllm/ops/mla/fp8_cache.py): one row of
// R + 4R/Q + 2DR bytes per token = [R E4M3 codes | R/Q fp32 scales | DR bf16 rope values],
// code = satfinite_rne_e4m3(c / s_g) with s_g = amax_g / 448 (1 if amax_g is 0) per group of
// Q channels. The writer here produces the quantiser's bytes (IEEE divisions, the same
// rounding); the readers dequantise code * scale in fp32 and round to the bf16 operands of
// the bf16 cache's kernels.
#pragma once

#include <cuda_fp8.h>

#include "k3/mla/ptx.cuh"
#include "k3/mla/step_offsets.cuh"

namespace k3::mla {

constexpr float kE4m3Max = 448.f;

__host__ __device__ constexpr int fp8_row_bytes(int rank, int rope, int scale_group) {
  return rank + 4 * (rank / scale_group) + 2 * rope;
}

// One block per new token, one thread per 4 latent channels (R/4 threads, R <= 4096); a
// negative slot is a padding token. Rows need only 4-byte alignment (R % 16 == 0, DR even),
// so every row width (the tiny model's 100 bytes too) is written.
__global__ void insert_latents_fp8_kernel(const bf16* __restrict__ latent, const int* __restrict__ slot_mapping,
                                          uint8_t* __restrict__ cache, int rank, int rope, int scale_group) {
  extern __shared__ float s_amax[];  // [R/4] per-thread maxima, then [R/Q] group scales
  const int token = blockIdx.x, tid = threadIdx.x;
  const int slot = slot_mapping[token];
  if (slot < 0) return;
  const int width = rank + rope, row_bytes = fp8_row_bytes(rank, rope, scale_group), groups = rank / scale_group;
  const bf16* src = latent + static_cast<int64_t>(token) * width;
  uint8_t* dst = cache + static_cast<int64_t>(slot) * row_bytes;
  float x[4];
  const __nv_bfloat162 lo = reinterpret_cast<const __nv_bfloat162*>(src)[2 * tid];
  const __nv_bfloat162 hi = reinterpret_cast<const __nv_bfloat162*>(src)[2 * tid + 1];
  x[0] = __low2float(lo); x[1] = __high2float(lo); x[2] = __low2float(hi); x[3] = __high2float(hi);
  s_amax[tid] = fmaxf(fmaxf(fabsf(x[0]), fabsf(x[1])), fmaxf(fabsf(x[2]), fabsf(x[3])));
  __syncthreads();
  float* s_scale = s_amax + rank / 4;
  if (tid < groups) {
    float amax = 0.f;
    for (int i = tid * scale_group / 4; i < (tid + 1) * scale_group / 4; ++i) amax = fmaxf(amax, s_amax[i]);
    const float s = amax > 0.f ? __fdiv_rn(amax, kE4m3Max) : 1.f;
    s_scale[tid] = s;
    reinterpret_cast<float*>(dst + rank)[tid] = s;
  }
  __syncthreads();
  const float s = s_scale[4 * tid / scale_group];
  uint32_t packed = 0;
#pragma unroll
  for (int e = 0; e < 4; ++e)
    packed |= static_cast<uint32_t>(__nv_cvt_float_to_fp8(__fdiv_rn(x[e], s), __NV_SATFINITE, __NV_E4M3)) << (8 * e);
  reinterpret_cast<uint32_t*>(dst)[tid] = packed;
  // rope: bf16 pairs (the rope block starts 4-byte aligned)
  for (int c = tid; c < rope / 2; c += blockDim.x)
    reinterpret_cast<uint32_t*>(dst + rank + 4 * groups)[c] = reinterpret_cast<const uint32_t*>(src + rank)[c];
}

// 8 E4M3 codes (one uint2) times `scale` -> 8 bf16 (one uint4): e4m3 -> half is exact, the
// product is fp32, then round to nearest even.
__device__ __forceinline__ uint4 dequant8(uint2 codes, float scale) {
  uint32_t out[4];
  const uint32_t words[2] = {codes.x, codes.y};
#pragma unroll
  for (int w = 0; w < 2; ++w)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __half2_raw raw =
          __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(words[w] >> (16 * h)), __NV_E4M3);
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&raw));
      out[2 * w + h] = pack_bf16(f.x * scale, f.y * scale);
    }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// 4 E4M3 codes -> two f16x2 words (bytes 0,1 -> lo, bytes 2,3 -> hi; the lower byte in the
// lower half): exact (every e4m3 value is a normal f16), one hardware cvt per pair.
__device__ __forceinline__ void e4m3x4_to_f16x4(uint32_t codes, uint32_t& lo, uint32_t& hi) {
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(codes));
}

__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16-byte chunk `ch` (8 channels) of an fp8 row in bf16: chunks < R/8 are dequantised
// codes, the rest the rope values (row 16-byte aligned: R % 16 == 0 and (4R/Q) % 16 == 0).
// Q = 1 << scale_shift (the launchers take powers of two: every Q dividing the K3 and tiny ranks).
__device__ __forceinline__ uint4 fp8_row_chunk(const uint8_t* row, int ch, int rank, int scale_shift, int groups) {
  if (ch < rank / 8) {
    const float s = reinterpret_cast<const float*>(row + rank)[(ch * 8) >> scale_shift];
    return dequant8(*reinterpret_cast<const uint2*>(row + ch * 8), s);
  }
  return *reinterpret_cast<const uint4*>(row + rank + 4 * groups + (ch - rank / 8) * 16);
}

// The expanded prefill over the fp8 cache: the keys [pass_begin, pass_begin + pass_keys) of
// the flattened step (prefill_expanded.cuh) dequantised into bf16 rows [pass_keys, R+DR]
// that expand_latents_kernel reads instead of the paged cache. One warp per key.
struct DequantPassParams {
  const uint8_t* cache;
  const int* block_tables;
  const int* key_offsets;
  bf16* flat;
  int num_seqs, max_blocks, block_size;
  int rank, rope, scale_group;
  int pass_begin, pass_keys;
};

__global__ void __launch_bounds__(256) dequantize_pass_kernel(const DequantPassParams p) {
  const int total_keys = __ldg(p.key_offsets + p.num_seqs);
  const int valid = min(p.pass_keys, total_keys - p.pass_begin);
  const int lane = threadIdx.x & 31, groups = p.rank / p.scale_group, width = p.rank + p.rope;
  const int row_bytes = fp8_row_bytes(p.rank, p.rope, p.scale_group), shift = __ffs(p.scale_group) - 1;
  for (int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < valid; r += (gridDim.x * blockDim.x) >> 5) {
    const int64_t slot =
        key_slot(p.key_offsets, p.block_tables, p.num_seqs, p.max_blocks, p.block_size, p.pass_begin + r);
    const uint8_t* row = p.cache + slot * row_bytes;
    uint4* dst = reinterpret_cast<uint4*>(p.flat + static_cast<int64_t>(r) * width);
    for (int ch = lane; ch < width / 8; ch += 32) dst[ch] = fp8_row_chunk(row, ch, p.rank, shift, groups);
  }
}

}  // namespace k3::mla
