// Conv-state update shared by the prefill and decode launches (spec §6.2).
#pragma once

#include "k3/kda/params.cuh"

namespace k3 {
namespace kda {

// After a call: the conv state of every sequence becomes its last W-1 raw inputs (older
// ones from the previous state when the sequence is shorter than W-1). A launch of its
// own, after the main kernel, because every value tile of a head reads the old state.
template <int W>
__global__ void conv_state_kernel(Params p, int P3) {
  const int b = blockIdx.y, ch = blockIdx.x * blockDim.x + threadIdx.x;
  const int bos = p.cu_seqlens[b], eos = p.cu_seqlens[b + 1], len = eos - bos;
  if (ch >= P3 || len <= 0) return;
  const int slot = p.state_slots[b];
  const bool continues = p.has_initial_state[b] != 0;
  __nv_bfloat16* row = p.conv_state + ((int64_t)slot * P3 + ch) * (W - 1);
  __nv_bfloat16 x[W - 1];
#pragma unroll
  for (int k = 0; k < W - 1; ++k) {
    const int s = eos - (W - 1) + k;
    x[k] = s >= bos ? p.qkv[(int64_t)s * P3 + ch]
                    : (continues ? row[len + k] : __float2bfloat16_rn(0.f));
  }
#pragma unroll
  for (int k = 0; k < W - 1; ++k) row[k] = x[k];
}

// Conv state at each prefix-cache snapshot point o of a sequence (one z-slice of the grid per
// entry of snapshot_offsets): the W-1 raw inputs before token o, from the old conv state where
// they precede the step. Runs before the kernel that overwrites that state. `verdict`: the chunk
// table's snapshot word (chunk.cuh); with a bad entry anywhere in the step it writes nothing, and
// the checked points and rows are in bounds.
template <int W>
__global__ void conv_snapshot_kernel(Params p, int P3, const int* verdict) {
  const int b = blockIdx.y, n = blockIdx.z, ch = blockIdx.x * blockDim.x + threadIdx.x;
  const int at = b * p.snapshot_width + n;
  const int o = p.snapshot_offsets[at];
  if (ch >= P3 || o < 0 || *verdict != 0) return;
  const int row = p.snapshot_rows[at], bos = p.cu_seqlens[b];
  const bool continues = p.has_initial_state[b] != 0;
  const __nv_bfloat16* old = p.conv_state + ((int64_t)p.state_slots[b] * P3 + ch) * (W - 1);
  __nv_bfloat16* dst = p.snapshot_conv + ((int64_t)row * P3 + ch) * (W - 1);
#pragma unroll
  for (int k = 0; k < W - 1; ++k) {
    const int s = o - (W - 1) + k;  // token index into the sequence's step tokens
    dst[k] = s >= 0 ? p.qkv[(int64_t)(bos + s) * P3 + ch]
                    : (continues ? old[o + k] : __float2bfloat16_rn(0.f));
  }
}

}  // namespace kda
}  // namespace k3
