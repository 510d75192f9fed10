// KDA kernel parameters and the per-element math shared by the prefill and decode kernels
// (spec §4.5.2-§4.5.5). Framework-free: raw device pointers, sizes and attributes only.
#pragma once

#include <cuda_bf16.h>
#include <cstdint>

namespace k3 {
namespace kda {

// One struct for both ops: the contract's inputs in order, then the attributes.
struct Params {
  const __nv_bfloat16* qkv;       // [T, 3P] raw q|k|v projections (before the conv)
  const __nv_bfloat16* gate;      // [T, P] raw decay-gate projection
  const __nv_bfloat16* beta;      // [T, H] raw beta projection
  const float* conv_weight;       // [3P, W]
  const float* A_log;             // [H]
  const float* dt_bias;           // [P]
  const int* cu_seqlens;          // [B+1]
  const int* state_slots;         // [B]
  const int* has_initial_state;   // [B]
  __nv_bfloat16* conv_state;      // [S, 3P, W-1], in place
  float* recurrent_state;         // [S, H, K, V] fp32 K-major, in place
  const int* snapshot_offsets;    // [B, N] prefix-cache snapshot points (tokens into the step), -1: none
  const int* snapshot_rows;       // [B, N] their rows of the snapshot pools
  __nv_bfloat16* snapshot_conv;   // [Ns, 3P, W-1], written at the points (chunked prefill only)
  float* snapshot_recurrent;      // [Ns, H, K, V], written at the points (chunked prefill only)
  int snapshot_width;             // N
  int snapshot_slots;             // Ns
  __nv_bfloat16* out;             // [T, P]
  int num_seqs;                   // B
  int num_heads;                  // H
  float lower_bound;              // < 0: bounded gate; 0: softplus gate
};

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kL2Eps = 1e-6f;

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// Intrinsics version for the prefill's per-element work: a few fp32 ulp, which can flip
// the bf16 rounding of a conv output now and then (well inside the prefill tolerance;
// the decode kernel keeps the accurate one and matches the fp32 reference to ~1e-6).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_sigmoid(float x) {
  return __fdividef(1.f, 1.f + __expf(-x));
}

__device__ __forceinline__ float round_bf16(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}

// Log-decay g of one key channel from the raw gate f (dt_bias already added), §4.5.3.
__device__ __forceinline__ float decay_gate(float z, float a, float lower_bound) {
  if (lower_bound < 0.f) return lower_bound * sigmoid(a * z);
  const float softplus = z > 20.f ? z : log1pf(expf(z));  // torch's threshold
  return -a * softplus;
}

// Raw (pre-conv) input of channel ch at absolute token s of a sequence starting at bos:
// tokens before bos come from the conv state (oldest first) or are zero for a new sequence.
template <int W>
__device__ __forceinline__ float conv_input(const Params& p, int P3, int s, int bos, int ch,
                                            int slot, bool continues) {
  if (s >= bos) return __bfloat162float(p.qkv[(int64_t)s * P3 + ch]);
  if (!continues) return 0.f;
  return __bfloat162float(p.conv_state[((int64_t)slot * P3 + ch) * (W - 1) + (s - bos + W - 1)]);
}

}  // namespace kda
}  // namespace k3
