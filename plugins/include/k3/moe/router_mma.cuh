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

  auto load_stage = [&](int stage, int kt) {
    const int k0 = kt * kRtBK;
#pragma unroll
    for (int j = 0; j < 2; ++j) {  // x: 64 rows x 8 chunks of 8 bf16
      const int id = tid + kRtThreads * j, row = id / 8, chunk = id % 8, k = k0 + chunk * 8;
      const bool in = t0 + row < T && k < D;
      cp_async16(xs + stage * kRtXStageBytes + rt_x_offset(row, chunk), in ? x + (size_t)(t0 + row) * D + k : x,
                 in ? 16 : 0);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // w: 64 rows x 16 chunks of 4 fp32
      const int id = tid + kRtThreads * j, row = id / 16, chunk = id % 16, k = k0 + chunk * 4;
      const bool in = e0 + row < E && k < D;
      cp_async16(ws + stage * kRtWStageBytes + rt_w_offset(row, chunk), in ? w + (size_t)(e0 + row) * D + k : w,
                 in ? 16 : 0);
    }
  };

#pragma unroll
  for (int s = 0; s < kRtStages - 1; ++s) {
    if (s < nk) load_stage(s, s);
    cp_async_commit();
  }

  float master[4][2][4] = {};
  for (int kt = 0; kt < nk; ++kt) {
    cp_async_wait<kRtStages - 2>();
    __syncthreads();
    // The stage refilled now was last read in k-step kt-1, which every warp has finished.
    if (kt + kRtStages - 1 < nk) load_stage((kt + kRtStages - 1) % kRtStages, kt + kRtStages - 1);
    cp_async_commit();
    const uint8_t* xst = xs + (kt % kRtStages) * kRtXStageBytes;
    const uint8_t* wst = ws + (kt % kRtStages) * kRtWStageBytes;

    float chain[4][2][4] = {};
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      const int k16 = kg * 32 + kk * 16;
      uint32_t a[4][4];
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) ldmatrix_x4(a[mi], xst + rt_x_offset(mi * 16 + lane % 16, k16 / 8 + lane / 16));
      uint32_t b[3][2][2];  // [hi, mid, lo][n8 fragment][k 2q.. / k 2q+8..]
#pragma unroll
      for (int ni = 0; ni < 2; ++ni) {
        const int n = wn * 16 + ni * 8 + g;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int k = k16 + 8 * half + 2 * q;
          const float2 v = *reinterpret_cast<const float2*>(wst + rt_w_offset(n, k / 4) + (k % 4) * 4);
          split3_bf16x2(v, b[0][ni][half], b[1][ni][half], b[2][ni][half]);
        }
      }
#pragma unroll
      for (int term = 2; term >= 0; --term)  // small terms first
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
  cp_async_wait<0>();
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
  static_assert(BM * 8 % threads == 0 && BN * 16 % threads == 0, "whole 16-byte chunks per thread");
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

  auto load_stage = [&](int stage, int kt) {
    const int k0 = (kt0 + kt) * kRtBK;
#pragma unroll
    for (int j = 0; j < S::BM * 8 / S::threads; ++j) {  // x: BM rows x 8 chunks of 8 bf16
      const int id = tid + S::threads * j, row = id / 8, chunk = id % 8, k = k0 + chunk * 8;
      const bool in = t0 + row < T && k < D;
      cp_async16(xs + stage * S::x_stage_bytes + rt_x_offset(row, chunk), in ? x + (size_t)(t0 + row) * D + k : x,
                 in ? 16 : 0);
    }
#pragma unroll
    for (int j = 0; j < S::BN * 16 / S::threads; ++j) {  // w: BN rows x 16 chunks of 4 fp32
      const int id = tid + S::threads * j, row = id / 16, chunk = id % 16, k = k0 + chunk * 4;
      const bool in = e0 + row < E && k < D;
      cp_async16(ws + stage * S::w_stage_bytes + rt_w_offset(row, chunk), in ? w + (size_t)(e0 + row) * D + k : w,
                 in ? 16 : 0);
    }
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nk) load_stage(s, s);
    cp_async_commit();
  }

  float master[4][2][4] = {};
  for (int kt = 0; kt < nk; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    // The stage refilled now was last read in k-step kt-1, which every warp has finished.
    if (kt + kStages - 1 < nk) load_stage((kt + kStages - 1) % kStages, kt + kStages - 1);
    cp_async_commit();
    const uint8_t* xst = xs + (kt % kStages) * S::x_stage_bytes;
    const uint8_t* wst = ws + (kt % kStages) * S::w_stage_bytes;
#pragma unroll 1
    for (int half_stage = 0; half_stage < 2; ++half_stage) {  // one 6-MMA chain per 32 k
      float chain[4][2][4] = {};
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        const int k16 = half_stage * 32 + kk * 16;
        uint32_t a[4][4];
#pragma unroll
        for (int mi = 0; mi < 4; ++mi)
          ldmatrix_x4(a[mi], xst + rt_x_offset(wm * 64 + mi * 16 + lane % 16, k16 / 8 + lane / 16));
        uint32_t b[3][2][2];  // [hi, mid, lo][n8 fragment][k 2q.. / k 2q+8..]
#pragma unroll
        for (int ni = 0; ni < 2; ++ni) {
          const int n = wn * 16 + ni * 8 + g;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int k = k16 + 8 * half + 2 * q;
            const float2 v = *reinterpret_cast<const float2*>(wst + rt_w_offset(n, k / 4) + (k % 4) * 4);
            split3_bf16x2(v, b[0][ni][half], b[1][ni][half], b[2][ni][half]);
          }
        }
#pragma unroll
        for (int term = 2; term >= 0; --term)  // small terms first
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
  }
  cp_async_wait<0>();

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
