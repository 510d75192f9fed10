// The skinny bf16 linear (k3/linear_api.h): one warp per output feature, 4 warps per CTA.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "k3/linear_api.h"

namespace k3 {
namespace linear {

constexpr int kWarps = 4;     // per CTA: small CTAs, so every CTA of a decode projection is resident at once
constexpr int kUnroll = 4;    // 16-byte weight pieces in flight per lane (64 B; ~8 KiB per CTA)

// 8 bf16 (one 16-byte piece) as fp32: a bf16 is the high half of its fp32.
__device__ __forceinline__ void unpack8(const uint4& raw, float (&v)[8]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(w[i] << 16);
    v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

template <int T>
__global__ void __launch_bounds__(32 * kWarps) skinny_linear_kernel(K3SkinnyLinearParams p) {
  const int row = blockIdx.x * kWarps + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= p.n) return;
  const int pieces = p.k / 8;
  // the weight is read once: streamed past L1 (evict-first), leaving L1 to the tokens' rows
  const uint4* w = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.weight) +
                                                  static_cast<int64_t>(row) * p.k);
  const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(p.x);
  float acc[T];
#pragma unroll
  for (int t = 0; t < T; ++t) acc[t] = 0.0f;
  for (int base = lane; base < pieces; base += 32 * kUnroll) {
    uint4 wv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = base + 32 * u;
      if (c < pieces) wv[u] = __ldcs(w + c);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = base + 32 * u;
      if (c < pieces) {
        float wf[8];
        unpack8(wv[u], wf);
#pragma unroll
        for (int t = 0; t < T; ++t) {
          float xf[8];
          unpack8(__ldg(reinterpret_cast<const uint4*>(x + t * p.x_row_stride) + c), xf);
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[t] = fmaf(wf[j], xf[j], acc[t]);
        }
      }
    }
  }
#pragma unroll
  for (int t = 0; t < T; ++t) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], o);
  }
  if (lane < T) {  // lane t writes token t (every lane holds every sum after the butterfly)
    float v = acc[0];
#pragma unroll
    for (int t = 1; t < T; ++t) v = lane == t ? acc[t] : v;
    const int64_t at = static_cast<int64_t>(lane) * p.n + row;
    if (p.out_fp32) {
      static_cast<float*>(p.out)[at] = v;
    } else {
      static_cast<__nv_bfloat16*>(p.out)[at] = __float2bfloat16_rn(v);
    }
  }
}

}  // namespace linear
}  // namespace k3
