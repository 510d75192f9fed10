// Token recurrence of KDA (spec §4.5.6) for any number of tokens per sequence: decode
// (usually one token), speculative verify (a few), and the exact fallback for prefill.
//
// Two kernels share the conv step (conv_step); the token math is laid out per kernel:
//
// recurrent_kernel (prefill fallback, softplus gate): one CTA per (sequence, head) owns
// that head's D x D fp32 state in registers and the 3D conv channels of the head, so the
// conv state is updated in place by the same CTA that read it. The state loads are issued
// first, right after the one round trip that fetches the sequence's slot. As a prefill it
// also writes the prefix-cache snapshots' recurrent rows (the conv rows: conv_snapshot_kernel).
//
// decode_kernel (k3_kda_decode): at decode the state read + write is the whole cost, and a
// CTA per item pays the chain indices → state → compute → store once per 64 KiB with only
// 2 CTAs per SM resident (bench/NOTES_kda.md). So the decode kernel is persistent: one CTA
// per SM walks items (sequence, head) = blockIdx.x, +gridDim.x, ... with a producer warp
// that streams each item's state, first-token q|k|v|gate rows and conv-state rows into a
// shared-memory stage with bulk copies (cp.async.bulk, mbarrier completion), one item ahead.
// Two consumer groups of 4 warps take alternate items: a group loads the stage into
// registers, hands it back, runs the token steps, writes the new state and conv rows into a
// shared out buffer of its own, and one of its threads bulk-stores them (cp.async.bulk
// shared → global), while the other group does the same one item apart. Inside a group each
// warp owns a slice of value columns over all key rows, so both reductions are warp shuffles
// and a token step has one barrier (session 13; session 11's single 8-warp consumer needed
// four and cross-warp reductions through shared memory).
#pragma once

#include "k3/common/warpgroup.cuh"
#include "k3/kda/params.cuh"

namespace k3 {
namespace kda {

constexpr int kRecThreads = 256;     // recurrent_kernel

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

// The state of S's owner threads (StateTile layout) to a D x D row-major block.
template <int D, int NT>
__device__ __forceinline__ void store_state_tile(
    float* dst, const float (&S)[StateTile<D, NT>::RK][StateTile<D, NT>::VPL]) {
  using Tile = StateTile<D, NT>;
  const int k0 = threadIdx.x / 32 * Tile::RK, v0 = threadIdx.x % 32 * Tile::VPL;
#pragma unroll
  for (int i = 0; i < Tile::RK; ++i) {
    typename Tile::Vec x;
    float* xf = reinterpret_cast<float*>(&x);
#pragma unroll
    for (int j = 0; j < Tile::VPL; ++j) xf[j] = S[i][j];
    *reinterpret_cast<typename Tile::Vec*>(dst + (k0 + i) * D + v0) = x;
  }
}

// `snapshot_verdict`: the chunk table's snapshot word (chunk.cuh) for a prefill that takes
// snapshots, null for none (decode).
template <int D, int W>
__global__ void __launch_bounds__(kRecThreads, 2) recurrent_kernel(Params p, const int* snapshot_verdict) {
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
  // prefix-cache snapshot points of this sequence (checked, increasing): the next one
  const int* snap_at = p.snapshot_offsets + (int64_t)b * p.snapshot_width;
  const bool snapshots = snapshot_verdict != nullptr && p.snapshot_width > 0 && *snapshot_verdict == 0;
  int snap = 0, snap_tokens = snapshots ? snap_at[0] : -1;

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
    if (t + 1 - bos == snap_tokens) {  // uniform: every thread stores its own registers
      const int row = p.snapshot_rows[(int64_t)b * p.snapshot_width + snap];  // in bounds: checked
      store_state_tile<D, kRecThreads>(p.snapshot_recurrent + ((int64_t)row * H + h) * D * D, S);
      snap_tokens = ++snap < p.snapshot_width ? snap_at[snap] : -1;
    }
  }

  store_state_tile<D, kRecThreads>(state, S);
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

// Shared → global bulk copy (bytes: a multiple of 16, both addresses 16-byte aligned),
// tracked by the issuing thread's bulk async-groups.
__device__ __forceinline__ void bulk_store(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
               ::"l"(dst), "r"(smem_addr(src)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// this thread's committed bulk stores have read their shared source (it may be rewritten)
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
// ... and their writes are done
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// The state stores carry no cache hint: with the ping-pong consumers, L2 evict-first loads +
// st.global.cs stores ran 5-6% slower at B = 256 (session 13; session 11's single 8-warp
// consumer had run at half speed without them), evict-first stores alone gave 85.1% of copy
// against 86.0% (session 17), evict-last ones 86.8% against 87.4% and evict-last bulk stores
// 88.6% against 89.4% (session 20).
// The copies of the state and conv-state rows are L2 evict-last, all of the lines, so that the
// in-place stores of the same lines, about an item later, find them in L2 (session 16: +2.5
// points of copy at B=256; session 17: half of the lines evict-last 84.0%; session 20, with the
// bulk-stored state: unhinted copies 85.8% against 89.8%). bench/NOTES_kda.md.
__device__ __forceinline__ uint64_t l2_policy_evict_last() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ void bulk_load_hint(void* dst, const void* src, uint32_t bytes,
                                               uint64_t* bar, uint64_t pol) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
      ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(pol) : "memory");
}

// Consumers of decode_kernel: kDecodeGroups groups of 4 warps; group g takes the CTA's
// items g, g + kDecodeGroups, ... (ping-pong), so one group's loads from the stage, conv
// and reductions run while the other group's state stores drain.
// A group holds a whole 128 x 128 state (128 floats per thread): more than the 168
// registers that 9+ warps per CTA leave each thread, so the producer is a warpgroup of its
// own (one working warp) that gives its registers to the consumers (setmaxnreg).
constexpr int kGroupThreads = 128;
constexpr int kDecodeGroups = 2;
constexpr int kDecodeThreads = kDecodeGroups * kGroupThreads;  // consumer threads
constexpr int kDecodeBlock = kDecodeThreads + 128;             // + the producer warpgroup
constexpr int kProducerRegs = 40, kConsumerRegs = 232;         // 8 x 232 + 4 x 40 warps ≤ 64 K

// Thread layout of one item's D x D state over a group: warp w owns the value columns
// [w·CW, (w+1)·CW); within it, LPR lanes share a key row (4 columns each) and lane l holds
// the key rows [kg·RK, (kg+1)·RK), kg = l / LPR. Both reductions over the key rows stay
// inside the warp (registers, then shuffles across the KG lanes of a column); reading the
// stage, a quarter warp reads 128 contiguous bytes of one row at D = 128 (no bank conflict).
template <int D>
struct GroupTile {
  static constexpr int kWarps = kGroupThreads / 32;
  static constexpr int CW = D / kWarps;
  static constexpr int LPR = CW / 4;
  static constexpr int KG = 32 / LPR;
  static constexpr int RK = D / KG;
  static constexpr int RV = RK % 4 == 0 ? 4 : RK;  // rows per vector read of q, k, alpha
  static constexpr int kChanIters = (3 * D + kGroupThreads - 1) / kGroupThreads;
  using RowVec = typename FloatVec<RV>::T;
  static_assert(LPR >= 1 && 32 % LPR == 0 && RK >= 1 && RK % RV == 0, "D = 32, 64 or 128");
};

// Conv outputs and decay of one token of one group; two per group, used alternately, so
// that one barrier per token suffices (a warp writing token n+2's scratch has passed the
// barrier of token n+1, which every warp reaches only after it has read token n's).
template <int D>
struct TokenScratch {
  float q[D], k[D], v[D], alpha[D];
};

// The stage: what the producer copies for one item, byte offsets; after it, the consumer
// groups' out buffers.
template <int D, int W>
struct DecodeStage {
  static constexpr int STATE = 0;                           // [D][D] fp32
  static constexpr int QKV = STATE + D * D * 4;             // [3][D] bf16, first token
  static constexpr int GATE = QKV + 3 * D * 2;              // [D] bf16, first token
  static constexpr int CONV = GATE + D * 2;                 // [3][D][W-1] bf16
  static constexpr int BYTES = CONV + 3 * D * (W - 1) * 2;  // every part a multiple of 16
  static constexpr int kBudget =
      227 * 1024 - 2 * kDecodeGroups * (int)sizeof(TokenScratch<D>) - 256;
  // one stage: B=256 87.4% of copy against two stages' 85.8% with the state stored from the
  // registers (session 20, same process; session 16: three stages 83.7%)
  static constexpr int kStages = 1;
  // per consumer group, the item's new state and conv rows, bulk-stored from there: 89.4% of
  // copy at B=256 against 87.4% with both stored from the registers (session 20; only the
  // conv rows bulk-stored: 85.9%; only the state: 89.4% against 89.8% in another call)
  static constexpr int OUT_CONV = D * D * 4;
  static constexpr int OUT_BYTES = OUT_CONV + 3 * D * (W - 1) * 2;
  static constexpr int OUTS = kStages * BYTES;  // offset of group 0's out buffer
  static constexpr int SMEM = OUTS + kDecodeGroups * OUT_BYTES;
  static_assert(kStages >= 1 && SMEM <= kBudget, "the stages fit in shared memory");
  // "stage full" barriers: one per (stage, consumer group) pair, item k on k % FULL_BARS, so
  // that a barrier's consecutive phases are items of one group. With one barrier per stage,
  // items k - kStages and k of a stage belong to different groups when kStages is odd, and a
  // group that has finished item k - 2 could wait for item k while the stage's phase of item
  // k - kStages (the other group's) was still pending: a parity wait cannot tell the two
  // phases apart and passes (session 16: illegal address at B = 64, one token per sequence).
  static constexpr int FULL_BARS = kStages * kDecodeGroups;
};

// floats per bulk copy of a state, 16 KiB (one 64 KiB copy per state measured the same at B >= 4
// and +0.5 us at B=1 with unhinted loads, session 23)
constexpr int kStateChunk = 4096;
constexpr int64_t kUnhintedStateBytes = 32 << 20;  // all states of a launch: unhinted copies up to here

// Per-item values the producer passes with a stage.
struct StageMeta {
  int bos, eos, slot, continues;
  float beta;  // raw beta of the first token
};

// Everything of one token after the group's conv outputs and decay are in `sc` (and the
// group's barrier): l2 norms (each warp computes them itself), decay, delta rule, output.
template <int D>
__device__ __forceinline__ void group_delta_rule_step(float (&S)[GroupTile<D>::RK][4],
                                                      const TokenScratch<D>& sc, float beta,
                                                      __nv_bfloat16* out, int warp, int lane) {
  using T = GroupTile<D>;
  constexpr int RK = T::RK, RV = T::RV;
  using RowVec = typename T::RowVec;
  const int kg = lane / T::LPR, r0 = kg * RK, v0 = warp * T::CW + (lane % T::LPR) * 4;

  float ssq = 0.f, ssk = 0.f;
#pragma unroll
  for (int c = lane; c < D; c += 32) {
    ssq += sc.q[c] * sc.q[c];
    ssk += sc.k[c] * sc.k[c];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    ssq += __shfl_xor_sync(0xffffffffu, ssq, o);
    ssk += __shfl_xor_sync(0xffffffffu, ssk, o);
  }
  const float qn = rsqrtf(ssq + kL2Eps) * rsqrtf((float)D), kn = rsqrtf(ssk + kL2Eps);

  // decay, then the predicted value M k = Sᵀ k: this thread's rows, then across the KG lanes
  float pred[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int b = 0; b < RK; b += RV) {
    const RowVec al = *reinterpret_cast<const RowVec*>(sc.alpha + r0 + b);
    const RowVec kv = *reinterpret_cast<const RowVec*>(sc.k + r0 + b);
    const float* alf = reinterpret_cast<const float*>(&al);
    const float* kf = reinterpret_cast<const float*>(&kv);
#pragma unroll
    for (int r = 0; r < RV; ++r) {
      const float kk = kf[r] * kn;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        S[b + r][j] *= alf[r];
        pred[j] += S[b + r][j] * kk;
      }
    }
  }
#pragma unroll
  for (int o = T::LPR; o < 32; o <<= 1)
#pragma unroll
    for (int j = 0; j < 4; ++j) pred[j] += __shfl_xor_sync(0xffffffffu, pred[j], o);
  const float4 vv = *reinterpret_cast<const float4*>(sc.v + v0);
  const float u[4] = {beta * (vv.x - pred[0]), beta * (vv.y - pred[1]), beta * (vv.z - pred[2]),
                      beta * (vv.w - pred[3])};

  float o[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int b = 0; b < RK; b += RV) {
    const RowVec kv = *reinterpret_cast<const RowVec*>(sc.k + r0 + b);
    const RowVec qv = *reinterpret_cast<const RowVec*>(sc.q + r0 + b);
    const float* kf = reinterpret_cast<const float*>(&kv);
    const float* qf = reinterpret_cast<const float*>(&qv);
#pragma unroll
    for (int r = 0; r < RV; ++r) {
      const float kk = kf[r] * kn, qq = qf[r] * qn;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        S[b + r][j] += kk * u[j];
        o[j] += S[b + r][j] * qq;
      }
    }
  }
#pragma unroll
  for (int s = T::LPR; s < 32; s <<= 1)
#pragma unroll
    for (int j = 0; j < 4; ++j) o[j] += __shfl_xor_sync(0xffffffffu, o[j], s);
  if (kg == 0) {
    __nv_bfloat162 lo = __floats2bfloat162_rn(o[0], o[1]), hi = __floats2bfloat162_rn(o[2], o[3]);
    uint2 packed;
    packed.x = *reinterpret_cast<uint32_t*>(&lo);
    packed.y = *reinterpret_cast<uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(out + v0) = packed;
  }
}

// The items (sequence, head) of this CTA: a contiguous range of the head-major order
// item = h·B + b, split evenly over the grid, so that consecutive items share a head.
struct CtaItems {
  int begin, count;
  __device__ explicit CtaItems(int total) {
    const int per = total / gridDim.x, extra = total % gridDim.x, c = blockIdx.x;
    begin = c * per + (c < extra ? c : extra);
    count = per + (c < extra ? 1 : 0);
  }
};

__device__ __forceinline__ void group_sync(int group) {  // named barriers 1, 2, ...
  asm volatile("bar.sync %0, %1;" ::"r"(group + 1), "n"(kGroupThreads) : "memory");
}

// The new conv-state rows of the group's item (thread t's channels of head h).
template <int D, int W>
__device__ __forceinline__ void decode_store_conv(const Params& p,
                                                  const float (&hist)[GroupTile<D>::kChanIters][W - 1],
                                                  int t, int h, int slot) {
  const int P = p.num_heads * D, P3 = 3 * P;
#pragma unroll
  for (int it = 0; it < GroupTile<D>::kChanIters; ++it) {
    const int c = t + it * kGroupThreads;
    if (c >= 3 * D) continue;
    __nv_bfloat16* row = p.conv_state + ((int64_t)slot * P3 + (c / D) * P + h * D + c % D) * (W - 1);
#pragma unroll
    for (int j = 0; j < W - 1; ++j) row[j] = __float2bfloat16_rn(hist[it][j]);
  }
}

// Consumer thread of decode_kernel: group `group` (4 warps), thread t of the group, the
// layout of GroupTile.
template <int D, int W>
__device__ __forceinline__ void decode_consumer(const Params& p, unsigned char* ring,
                                                TokenScratch<D> (*scratch)[2],
                                                const StageMeta* meta, uint64_t* full,
                                                uint64_t* empty) {
  using Tile = GroupTile<D>;
  using Stage = DecodeStage<D, W>;
  constexpr int RK = Tile::RK, kChanIters = Tile::kChanIters;
  constexpr int NS = Stage::kStages;
  const int H = p.num_heads, P = H * D, P3 = 3 * P;
  const int total = p.num_seqs * H;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = warp / Tile::kWarps, gwarp = warp % Tile::kWarps, t = threadIdx.x % kGroupThreads;
  const int r0 = (lane / Tile::LPR) * RK, v0 = gwarp * Tile::CW + (lane % Tile::LPR) * 4;
  const CtaItems items(total);
  unsigned char* ob = ring + Stage::OUTS + group * Stage::OUT_BYTES;
  int step = 0;  // tokens this group has run: picks the token scratch
  // at most one item per group (B = 1: 96 items): nothing to overlap, the stores go straight
  // from the registers (session 20: B=1 12.2 µs against 12.6 through the out buffer)
  const bool direct = items.count <= kDecodeGroups;
  for (int k = group; k < items.count; k += kDecodeGroups) {
    const int item = items.begin + k, h = item / p.num_seqs;
    const int s = k % NS;
    mbar_wait(&full[k % Stage::FULL_BARS], (k / Stage::FULL_BARS) & 1);
    const StageMeta m = meta[s];
    const unsigned char* st = ring + s * Stage::BYTES;
    const bool active = m.eos > m.bos;

    // everything this thread needs from the stage, into registers; then hand it back
    float S[RK][4];
    float hist[kChanIters][W - 1], x0[kChanIters];
    float gate0 = 0.f;
    if (active) {
      const float* st_state = reinterpret_cast<const float*>(st + Stage::STATE) + r0 * D + v0;
#pragma unroll
      for (int i = 0; i < RK; ++i) {
        float4 x{};  // a new sequence starts from zero (nothing was copied)
        if (m.continues) x = *reinterpret_cast<const float4*>(st_state + i * D);
        S[i][0] = x.x, S[i][1] = x.y, S[i][2] = x.z, S[i][3] = x.w;
      }
      const __nv_bfloat16* st_qkv = reinterpret_cast<const __nv_bfloat16*>(st + Stage::QKV);
      const __nv_bfloat16* st_conv = reinterpret_cast<const __nv_bfloat16*>(st + Stage::CONV);
#pragma unroll
      for (int it = 0; it < kChanIters; ++it) {
        const int c = t + it * kGroupThreads;
        x0[it] = c < 3 * D ? __bfloat162float(st_qkv[c]) : 0.f;
#pragma unroll
        for (int j = 0; j < W - 1; ++j)
          hist[it][j] = (c < 3 * D && m.continues) ? __bfloat162float(st_conv[c * (W - 1) + j]) : 0.f;
      }
      if (t < D)
        gate0 = __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(st + Stage::GATE)[t]);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[s]);

    if (active) {
      // the head's conv taps, dt_bias and A_log: L1 hits but on a change of head (a CTA's
      // items are consecutive, head-major)
      const float a_h = expf(__ldg(p.A_log + h));
      const float dt_bias = __ldg(p.dt_bias + h * D + (t < D ? t : 0));
      for (int tok = m.bos; tok < m.eos; ++tok, ++step) {
        const bool first = tok == m.bos;
        TokenScratch<D>& sc = scratch[group][step & 1];
#pragma unroll
        for (int it = 0; it < kChanIters; ++it) {
          const int c = t + it * kGroupThreads;
          if (c >= 3 * D) continue;
          const float x = first ? x0[it]
              : __bfloat162float(p.qkv[(int64_t)tok * P3 + (c / D) * P + h * D + c % D]);
          float w[W];
#pragma unroll
          for (int j = 0; j < W; ++j) w[j] = __ldg(p.conv_weight + (int64_t)((c / D) * P + h * D + c % D) * W + j);
          float* dst = c < D ? sc.q : (c < 2 * D ? sc.k : sc.v);
          dst[c % D] = conv_step<W>(hist[it], w, x);
        }
        if (t < D) {
          const float g = first ? gate0 : __bfloat162float(p.gate[(int64_t)tok * P + h * D + t]);
          sc.alpha[t] = expf(decay_gate(g + dt_bias, a_h, p.lower_bound));
        }
        const float beta =
            sigmoid(first ? m.beta : __bfloat162float(p.beta[(int64_t)tok * H + h]));
        // the previous item's bulk stores have read `ob` before anyone passes this barrier
        if (first && t == 0) bulk_wait_read();
        group_sync(group);
        group_delta_rule_step<D>(S, sc, beta, p.out + (int64_t)tok * P + h * D, gwarp, lane);
      }

      if (direct) {
        float* state = p.recurrent_state + ((int64_t)m.slot * H + h) * D * D + r0 * D + v0;
#pragma unroll
        for (int i = 0; i < RK; ++i)
          *reinterpret_cast<float4*>(state + i * D) = make_float4(S[i][0], S[i][1], S[i][2], S[i][3]);
        decode_store_conv<D, W>(p, hist, t, h, m.slot);
        continue;
      }
      float* ob_state = reinterpret_cast<float*>(ob) + r0 * D + v0;
#pragma unroll
      for (int i = 0; i < RK; ++i)
        *reinterpret_cast<float4*>(ob_state + i * D) = make_float4(S[i][0], S[i][1], S[i][2], S[i][3]);
      __nv_bfloat16* ob_conv = reinterpret_cast<__nv_bfloat16*>(ob + Stage::OUT_CONV);
#pragma unroll
      for (int it = 0; it < kChanIters; ++it) {
        const int c = t + it * kGroupThreads;
        if (c >= 3 * D) continue;
#pragma unroll
        for (int j = 0; j < W - 1; ++j) ob_conv[c * (W - 1) + j] = __float2bfloat16_rn(hist[it][j]);
      }
      fence_proxy_async();
      group_sync(group);
      if (t == 0) {
        float* state = p.recurrent_state + ((int64_t)m.slot * H + h) * D * D;
        for (int off = 0; off < D * D; off += kStateChunk)
          bulk_store(state + off, ob + off * 4, (D * D < kStateChunk ? D * D : kStateChunk) * 4);
        for (int part = 0; part < 3; ++part)
          bulk_store(p.conv_state + ((int64_t)m.slot * P3 + part * P + h * D) * (W - 1),
                     ob + Stage::OUT_CONV + part * D * (W - 1) * 2, D * (W - 1) * 2);
        bulk_commit();
      }
    }
  }
  if (t == 0) bulk_wait_all();  // the shared buffer outlives the reads of the stores
}

template <int D, int W>
__global__ void __launch_bounds__(kDecodeBlock, 1) decode_kernel(Params p) {
  constexpr int kConsumerWarps = kDecodeThreads / 32;
  using Tile = GroupTile<D>;
  using Stage = DecodeStage<D, W>;
  constexpr int NS = Stage::kStages;

  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(16) TokenScratch<D> scratch[kDecodeGroups][2];
  __shared__ StageMeta meta[NS];
  __shared__ __align__(8) uint64_t full[Stage::FULL_BARS], empty[NS];

  const int H = p.num_heads, P = H * D, P3 = 3 * P;
  const int total = p.num_seqs * H;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    for (int s = 0; s < Stage::FULL_BARS; ++s) mbar_init(&full[s], 1);
    for (int s = 0; s < NS; ++s) mbar_init(&empty[s], Tile::kWarps);  // the consuming group's warps
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp >= kConsumerWarps) {
    setmaxnreg_dec<kProducerRegs>();
    if (warp != kConsumerWarps) return;
    // Producer. Lanes 0-3 fetch the next item's cu_seqlens[b], cu_seqlens[b+1], slot and
    // initial-state flag one item ahead; lane 0 issues the copies.
    auto fetch = [&](int item) {
      const int b = item % p.num_seqs;
      if (item >= total || lane > 3) return 0;
      const int* src = lane < 2 ? p.cu_seqlens + b + lane
                                : (lane == 2 ? p.state_slots + b : p.has_initial_state + b);
      return *src;
    };
    const CtaItems items(total);
    const uint64_t load_pol = l2_policy_evict_last();
    // evict-last copies pay at B >= 64 (the stores about an item later find the lines), but
    // when all the states fit in L2 the unhinted copies are faster (session 23: B=4, 24 MiB,
    // 22.6 against 25.5 µs; B=1, 16 and up the same)
    const bool hint = (int64_t)total * D * D * 4 > kUnhintedStateBytes;
    int mine = fetch(items.begin);
    for (int k = 0; k < items.count; ++k) {
      const int item = items.begin + k, h = item / p.num_seqs;
      const int next = fetch(k + 1 < items.count ? item + 1 : total);
      const int bos = __shfl_sync(0xffffffffu, mine, 0), eos = __shfl_sync(0xffffffffu, mine, 1);
      const int slot = __shfl_sync(0xffffffffu, mine, 2);
      const int continues = __shfl_sync(0xffffffffu, mine, 3) != 0;
      mine = next;
      if (lane != 0) continue;
      const int s = k % NS;
      // beta does not depend on the stage: its load overlaps the wait
      const float beta = eos > bos ? __bfloat162float(p.beta[(int64_t)bos * H + h]) : 0.f;
      mbar_wait(&empty[s], ((k / NS) & 1) ^ 1);
      unsigned char* st = ring + s * Stage::BYTES;
      uint64_t* bar = &full[k % Stage::FULL_BARS];
      if (eos > bos) {
        mbar_expect_tx(bar, 4 * D * 2 + (continues ? D * D * 4 + 3 * D * (W - 1) * 2 : 0));
        if (continues) {
          const float* src = p.recurrent_state + ((int64_t)slot * H + h) * D * D;
          for (int off = 0; off < D * D; off += kStateChunk)
            if (hint)
              bulk_load_hint(st + Stage::STATE + off * 4, src + off,
                             (D * D < kStateChunk ? D * D : kStateChunk) * 4, bar, load_pol);
            else
              bulk_load(st + Stage::STATE + off * 4, src + off,
                        (D * D < kStateChunk ? D * D : kStateChunk) * 4, bar);
        }
        const __nv_bfloat16* row = p.qkv + (int64_t)bos * P3 + h * D;
        for (int part = 0; part < 3; ++part) {
          bulk_load(st + Stage::QKV + part * D * 2, row + part * P, D * 2, bar);
          if (continues) {
            const __nv_bfloat16* conv = p.conv_state + ((int64_t)slot * P3 + part * P + h * D) * (W - 1);
            if (hint)
              bulk_load_hint(st + Stage::CONV + part * D * (W - 1) * 2, conv, D * (W - 1) * 2, bar, load_pol);
            else
              bulk_load(st + Stage::CONV + part * D * (W - 1) * 2, conv, D * (W - 1) * 2, bar);
          }
        }
        bulk_load(st + Stage::GATE, p.gate + (int64_t)bos * P + h * D, D * 2, bar);
      }
      meta[s] = StageMeta{bos, eos, slot, continues, beta};
      mbar_arrive(bar);
    }
  } else {
    setmaxnreg_inc<kConsumerRegs>();
    decode_consumer<D, W>(p, ring, scratch, meta, full, empty);
  }
}

}  // namespace kda
}  // namespace k3
