// Router logits for prefill batches on Hopper warpgroup MMAs (wgmma, sm_90a), with the fp32
// accuracy of router_mma.cuh: logits[T, E] = float(x[T, D]) · w[E, D]ᵀ, x bf16, w fp32.
//
// Same arithmetic argument as router_mma.cuh (read it first): x is exact in bf16, w is split
// into hi + mid + lo bf16 terms (split3_bf16x2: |rest| <= 2^-24 |w|), the three products are
// exact in fp32, and because the tensor cores truncate while they add, each k-step's chain of
// MMAs goes into a fresh accumulator (scale-d 0 on its first wgmma) that is added to an fp32
// master with a round-to-nearest FADD. Here a chain is one 64-wide k-step: 4 k16 x 3 terms = 12
// wgmmas (small terms first within each k16), twice router_mma.cuh's 6; the bound of its comment
// doubles for the chain part and stays below a sequential fp32 sum's (tests/gpu/test_moe_cuda.py
// measures it against fp64: rms 2.9e-7 at 4096 x 896, a sequential fp32 sum 1.5e-6).
//
// Computed transposed, as grouped_gemm_wgmma.cuh's RS GEMMs: experts on M (the register A
// operand, so each thread splits exactly the fp32 weights of its own fragment, in registers),
// tokens on N (the x tile, the shared-memory B operand). CTA: 256 threads = 2 warpgroups, each
// 64 experts x the tile's 128 tokens (m64n128k16), BK = 64, a ring of 3 cp.async slots (x bf16
// 16 KiB, w fp32 32 KiB), loads two k-steps ahead, one __syncthreads per k-step. No atomics: each
// logit is one thread's sums in a fixed order (bit-identical every run).
// Sizes: E % 128 == 0 and D % 64 == 0 (router_wgmma_applies); any T (columns past T are zeros
// and never stored).
//
// Why: router_mma.cuh's mma.sync tiles (64 x 64, each w value split once per 64 tokens) ran the
// logits of a 4096-token prefill at E = 896 in ~520 µs on the H200, ~300 TFLOP/s of the three-term
// products. H200, session 20 (E = 896, D = 7168, bench/router_bench.py, same call): T = 4096
// 362 µs against 520 (1.44x), 8192 725 against 1016; the first form of this kernel (tokens on M,
// both operands in shared memory, the split written there as three bf16 tiles) took 403 and
// 796: by count its wgmmas, split and copies moved ~270 KiB of shared memory per k-step and CTA,
// this one ~176 KiB (bench/NOTES_moe.md, session 20).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "../common/warpgroup.cuh"
#include "grouped_gemm_wgmma.cuh"
#include "router_mma.cuh"

namespace k3 {
namespace moe {

constexpr int kRwBM = 128 /* experts */, kRwBN = 128 /* tokens */, kRwBK = 64, kRwThreads = 256;
constexpr int kRwSlots = 3;
constexpr int kRwXBytes = kRwBN * kRwBK * 2;  // 16 KiB: 128 token rows x 64 k, bf16, 128B-swizzled
constexpr int kRwFBytes = kRwBM * kRwBK * 4;  // 32 KiB: 128 expert rows x 64 k, fp32
constexpr size_t kRwSmemBytes = 1024 + kRwSlots * (kRwXBytes + kRwFBytes);

inline bool router_wgmma_applies(int D, int E) { return D % kRwBK == 0 && E % kRwBM == 0 && D > 0 && E > 0; }

// d (64 x 128 fp32) = (accumulate ? d : 0) + A (64 x 16, four bf16x2 registers per thread) ·
// B (128 x 16, smem, K-major)ᵀ.
__device__ __forceinline__ void wgmma_rs_m64n128k16(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                                    int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
      "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, "
      "%43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),
        "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
        "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

__device__ __forceinline__ void rw_fence_operand(float (&acc)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// This thread's cp.async share of k-step kt: 4 chunks of the x tile (128B-swizzled, the wgmma B
// operand; rows past T zero-filled, from x itself) and 8 of the fp32 w tile, laid out as
// router_mma.cuh's (rt_w_offset: a warp's fragment loads below are conflict-free).
__device__ __forceinline__ void rw_load(const __nv_bfloat16* __restrict__ x, const float* __restrict__ w, int t0,
                                        int e0, int T, int D, int kt, uint8_t* xs, uint8_t* fs) {
  const int tid = threadIdx.x, k0 = kt * kRwBK;
  auto* xt = reinterpret_cast<__nv_bfloat16*>(xs);
#pragma unroll
  for (int i = 0; i < kRwBN * 8 / kRwThreads; ++i) {
    const int u = tid + kRwThreads * i, row = u / 8, chunk = u % 8;
    const bool in = t0 + row < T;
    cp_async16(xt + wg_swizzle(row, chunk), in ? x + (size_t)(t0 + row) * D + k0 + chunk * 8 : x, in ? 16 : 0);
  }
#pragma unroll
  for (int i = 0; i < kRwBM * 16 / kRwThreads; ++i) {
    const int u = tid + kRwThreads * i, row = u / 16, j = u % 16;
    cp_async16(fs + rt_w_offset(row, j), w + (size_t)(e0 + row) * D + k0 + j * 4);
  }
}

// grid (E / 128, ceil(T / 128)), kRwThreads threads, kRwSmemBytes dynamic shared memory; x and w
// 16-byte aligned, router_wgmma_applies(D, E). CTA (0, 0) also zeroes zero[0, zero_n) (the
// per-expert row counts that the select kernel then counts into).
__global__ void __launch_bounds__(kRwThreads, 1) router_logits_wgmma_kernel(const __nv_bfloat16* __restrict__ x,
                                                                         const float* __restrict__ w,
                                                                         float* __restrict__ logits, int T, int D,
                                                                         int E, int* __restrict__ zero, int zero_n) {
  extern __shared__ uint8_t rw_smem_raw[];
  uint8_t* const smem = wg_smem_aligned(rw_smem_raw);
  uint8_t* const xs = smem;
  uint8_t* const fs = xs + kRwSlots * kRwXBytes;
  const int tid = threadIdx.x, cw = tid / 128, lane = tid % 32, warp = (tid / 32) % 4;
  const int g = lane / 4, q = lane % 4;
  const int e0 = blockIdx.x * kRwBM, t0 = blockIdx.y * kRwBN, nk = D / kRwBK;
  if (blockIdx.x == 0 && blockIdx.y == 0)
    for (int i = tid; i < zero_n; i += kRwThreads) zero[i] = 0;
  const int r0 = 64 * cw + 16 * warp + g;  // this thread's A rows r0, r0 + 8 (experts of the tile)

#pragma unroll
  for (int s = 0; s < kRwSlots - 1; ++s) {
    if (s < nk) rw_load(x, w, t0, e0, T, D, s, xs + s * kRwXBytes, fs + s * kRwFBytes);
    cp_async_commit();
  }
  float master[64], chain[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) master[i] = chain[i] = 0.f;
  for (int kt = 0; kt < nk; ++kt) {
    cp_async_wait<kRwSlots - 2>();
    fence_proxy_async();  // this thread's landed x chunks, for wgmma
    __syncthreads();      // every thread's copies of k-step kt; every wgmma of k-step kt - 1 retired
    const int next = kt + kRwSlots - 1;
    if (next < nk)
      rw_load(x, w, t0, e0, T, D, next, xs + (next % kRwSlots) * kRwXBytes, fs + (next % kRwSlots) * kRwFBytes);
    cp_async_commit();
    const __nv_bfloat16* xt = reinterpret_cast<const __nv_bfloat16*>(xs + (kt % kRwSlots) * kRwXBytes);
    const uint8_t* ft = fs + (kt % kRwSlots) * kRwFBytes;
    uint32_t a[kRwBK / 16][3][4];  // [k16][term hi, mid, lo][fragment register]
    rw_fence_operand(chain);
#pragma unroll
    for (int ks = 0; ks < kRwBK / 16; ++ks) {
      // fragment registers: (row r0, k 2q..), (r0 + 8, 2q..), (r0, 2q + 8..), (r0 + 8, 2q + 8..)
#pragma unroll
      for (int f = 0; f < 4; ++f) {
        const int row = r0 + 8 * (f & 1), k = 16 * ks + 2 * q + 8 * (f >> 1);
        const float2 v = *reinterpret_cast<const float2*>(ft + rt_w_offset(row, k / 4) + (k % 4) * 4);
        split3_bf16x2(v, a[ks][0][f], a[ks][1][f], a[ks][2][f]);
      }
      wgmma_fence();
#pragma unroll
      for (int term = 2; term >= 0; --term)  // lo, mid, hi: the small terms first
        wgmma_rs_m64n128k16(chain, a[ks][term], wg_desc(xt + ks * 16), ks != 0 || term != 2);
      wgmma_commit();
    }
    wgmma_wait<0>();
    rw_fence_operand(chain);
#pragma unroll
    for (int i = 0; i < 64; ++i) master[i] += chain[i];
  }
  cp_async_wait<0>();

  // master[j]: expert row 16·warp + g + 8·((j/2) % 2) of the warpgroup's 64, token column
  // 8·(j/4) + 2q + j % 2 of the tile's 128.
#pragma unroll
  for (int j = 0; j < 64; ++j) {
    const int e = e0 + 64 * cw + 16 * warp + g + 8 * ((j / 2) % 2), t = t0 + 8 * (j / 4) + 2 * q + j % 2;
    if (t < T) logits[(size_t)t * E + e] = master[j];
  }
}

inline cudaError_t launch_router_logits_wgmma(const __nv_bfloat16* x, const float* w, float* logits, int T, int D,
                                              int E, int* zero, int zero_n, cudaStream_t stream) {
  const cudaError_t err = cudaFuncSetAttribute(router_logits_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               (int)kRwSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid(E / kRwBM, (T + kRwBN - 1) / kRwBN);
  router_logits_wgmma_kernel<<<grid, kRwThreads, kRwSmemBytes, stream>>>(x, w, logits, T, D, E, zero, zero_n);
  return cudaGetLastError();
}

}  // namespace moe
}  // namespace k3
