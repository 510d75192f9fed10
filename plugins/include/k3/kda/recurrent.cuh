// Token recurrence of KDA (spec §4.5.6) for any number of tokens per sequence: decode
// (usually one token), speculative verify (a few), and the exact fallback for prefill.
//
// Two kernels share the per-token math (conv_step, delta_rule_step):
//
// recurrent_kernel (prefill fallback, softplus gate): one CTA per (sequence, head) owns
// that head's D x D fp32 state in registers and the 3D conv channels of the head, so the
// conv state is updated in place by the same CTA that read it. The state loads are issued
// first, right after the one round trip that fetches the sequence's slot.
//
// decode_kernel (k3_kda_decode): at decode the state read + write is the whole cost, and a
// CTA per item pays the chain indices → state → compute → store once per 64 KiB with only
// 2 CTAs per SM resident (bench/NOTES_kda.md). So the decode kernel is persistent: one CTA
// per SM walks items (sequence, head) = blockIdx.x, +gridDim.x, ... with a producer warp
// that streams each item's state, first-token q|k|v|gate rows and conv-state rows into a
// ring of shared-memory stages with bulk copies (cp.async.bulk, mbarrier completion), up
// to kStages items ahead, while 8 consumer warps update the current item in registers and
// store it straight back to global memory. A stage is handed back as soon as the
// consumers hold its contents in registers. Measured: 2-3% faster than the per-item
// design at B = 64-256; both are bound by the per-item work, not by the memory pattern (a
// state-only copy in the same pattern reaches 97% of the copy rate), see bench/NOTES_kda.md.
#pragma once

#include "k3/kda/params.cuh"

namespace k3 {
namespace kda {

constexpr int kRecThreads = 256;     // recurrent_kernel
constexpr int kDecodeThreads = 256;  // decode_kernel's consumer threads (plus a producer warp)

template <int N> struct FloatVec;
template <> struct FloatVec<1> { using T = float; };
template <> struct FloatVec<2> { using T = float2; };
template <> struct FloatVec<4> { using T = float4; };

// Thread layout of the D x D state over NT threads: warp w holds key rows
// [w·RK, (w+1)·RK), lane l holds value columns [l·VPL, (l+1)·VPL).
template <int D, int NT>
struct StateTile {
  static constexpr int kWarps = NT / 32;
  static constexpr int RK = D / kWarps;
  static constexpr int VPL = D / 32;
  static constexpr int kChanIters = (3 * D + NT - 1) / NT;
  using Vec = typename FloatVec<VPL>::T;
};

// Shared scratch of one token step.
template <int D, int NT>
struct StepScratch {
  float q[D], k[D], v[D], alpha[D];
  float red[2][NT / 32][D];
  float norm[2];
  float beta;
};

// Causal conv of one channel at one token (raw input x, history oldest first), SiLU and
// the bf16 rounding of the model; shifts x into the history.
template <int W>
__device__ __forceinline__ float conv_step(float (&hist)[W - 1], const float* w, float x) {
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < W - 1; ++j) acc += w[j] * hist[j];
  acc += w[W - 1] * x;
#pragma unroll
  for (int j = 0; j + 1 < W - 1; ++j) hist[j] = hist[j + 1];
  hist[W - 2] = x;
  return round_bf16(acc * sigmoid(acc));
}

// Destination of conv channel c (0..3D-1: q, k, v of the head) in the scratch.
template <int D, int NT>
__device__ __forceinline__ float* conv_dst(StepScratch<D, NT>& sm, int c) {
  return c < D ? sm.q : (c < 2 * D ? sm.k : sm.v);
}

// Everything of one token after q, k, v (conv outputs), alpha and beta are in the scratch:
// l2 norms, decay, delta rule, output. Threads 0..NT-1; `sync` is their barrier.
template <int D, int NT, class Sync>
__device__ __forceinline__ void delta_rule_step(
    float (&S)[StateTile<D, NT>::RK][StateTile<D, NT>::VPL], StepScratch<D, NT>& sm,
    __nv_bfloat16* out, Sync sync) {
  using Tile = StateTile<D, NT>;
  constexpr int RK = Tile::RK, VPL = Tile::VPL;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int k0 = warp * RK, v0 = lane * VPL;
  sync();
  if (warp < 2) {  // warp 0: |q|^2, warp 1: |k|^2
    const float* x = warp == 0 ? sm.q : sm.k;
    float ss = 0.f;
    for (int c = lane; c < D; c += 32) ss += x[c] * x[c];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) sm.norm[warp] = rsqrtf(ss + kL2Eps);
  }
  sync();
  const float qn = sm.norm[0] * rsqrtf((float)D), kn = sm.norm[1], beta = sm.beta;
  float kk[RK], qq[RK];
#pragma unroll
  for (int i = 0; i < RK; ++i) {
    const float al = sm.alpha[k0 + i];
    kk[i] = sm.k[k0 + i] * kn;
    qq[i] = sm.q[k0 + i] * qn;
#pragma unroll
    for (int j = 0; j < VPL; ++j) S[i][j] *= al;
  }
  // predicted value M k = Sᵀ k, reduced over the key rows of all warps
#pragma unroll
  for (int j = 0; j < VPL; ++j) {
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < RK; ++i) acc += S[i][j] * kk[i];
    sm.red[0][warp][v0 + j] = acc;
  }
  sync();
  float u[VPL];
#pragma unroll
  for (int j = 0; j < VPL; ++j) {
    float pred = 0.f;
#pragma unroll
    for (int w = 0; w < Tile::kWarps; ++w) pred += sm.red[0][w][v0 + j];
    u[j] = beta * (sm.v[v0 + j] - pred);
  }
#pragma unroll
  for (int j = 0; j < VPL; ++j) {
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < RK; ++i) {
      S[i][j] += kk[i] * u[j];
      acc += S[i][j] * qq[i];
    }
    sm.red[1][warp][v0 + j] = acc;
  }
  sync();
  if (tid < D) {
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < Tile::kWarps; ++w) o += sm.red[1][w][tid];
    out[tid] = __float2bfloat16_rn(o);
  }
}

struct CtaSync {
  __device__ void operator()() const { __syncthreads(); }
};

template <int D, int W>
__global__ void __launch_bounds__(kRecThreads, 2) recurrent_kernel(Params p) {
  using Tile = StateTile<D, kRecThreads>;
  constexpr int RK = Tile::RK, VPL = Tile::VPL, kChanIters = Tile::kChanIters;
  using Vec = typename Tile::Vec;

  __shared__ StepScratch<D, kRecThreads> sm;

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

  for (int t = bos; t < eos; ++t) {
#pragma unroll
    for (int it = 0; it < kChanIters; ++it) {
      const int c = threadIdx.x + it * kRecThreads;
      if (chan[it] < 0) continue;
      const float x = __bfloat162float(p.qkv[(int64_t)t * P3 + chan[it]]);
      conv_dst(sm, c)[c % D] = conv_step<W>(hist[it], p.conv_weight + (int64_t)chan[it] * W, x);
    }
    if (threadIdx.x < D) {
      const int c = h * D + threadIdx.x;
      const float z = __bfloat162float(p.gate[(int64_t)t * P + c]) + p.dt_bias[c];
      sm.alpha[threadIdx.x] = expf(decay_gate(z, a_h, p.lower_bound));
    }
    if (threadIdx.x == 0) sm.beta = sigmoid(__bfloat162float(p.beta[(int64_t)t * H + h]));
    delta_rule_step<D, kRecThreads>(S, sm, p.out + (int64_t)t * P + h * D, CtaSync{});
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

// ---------------------------------------------------------------------------------------
// decode_kernel: persistent, bulk-copy pipelined (see the top of the file).

// mbarrier and bulk-copy primitives (PTX ISA: mbarrier, cp.async.bulk; sm_90).
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar))
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}
// Global → shared bulk copy (bytes: a multiple of 16, both addresses 16-byte aligned)
// whose completion counts down `bar`'s transaction bytes.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

// The states are read and written once per call: their bulk loads carry an L2 evict-first
// policy and their stores are streaming (st.global.cs). Measured: a build with 512 consumer
// threads ran at half the speed without both hints (bench/NOTES_kda.md).
__device__ __forceinline__ void bulk_load_state(void* dst, const void* src, uint32_t bytes,
                                                uint64_t* bar) {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes),
      "r"(smem_addr(bar)), "l"(policy) : "memory");
}

// One stage of the ring: what the producer copies for one item, byte offsets. As many
// stages (up to 4) as fit next to the step scratch in the 227 KB of a CTA.
template <int D, int W>
struct DecodeStage {
  static constexpr int STATE = 0;                           // [D][D] fp32
  static constexpr int QKV = STATE + D * D * 4;             // [3][D] bf16, first token
  static constexpr int GATE = QKV + 3 * D * 2;              // [D] bf16, first token
  static constexpr int CONV = GATE + D * 2;                 // [3][D][W-1] bf16
  static constexpr int BYTES = CONV + 3 * D * (W - 1) * 2;  // every part a multiple of 16
  static constexpr int kBudget = 227 * 1024 - (int)sizeof(StepScratch<D, kDecodeThreads>) - 256;
  static constexpr int kStages = BYTES * 4 <= kBudget ? 4 : kBudget / BYTES;
  static constexpr int SMEM = kStages * BYTES;
  static_assert(kStages >= 2, "two stages fit in shared memory");
};

constexpr int kStateChunk = 4096;  // floats per bulk copy of a state

// Per-item values the producer passes with a stage.
struct StageMeta {
  int bos, eos, slot, continues;
  float beta;  // raw beta of the first token
};

// This thread's conv weights (kChanIters channels x W taps), dt_bias and A_log of head h:
// fetched one item ahead, since they depend only on the head.
template <int D, int W, int NT>
struct HeadParams {
  float w[StateTile<D, NT>::kChanIters][W];
  float dt_bias, a_log;

  __device__ __forceinline__ void load(const Params& p, int h) {
    const int P = p.num_heads * D, tid = threadIdx.x;
#pragma unroll
    for (int it = 0; it < StateTile<D, NT>::kChanIters; ++it) {
      const int c = tid + it * NT;
      const int ch = c < 3 * D ? (c / D) * P + h * D + c % D : 0;
#pragma unroll
      for (int j = 0; j < W; ++j) w[it][j] = p.conv_weight[(int64_t)ch * W + j];
    }
    dt_bias = p.dt_bias[h * D + (tid < D ? tid : 0)];
    a_log = p.A_log[h];
  }
};

struct ConsumerSync {  // named barrier 1: the consumer threads, not the producer warp
  __device__ void operator()() const {
    asm volatile("bar.sync 1, %0;" ::"n"(kDecodeThreads) : "memory");
  }
};

template <int D, int W>
__global__ void __launch_bounds__(kDecodeThreads + 32, 1) decode_kernel(Params p) {
  constexpr int NT = kDecodeThreads, kConsumerWarps = NT / 32;
  using Tile = StateTile<D, NT>;
  using Stage = DecodeStage<D, W>;
  constexpr int RK = Tile::RK, VPL = Tile::VPL, kChanIters = Tile::kChanIters;
  constexpr int NS = Stage::kStages;
  using Vec = typename Tile::Vec;

  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ StepScratch<D, NT> sm;
  __shared__ StageMeta meta[NS];
  __shared__ __align__(8) uint64_t full[NS], empty[NS];

  const int H = p.num_heads, P = H * D, P3 = 3 * P;
  const int total = p.num_seqs * H;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    for (int s = 0; s < NS; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == kConsumerWarps) {
    // Producer. Lanes 0-3 fetch the next item's cu_seqlens[b], cu_seqlens[b+1], slot and
    // initial-state flag one item ahead; lane 0 issues the copies.
    auto fetch = [&](int item) {
      const int b = item / H;
      if (item >= total || lane > 3) return 0;
      const int* src = lane < 2 ? p.cu_seqlens + b + lane
                                : (lane == 2 ? p.state_slots + b : p.has_initial_state + b);
      return *src;
    };
    int mine = fetch(blockIdx.x);
    for (int k = 0, item = blockIdx.x; item < total; ++k, item += gridDim.x) {
      const int next = fetch(item + gridDim.x);
      const int bos = __shfl_sync(0xffffffffu, mine, 0), eos = __shfl_sync(0xffffffffu, mine, 1);
      const int slot = __shfl_sync(0xffffffffu, mine, 2);
      const int continues = __shfl_sync(0xffffffffu, mine, 3) != 0;
      mine = next;
      if (lane != 0) continue;
      const int s = k % NS, h = item % H;
      mbar_wait(&empty[s], ((k / NS) & 1) ^ 1);
      unsigned char* st = ring + s * Stage::BYTES;
      if (eos > bos) {
        mbar_expect_tx(&full[s], 4 * D * 2 + (continues ? D * D * 4 + 3 * D * (W - 1) * 2 : 0));
        if (continues) {
          const float* src = p.recurrent_state + ((int64_t)slot * H + h) * D * D;
          for (int off = 0; off < D * D; off += kStateChunk)  // 16 KiB per copy
            bulk_load_state(st + Stage::STATE + off * 4, src + off,
                            (D * D < kStateChunk ? D * D : kStateChunk) * 4, &full[s]);
        }
        const __nv_bfloat16* row = p.qkv + (int64_t)bos * P3 + h * D;
        for (int part = 0; part < 3; ++part) {
          bulk_load(st + Stage::QKV + part * D * 2, row + part * P, D * 2, &full[s]);
          if (continues)
            bulk_load(st + Stage::CONV + part * D * (W - 1) * 2,
                      p.conv_state + ((int64_t)slot * P3 + part * P + h * D) * (W - 1),
                      D * (W - 1) * 2, &full[s]);
        }
        bulk_load(st + Stage::GATE, p.gate + (int64_t)bos * P + h * D, D * 2, &full[s]);
      }
      meta[s] = StageMeta{bos, eos, slot, continues,
                          eos > bos ? __bfloat162float(p.beta[(int64_t)bos * H + h]) : 0.f};
      mbar_arrive(&full[s]);
    }
    return;
  }

  // Consumers: NT threads, the layout of StateTile.
  const int tid = threadIdx.x;
  const int k0 = warp * RK, v0 = lane * VPL;
  HeadParams<D, W, NT> cur;
  cur.load(p, blockIdx.x % H);
  for (int k = 0, item = blockIdx.x; item < total; ++k, item += gridDim.x) {
    HeadParams<D, W, NT> next;
    next.load(p, (item + gridDim.x) % H);
    const int s = k % NS, h = item % H;
    mbar_wait(&full[s], (k / NS) & 1);
    const StageMeta m = meta[s];
    const unsigned char* st = ring + s * Stage::BYTES;
    const bool active = m.eos > m.bos;

    // everything this thread needs from the stage, into registers; then hand it back
    float S[RK][VPL];
    float hist[kChanIters][W - 1], x0[kChanIters];
    float gate0 = 0.f;
    if (active) {
      const float* st_state = reinterpret_cast<const float*>(st + Stage::STATE);
#pragma unroll
      for (int i = 0; i < RK; ++i) {
        Vec x{};  // a new sequence starts from zero (nothing was copied)
        if (m.continues) x = *reinterpret_cast<const Vec*>(st_state + (k0 + i) * D + v0);
        const float* xf = reinterpret_cast<const float*>(&x);
#pragma unroll
        for (int j = 0; j < VPL; ++j) S[i][j] = xf[j];
      }
      const __nv_bfloat16* st_qkv = reinterpret_cast<const __nv_bfloat16*>(st + Stage::QKV);
      const __nv_bfloat16* st_conv = reinterpret_cast<const __nv_bfloat16*>(st + Stage::CONV);
#pragma unroll
      for (int it = 0; it < kChanIters; ++it) {
        const int c = tid + it * NT;
        x0[it] = c < 3 * D ? __bfloat162float(st_qkv[c]) : 0.f;
#pragma unroll
        for (int j = 0; j < W - 1; ++j)
          hist[it][j] = (c < 3 * D && m.continues) ? __bfloat162float(st_conv[c * (W - 1) + j]) : 0.f;
      }
      if (tid < D)
        gate0 = __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(st + Stage::GATE)[tid]);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[s]);

    if (active) {
      const float a_h = expf(cur.a_log);
      for (int t = m.bos; t < m.eos; ++t) {
        const bool first = t == m.bos;
#pragma unroll
        for (int it = 0; it < kChanIters; ++it) {
          const int c = tid + it * NT;
          if (c >= 3 * D) continue;
          const float x = first ? x0[it]
              : __bfloat162float(p.qkv[(int64_t)t * P3 + (c / D) * P + h * D + c % D]);
          conv_dst(sm, c)[c % D] = conv_step<W>(hist[it], cur.w[it], x);
        }
        if (tid < D) {
          const float g = first ? gate0 : __bfloat162float(p.gate[(int64_t)t * P + h * D + tid]);
          sm.alpha[tid] = expf(decay_gate(g + cur.dt_bias, a_h, p.lower_bound));
        }
        if (tid == 0)
          sm.beta = sigmoid(first ? m.beta : __bfloat162float(p.beta[(int64_t)t * H + h]));
        delta_rule_step<D, NT>(S, sm, p.out + (int64_t)t * P + h * D, ConsumerSync{});
      }

      float* state = p.recurrent_state + ((int64_t)m.slot * H + h) * D * D;
#pragma unroll
      for (int i = 0; i < RK; ++i) {
        Vec x;
        float* xf = reinterpret_cast<float*>(&x);
#pragma unroll
        for (int j = 0; j < VPL; ++j) xf[j] = S[i][j];
        __stcs(reinterpret_cast<Vec*>(state + (k0 + i) * D + v0), x);
      }
#pragma unroll
      for (int it = 0; it < kChanIters; ++it) {
        const int c = tid + it * NT;
        if (c >= 3 * D) continue;
        __nv_bfloat16* row = p.conv_state + ((int64_t)m.slot * P3 + (c / D) * P + h * D + c % D) * (W - 1);
#pragma unroll
        for (int j = 0; j < W - 1; ++j) row[j] = __float2bfloat16_rn(hist[it][j]);
      }
    }
    cur = next;
  }
}

}  // namespace kda
}  // namespace k3
