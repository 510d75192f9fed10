// Token recurrence of KDA (spec §4.5.6) for any number of tokens per sequence: decode
// (usually one token), speculative verify (a few), and the exact fallback for prefill.
//
// One CTA per (sequence, head) owns that head's D x D fp32 state in registers and the 3D
// conv channels of the head, so the conv state is updated in place by the same CTA that
// read it. The state is read and written once per call; that is the whole cost at decode,
// so the state loads are issued first (16-byte vectors for D = 128), right after the one
// round trip that fetches the sequence's slot, and unconditionally (a new sequence's
// loaded row is simply ignored) so that no branch on a loaded flag delays them.
// Measured alternatives (bench/NOTES_kda.md): the state in shared memory through cp.async
// (3 CTAs/SM) and CTAs of 32 value columns (8 CTAs/SM) were both slower.
#pragma once

#include "k3/kda/params.cuh"

namespace k3 {
namespace kda {

constexpr int kRecThreads = 256;

template <int N> struct FloatVec;
template <> struct FloatVec<1> { using T = float; };
template <> struct FloatVec<2> { using T = float2; };
template <> struct FloatVec<4> { using T = float4; };

template <int D, int W>
__global__ void __launch_bounds__(kRecThreads, 2) recurrent_kernel(Params p) {
  constexpr int kWarps = kRecThreads / 32;
  constexpr int RK = D / kWarps;  // state rows (key channels) per thread
  constexpr int VPL = D / 32;     // state columns (value channels) per thread
  constexpr int kChanIters = (3 * D + kRecThreads - 1) / kRecThreads;
  using Vec = typename FloatVec<VPL>::T;

  __shared__ float s_q[D], s_k[D], s_v[D], s_alpha[D];
  __shared__ float s_red[2][kWarps][D];
  __shared__ float s_norm[2];
  __shared__ float s_beta;

  const int b = blockIdx.x, h = blockIdx.y;
  const int H = p.num_heads, P = H * D, P3 = 3 * P;
  const int bos = p.cu_seqlens[b], eos = p.cu_seqlens[b + 1];
  const int slot = p.state_slots[b];
  const bool continues = p.has_initial_state[b] != 0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int k0 = warp * RK, v0 = lane * VPL;

  float* state = p.recurrent_state + ((int64_t)slot * H + h) * D * D;
  float S[RK][VPL];
#pragma unroll
  for (int i = 0; i < RK; ++i) {
    Vec x = *reinterpret_cast<const Vec*>(state + (k0 + i) * D + v0);
    const float* xf = reinterpret_cast<const float*>(&x);
#pragma unroll
    for (int j = 0; j < VPL; ++j) S[i][j] = continues ? xf[j] : 0.f;
  }
  if (eos <= bos) return;

  // conv history (raw inputs, oldest first) of this thread's channels of q|k|v of head h
  float hist[kChanIters][W - 1];
  int chan[kChanIters];
#pragma unroll
  for (int it = 0; it < kChanIters; ++it) {
    const int c = threadIdx.x + it * kRecThreads;  // 0..3D-1: part c/D, channel c%D
    chan[it] = c < 3 * D ? (c / D) * P + h * D + (c % D) : -1;
#pragma unroll
    for (int j = 0; j < W - 1; ++j)
      hist[it][j] = (chan[it] >= 0 && continues)
          ? __bfloat162float(p.conv_state[((int64_t)slot * P3 + chan[it]) * (W - 1) + j]) : 0.f;
  }
  const float a_h = expf(p.A_log[h]);
  const float scale = rsqrtf((float)D);

  for (int t = bos; t < eos; ++t) {
#pragma unroll
    for (int it = 0; it < kChanIters; ++it) {
      const int c = threadIdx.x + it * kRecThreads;
      if (chan[it] < 0) continue;
      const float* w = p.conv_weight + (int64_t)chan[it] * W;
      const float x = __bfloat162float(p.qkv[(int64_t)t * P3 + chan[it]]);
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < W - 1; ++j) acc += w[j] * hist[it][j];
      acc += w[W - 1] * x;
#pragma unroll
      for (int j = 0; j + 1 < W - 1; ++j) hist[it][j] = hist[it][j + 1];
      hist[it][W - 2] = x;
      const float y = round_bf16(acc * sigmoid(acc));
      float* dst = c < D ? s_q : (c < 2 * D ? s_k : s_v);
      dst[c % D] = y;
    }
    if (threadIdx.x < D) {
      const int c = h * D + threadIdx.x;
      const float z = __bfloat162float(p.gate[(int64_t)t * P + c]) + p.dt_bias[c];
      s_alpha[threadIdx.x] = expf(decay_gate(z, a_h, p.lower_bound));
    }
    if (threadIdx.x == 0) s_beta = sigmoid(__bfloat162float(p.beta[(int64_t)t * H + h]));
    __syncthreads();
    if (warp < 2) {  // warp 0: |q|^2, warp 1: |k|^2
      const float* x = warp == 0 ? s_q : s_k;
      float ss = 0.f;
      for (int c = lane; c < D; c += 32) ss += x[c] * x[c];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      if (lane == 0) s_norm[warp] = rsqrtf(ss + kL2Eps);
    }
    __syncthreads();
    const float qn = s_norm[0] * scale, kn = s_norm[1], beta = s_beta;
    float kk[RK], qq[RK];
#pragma unroll
    for (int i = 0; i < RK; ++i) {
      const float al = s_alpha[k0 + i];
      kk[i] = s_k[k0 + i] * kn;
      qq[i] = s_q[k0 + i] * qn;
#pragma unroll
      for (int j = 0; j < VPL; ++j) S[i][j] *= al;
    }
    // predicted value M k = Sᵀ k, reduced over the key rows of all warps
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
      float acc = 0.f;
#pragma unroll
      for (int i = 0; i < RK; ++i) acc += S[i][j] * kk[i];
      s_red[0][warp][v0 + j] = acc;
    }
    __syncthreads();
    float u[VPL];
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
      float pred = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) pred += s_red[0][w][v0 + j];
      u[j] = beta * (s_v[v0 + j] - pred);
    }
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
      float acc = 0.f;
#pragma unroll
      for (int i = 0; i < RK; ++i) {
        S[i][j] += kk[i] * u[j];
        acc += S[i][j] * qq[i];
      }
      s_red[1][warp][v0 + j] = acc;
    }
    __syncthreads();
    if (threadIdx.x < D) {
      float o = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) o += s_red[1][w][threadIdx.x];
      p.out[(int64_t)t * P + h * D + threadIdx.x] = __float2bfloat16_rn(o);
    }
  }

#pragma unroll
  for (int i = 0; i < RK; ++i) {
    Vec x;
    float* xf = reinterpret_cast<float*>(&x);
#pragma unroll
    for (int j = 0; j < VPL; ++j) xf[j] = S[i][j];
    *reinterpret_cast<Vec*>(state + (k0 + i) * D + v0) = x;
  }
#pragma unroll
  for (int it = 0; it < kChanIters; ++it) {
    if (chan[it] < 0) continue;
#pragma unroll
    for (int j = 0; j < W - 1; ++j)
      p.conv_state[((int64_t)slot * P3 + chan[it]) * (W - 1) + j] = __float2bfloat16_rn(hist[it][j]);
  }
}

}  // namespace kda
}  // namespace k3
