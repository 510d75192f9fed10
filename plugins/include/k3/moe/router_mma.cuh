// Router logits for prefill-sized batches on the tensor cores, as accurate as an fp32 sum:
// logits[T, E] = float(x[T, D]) · w[E, D]ᵀ, x bf16, w fp32.
//
// Split: x is exact in bf16. Each w is split into three bf16 terms, w = hi + mid + lo + r with
// hi = bf16(w), mid = bf16(w - hi), lo = bf16(w - hi - mid): every residual is an exact fp32
// difference (Sterbenz) and every rounding loses at most 2^-8 of what it rounds, so
// |r| <= 2^-24 |w|, the size of w's own fp32 rounding. bf16 x bf16 products are exact in fp32,
// so the three mma.sync m16n8k16 per product see x·w to within 2^-24 |x·w|.
//
// Accumulation: inside one MMA the tensor cores align the products to the largest exponent and
// truncate (round toward zero) instead of rounding to nearest (Fasi et al. 2021 for V100-A100;
// Khattak & Mikaitis 2025 model the H100 the same way). One accumulator chained through all
// 3·D/16 MMAs would therefore drift by up to an ulp of the running sum per MMA, with a bias.
// So each warp runs a chain of only 6 MMAs (one 64-wide k-stage: its 32 k x 3 terms) into a
// zeroed register tile and adds that to an fp32 master with a round-to-nearest FADD.
// Bound vs the exact sum S = Σ x·w (u = 2^-24): each stage's chain is off by at most ~6 ulp of
// the stage's partial sum (~sqrt(32/D) of the logit's scale for random signs), each fold by
// u·|running sum|; over D/64 folds the total stays within the γ_{D/64}·Σ|x·w| plus
// 6·u·Σ_stages|partial| bound, below the γ_D·Σ|x·w| of a sequential fp32 sum; in practice a
// few 1e-7 of the logit's scale, like any fp32 summation order. Selection therefore agrees
// with an fp32 router exactly as well as two fp32 routers that sum in different orders agree:
// only tokens whose k-th and (k+1)-th biased scores lie within ~1e-7 can differ (the tests
// skip gaps below 1e-5); equal scores still go to the lower expert id in router_select.
//
// Determinism: no atomics. A CTA's two K-groups of warps meet in shared memory, added in a fixed
// order, so every run gives bit-identical logits.
//
// CTA: 64 tokens x 64 experts, BK = 64, kRtStages cp.async stages (x 8 KiB + w 16 KiB each),
// 8 warps: warp (kg, wn) owns experts wn·16.. of the tile for k-half kg of every stage, all 64
// tokens (4 m16 A fragments x 2 n8 B fragments), so each w value is split by one warp only.
// Larger tiles (128 x 64, 128 x 128, 256 x 64, whole BK per warp, 3-4 stages) measured 6-20%
// slower at T = 4096, E = 896 (H200, session 17: 631-716 vs 595 us): what the CTAs read from
// L2 is not this kernel's bound.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "grouped_gemm.cuh"

namespace k3 {
namespace moe {

constexpr int kRtBM = 64, kRtBN = 64, kRtBK = 64, kRtStages = 4, kRtThreads = 256;
constexpr int kRtXStageBytes = kRtBM * kRtBK * 2, kRtWStageBytes = kRtBN * kRtBK * 4;
constexpr int kRtSmemBytes = kRtStages * (kRtXStageBytes + kRtWStageBytes);  // 96 KiB

// x tile: 128-byte rows of 8 chunks; chunk c of row r sits at c ^ (r & 7), so the 8 rows of an
// ldmatrix hit distinct banks.
__device__ __forceinline__ int rt_x_offset(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }
// w tile: 256-byte rows of 16 chunks; chunk c of row n sits at c ^ ((n & 3) << 1): a half-warp's
// B-fragment loads (rows g..g+3, two chunks each) then cover the 32 banks once.
__device__ __forceinline__ int rt_w_offset(int row, int chunk) { return row * 256 + ((chunk ^ ((row & 3) << 1)) << 4); }

__device__ __forceinline__ uint32_t bf16x2_bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }

// Two consecutive-k weights -> their hi / mid / lo bf16x2 terms (lower k in the low half).
__device__ __forceinline__ void split3_bf16x2(float2 v, uint32_t& hi, uint32_t& mid, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(v.x, v.y);
  const float2 hf = __bfloat1622float2(h);
  const float2 r1 = make_float2(v.x - hf.x, v.y - hf.y);
  const __nv_bfloat162 m = __floats2bfloat162_rn(r1.x, r1.y);
  const float2 mf = __bfloat1622float2(m);
  hi = bf16x2_bits(h);
  mid = bf16x2_bits(m);
  lo = bf16x2_bits(__floats2bfloat162_rn(r1.x - mf.x, r1.y - mf.y));
}

// One thread's cp.async share of a k-stage, for both logits kernels: a BM x 64 x tile (bf16,
// 8 chunks per row) and a BN x 64 w tile (fp32, 16 chunks per row). Copy j of thread tid takes
// x row tid/8 + j·(kThreads/8), chunk tid % 8, and w row tid/16 + j·(kThreads/16), chunk tid % 16.
// Both row steps keep a row's swizzle (row & 7 for x, row & 3 for w), and both advance the
// source by kThreads·D/4 bytes, so everything but the k offset is fixed per thread: set up once,
// a stage costs an add and the copy per chunk (recomputing the swizzles, bounds and 64-bit
// addresses per stage was a third of the whole-D kernel's instructions). Chunks past T, E or D
// are zero-filled from the tensor's start (src_bytes 0), on a separate path taken only where a
// thread's rows or the stage's k reach past an edge.
template <int BM, int BN, int kThreads>
struct RtStageLoader {
  static constexpr int kXCopies = BM * 8 / kThreads, kWCopies = BN * 16 / kThreads;
  static constexpr int kXRowStep = kThreads / 8, kWRowStep = kThreads / 16;
  static_assert(BM * 8 % kThreads == 0 && BN * 16 % kThreads == 0, "whole 16-byte chunks per thread");
  static_assert(kXRowStep % 8 == 0 && kWRowStep % 4 == 0, "a thread's rows share one swizzle");
  const char* x_src;  // x row t0 + tid/8 at k = 8·(tid % 8) (may lie past T: then never read)
  const char* w_src;  // w row e0 + tid/16 at k = 4·(tid % 16)
  const char* x_base;
  const char* w_base;
  uint32_t row_step;      // bytes from copy j to j + 1, the same for x and w: kThreads·D/4
  int x_dst, w_dst;       // copy 0's byte offset in a stage
  int x_k, w_k;           // the chunk's first k within a stage
  uint32_t x_in, w_in;    // bit j: copy j's row lies inside T (x) or E (w)
  bool all_in;            // every copy's row does
  int D;

  __device__ __forceinline__ RtStageLoader(const __nv_bfloat16* x, const float* w, int t0, int e0, int T, int E,
                                           int D_, int tid)
      : x_base(reinterpret_cast<const char*>(x)), w_base(reinterpret_cast<const char*>(w)), D(D_) {
    const int xr = tid / 8, xc = tid % 8, wr = tid / 16, wc = tid % 16;
    x_k = 8 * xc;
    w_k = 4 * wc;
    x_src = x_base + ((size_t)(t0 + xr) * D + x_k) * 2;
    w_src = w_base + ((size_t)(e0 + wr) * D + w_k) * 4;
    row_step = (uint32_t)kThreads * (uint32_t)D / 4;
    x_dst = rt_x_offset(xr, xc);
    w_dst = rt_w_offset(wr, wc);
    x_in = w_in = 0;
#pragma unroll
    for (int j = 0; j < kXCopies; ++j) x_in |= (uint32_t)(t0 + xr + j * kXRowStep < T) << j;
#pragma unroll
    for (int j = 0; j < kWCopies; ++j) w_in |= (uint32_t)(e0 + wr + j * kWRowStep < E) << j;
    all_in = x_in == (1u << kXCopies) - 1 && w_in == (1u << kWCopies) - 1;
  }

  // k-stage kt (absolute) into the stage buffers xst (x_stage_bytes) and wst.
  __device__ __forceinline__ void load(uint8_t* xst, uint8_t* wst, int kt) const {
    const int k0 = kt * kRtBK;
    if (all_in && k0 + kRtBK <= D) {  // all copies but those at the edges of T, E and D
#pragma unroll
      for (int j = 0; j < kXCopies; ++j)
        cp_async16(xst + x_dst + j * (kXRowStep * 128), x_src + (j * row_step + (uint32_t)k0 * 2));
#pragma unroll
      for (int j = 0; j < kWCopies; ++j)
        cp_async16(wst + w_dst + j * (kWRowStep * 256), w_src + (j * row_step + (uint32_t)k0 * 4));
      return;
    }
    const bool xk_in = k0 + x_k < D, wk_in = k0 + w_k < D;
#pragma unroll
    for (int j = 0; j < kXCopies; ++j) {
      const bool in = xk_in && (x_in >> j & 1u);
      cp_async16(xst + x_dst + j * (kXRowStep * 128), in ? x_src + (j * row_step + (uint32_t)k0 * 2) : x_base,
                 in ? 16 : 0);
    }
#pragma unroll
    for (int j = 0; j < kWCopies; ++j) {
      const bool in = wk_in && (w_in >> j & 1u);
      cp_async16(wst + w_dst + j * (kWRowStep * 256), in ? w_src + (j * row_step + (uint32_t)k0 * 4) : w_base,
                 in ? 16 : 0);
    }
  }
};

// The cp.async ring of both kernels: nk k-stages from kt0, stage buffer kt % kStages (x at
// xs + that · kXBytes, w at ws + that · kWBytes), each loaded kStages - 1 k-stages ahead; body(xst,
// wst) consumes one stage. The stage refilled in an iteration was last read in the one before,
// which every warp has finished at its __syncthreads.
template <int kStages, int kXBytes, int kWBytes, class Loader, class Body>
__device__ __forceinline__ void rt_stage_loop(const Loader& loader, uint8_t* xs, uint8_t* ws, int kt0, int nk,
                                              Body&& body) {
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nk) loader.load(xs + s * kXBytes, ws + s * kWBytes, kt0 + s);
    cp_async_commit();
  }
  for (int kt = 0; kt < nk; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int next = kt + kStages - 1;
    if (next < nk) loader.load(xs + (next % kStages) * kXBytes, ws + (next % kStages) * kWBytes, kt0 + next);
    cp_async_commit();
    body(xs + (kt % kStages) * kXBytes, ws + (kt % kStages) * kWBytes);
  }
  cp_async_wait<0>();
}

// One warp's 64 tokens (stage rows m0..m0+63) x 16 experts (rows n0..n0+15) over the 32 k from
// k32 of a stage: one chain of 6 MMAs (2 k16 x 3 terms, small terms first) into a zeroed tile,
// then folded into master with round-to-nearest adds (the accuracy argument at the top).
__device__ __forceinline__ void rt_chain32(float (&master)[4][2][4], const uint8_t* xst, const uint8_t* wst, int m0,
                                           int n0, int k32) {
  const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  float chain[4][2][4] = {};
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    const int k16 = k32 + kk * 16;
    uint32_t a[4][4];
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) ldmatrix_x4(a[mi], xst + rt_x_offset(m0 + mi * 16 + lane % 16, k16 / 8 + lane / 16));
    uint32_t b[3][2][2];  // [hi, mid, lo][n8 fragment][k 2q.. / k 2q+8..]
#pragma unroll
    for (int ni = 0; ni < 2; ++ni) {
      const int n = n0 + ni * 8 + g;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int k = k16 + 8 * half + 2 * q;
        const float2 v = *reinterpret_cast<const float2*>(wst + rt_w_offset(n, k / 4) + (k % 4) * 4);
        split3_bf16x2(v, b[0][ni][half], b[1][ni][half], b[2][ni][half]);
      }
    }
#pragma unroll
    for (int term = 2; term >= 0; --term)
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 2; ++ni) mma_bf16(chain[mi][ni], a[mi], b[term][ni][0], b[term][ni][1]);
  }
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int ni = 0; ni < 2; ++ni)
#pragma unroll
      for (int j = 0; j < 4; ++j) master[mi][ni][j] += chain[mi][ni][j];
}

// grid (ceil(E / 64), ceil(T / 64)), kRtThreads threads, kRtSmemBytes dynamic shared memory;
// D % 8 == 0, x and w 16-byte aligned. CTA 0 also zeroes zero[0, zero_n) (the per-expert row
// counts that the select kernel then counts into: one memset node less).
__global__ void __launch_bounds__(kRtThreads, 2) router_logits_mma_kernel(const __nv_bfloat16* __restrict__ x,
                                                                       const float* __restrict__ w,
                                                                       float* __restrict__ logits, int T, int D,
                                                                       int E, int* __restrict__ zero, int zero_n) {
  extern __shared__ __align__(128) uint8_t rt_smem[];
  uint8_t* const xs = rt_smem;
  uint8_t* const ws = rt_smem + kRtStages * kRtXStageBytes;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, wn = warp % 4, kg = warp / 4;
  const int g = lane / 4, q = lane % 4;
  const int e0 = blockIdx.x * kRtBN, t0 = blockIdx.y * kRtBM;
  const int nk = (D + kRtBK - 1) / kRtBK;
  if (blockIdx.x == 0 && blockIdx.y == 0)
    for (int i = tid; i < zero_n; i += kRtThreads) zero[i] = 0;

  const RtStageLoader<kRtBM, kRtBN, kRtThreads> loader(x, w, t0, e0, T, E, D, tid);
  float master[4][2][4] = {};
  // warp (kg, wn): all 64 tokens x experts wn·16.. for k-half kg of every stage
  rt_stage_loop<kRtStages, kRtXStageBytes, kRtWStageBytes>(loader, xs, ws, 0, nk, [&](const uint8_t* xst,
                                                                                   const uint8_t* wst) {
    rt_chain32(master, xst, wst, 0, wn * 16, kg * 32);
  });
  __syncthreads();  // every warp is done with the stages: reuse them for the K-group sum

  float* red = reinterpret_cast<float*>(rt_smem);  // [wn][mi][ni][j][lane]: conflict-free
  if (kg == 1) {
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
      for (int ni = 0; ni < 2; ++ni)
#pragma unroll
        for (int j = 0; j < 4; ++j) red[(((wn * 4 + mi) * 2 + ni) * 4 + j) * 32 + lane] = master[mi][ni][j];
  }
  __syncthreads();
  if (kg == 0) {
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
      for (int ni = 0; ni < 2; ++ni)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int t = t0 + mi * 16 + g + 8 * (j / 2), e = e0 + wn * 16 + ni * 8 + 2 * q + j % 2;
          if (t < T && e < E)
            logits[(size_t)t * E + e] = master[mi][ni][j] + red[(((wn * 4 + mi) * 2 + ni) * 4 + j) * 32 + lane];
        }
  }
}

// Tile of router_logits_split_kernel: kWM x kWN warps of 64 tokens x 16 experts, kStages stages.
template <int kWM, int kWN, int kStages>
struct RouterMmaShape {
  static constexpr int BM = 64 * kWM, BN = 16 * kWN, threads = 32 * kWM * kWN;
  static constexpr int x_stage_bytes = BM * kRtBK * 2, w_stage_bytes = BN * kRtBK * 4;
  static constexpr int smem_bytes = kStages * (x_stage_bytes + w_stage_bytes);
};

// The same logits for batches too small to fill the GPU with whole-D tiles (decode, T <= a few
// hundred): D split over clusters. grid (ceil(E / BN), ceil(T / BM), kSplit),
// RouterMmaShape::threads threads, ::smem_bytes dynamic shared memory, clusters of
// (1, 1, kSplit) (launch_router_logits_split); D % 8 == 0, x and w 16-byte aligned. CTA z of a
// cluster sums k-stages [z·nk/kSplit, (z+1)·nk/kSplit) with the chains and folds above, and the
// kSplit partial tiles meet through distributed shared memory, each logit added in rank order
// (deterministic, no atomics) by one CTA. kWM x kWN warps, each 64 tokens x 16 experts over the
// whole BK of every stage (tile 64·kWM tokens x 16·kWN experts).
// CTA 0 also zeroes zero[0, zero_n) (the per-expert row counts that the select kernel then
// counts into: one memset node less).
// (At least 16 warps per SM: the register cap that leaves, 128, spills a few words only.)
template <int kWM, int kWN, int kStages, int kSplit>
__global__ void __launch_bounds__(32 * kWM * kWN, 16 / (kWM * kWN) > 1 ? 16 / (kWM * kWN) : 1)
    router_logits_split_kernel(const __nv_bfloat16* __restrict__ x, const float* __restrict__ w,
                               float* __restrict__ logits, int T, int D, int E, int* __restrict__ zero, int zero_n) {
  using S = RouterMmaShape<kWM, kWN, kStages>;
  static_assert(kSplit > 1 && S::smem_bytes >= S::threads * 32 * 4, "a split, and its partial tile fits the stages");
  extern __shared__ __align__(128) uint8_t rt_smem[];
  uint8_t* const xs = rt_smem;
  uint8_t* const ws = rt_smem + kStages * S::x_stage_bytes;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, wn = warp % kWN, wm = warp / kWN;
  const int g = lane / 4, q = lane % 4;
  const int e0 = blockIdx.x * S::BN, t0 = blockIdx.y * S::BM;
  const int nk_all = (D + kRtBK - 1) / kRtBK, split = blockIdx.z;
  const int kt0 = nk_all * split / kSplit, nk = nk_all * (split + 1) / kSplit - kt0;
  if (blockIdx.x == 0 && blockIdx.y == 0 && split == 0)
    for (int i = tid; i < zero_n; i += S::threads) zero[i] = 0;

  const RtStageLoader<S::BM, S::BN, S::threads> loader(x, w, t0, e0, T, E, D, tid);
  float master[4][2][4] = {};
  rt_stage_loop<kStages, S::x_stage_bytes, S::w_stage_bytes>(loader, xs, ws, kt0, nk, [&](const uint8_t* xst,
                                                                                        const uint8_t* wst) {
#pragma unroll 1
    for (int half_stage = 0; half_stage < 2; ++half_stage)  // one chain per 32 k
      rt_chain32(master, xst, wst, wm * 64, wn * 16, 32 * half_stage);
  });

  auto store = [&](int slot, float v) {  // slot = (mi * 2 + ni) * 4 + j of this thread's tile
    const int mi = slot / 8, ni = slot / 4 % 2, j = slot % 4;
    const int t = t0 + wm * 64 + mi * 16 + g + 8 * (j / 2), e = e0 + wn * 16 + ni * 8 + 2 * q + j % 2;
    if (t < T && e < E) logits[(size_t)t * E + e] = v;
  };
  float* red = reinterpret_cast<float*>(rt_smem);  // [slot][thread]: conflict-free
  __syncthreads();                                 // every warp is done with the stages
#pragma unroll
  for (int slot = 0; slot < 32; ++slot) red[slot * S::threads + tid] = master[slot / 8][slot / 4 % 2][slot % 4];
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  cluster.sync();  // every CTA's partial tile is in its shared memory
  for (int slot = split; slot < 32; slot += kSplit) {
    float v = 0.f;
#pragma unroll
    for (int r = 0; r < kSplit; ++r) v += cluster.map_shared_rank(red, r)[slot * S::threads + tid];
    store(slot, v);
  }
  cluster.sync();  // no CTA leaves while another still reads its shared memory
}

// The launch of one shape (the cluster dimension is a launch attribute).
template <int kWM, int kWN, int kStages, int kSplit>
cudaError_t launch_router_logits_split(const __nv_bfloat16* x, const float* w, float* logits, int T, int D, int E,
                                       int* zero, int zero_n, cudaStream_t stream) {
  using S = RouterMmaShape<kWM, kWN, kStages>;
  const auto kernel = router_logits_split_kernel<kWM, kWN, kStages, kSplit>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S::smem_bytes);
  if (err != cudaSuccess) return err;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3((E + S::BN - 1) / S::BN, (T + S::BM - 1) / S::BM, kSplit);
  config.blockDim = dim3(S::threads);
  config.dynamicSmemBytes = S::smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = 1;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = kSplit;
  config.attrs = &cluster;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, x, w, logits, T, D, E, zero, zero_n);
}

}  // namespace moe
}  // namespace k3
