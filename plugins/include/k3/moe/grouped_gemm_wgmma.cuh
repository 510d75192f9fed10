// Grouped GEMMs of the routed experts for prefill-sized batches on Hopper warpgroup MMAs
// (wgmma, sm_90a), same math as grouped_gemm.cuh:
//   gate_up: h[r, :] = glu(z[token(r)] · w1[e]ᵀ, z[token(r)] · w3[e]ᵀ), h rounded to bf16
//   down:    part[r, :] = weight(r) · (h[r] · w2[e]ᵀ) in fp32 (combine_kernel sums a token's slots)
//
// CTA: 128 sorted rows of one expert x 256 weight rows (gate_up: 128 gate rows and the
// matching 128 up rows, so the GLU is an epilogue in registers; down: 256 output columns),
// BK = 64 (one 128-byte swizzled row per operand row), kWgStages shared-memory stages.
// Three warpgroups: warpgroup 0 produces (cp.async: A rows gathered through sorted_token,
// which the bulk tensor copy cannot do on sm_90; weight rows likewise, or the packed MXFP4
// bytes into a raw ring), warpgroups 1 and 2 each issue m64n256k16 on 64 of the rows. MXFP4:
// while the MMAs of k-step kt run, the 256 consumer threads dequantise k-step kt+1's raw bytes
// (one weight row each) into its swizzled bf16 tile, so the producer stays a pure copy engine.
// Stages are handed over with mbarriers: `full` (one cp.async arrival per producer thread, which
// fires when its copies land; the thread never waits) and `empty` (consumer warps, after the
// wgmma that read the stage retired).
// CTA order: expert-major, then weight tile, then M tile, so the M tiles of one expert read
// each weight tile at the same time (one HBM read) and each A panel stays hot across N tiles.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "../common/mbarrier.cuh"
#include "../common/warpgroup.cuh"
#include "grouped_gemm.cuh"
#include "mxfp4.cuh"
#include "permute.cuh"

namespace k3 {
namespace moe {

constexpr int kWgBM = 128, kWgBN = 256, kWgBK = 64, kWgStages = 4;
constexpr int kWgThreads = 384;  // producer warpgroup + 2 consumer warpgroups
constexpr int kWgATileBytes = kWgBM * kWgBK * 2, kWgBTileBytes = kWgBN * kWgBK * 2;
constexpr int kWgRawTileBytes = kWgBN * kWgBK / 2;  // MXFP4: packed codes of one stage
constexpr int kWgRawRowBytes = kWgBK / 2;            // two 16-byte halves, one scale group each
static_assert(2 * kMxGroup == kWgBK, "MXFP4: two scale groups per weight row and k-step");

__host__ __device__ constexpr size_t wg_smem_bytes(bool mxfp4) {
  return 1024 /* alignment slack */ + kWgStages * (kWgATileBytes + kWgBTileBytes) +
         (mxfp4 ? kWgStages * kWgRawTileBytes : 0) + 2 * kWgStages * sizeof(uint64_t);
}

// Element offset of 16-byte chunk c of row r in a tile of 128-byte rows under the 128B swizzle
// (chunk c of row r stored at chunk c ^ (r % 8); 8-row atoms 1024 B, 1024-B aligned).
__device__ __forceinline__ int wg_swizzle(int row, int chunk) { return row * kWgBK + ((chunk ^ (row & 7)) << 3); }

// Byte offset of 16-byte half h of row r in a raw MXFP4 tile (32-byte rows): the halves swap
// every 4 rows, so the 8 rows one quarter-warp reads of the same half hit distinct banks.
__device__ __forceinline__ int wg_raw_offset(int row, int half) {
  return row * kWgRawRowBytes + ((half ^ ((row >> 2) & 1)) << 4);
}

// K-major 128B-swizzled operand descriptor: start address, leading byte offset 16 (unused
// inside one swizzle row), stride 1024 B between 8-row groups, swizzle mode 1 (128B).
__device__ __forceinline__ uint64_t wg_desc(const void* p) {
  return ((uint64_t)(smem_addr(p) & 0x3FFFF) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}

// d (64 x 256 fp32) = (accumulate ? d : 0) + A (64 x 16, smem) · B (256 x 16, smem)ᵀ, both K-major.
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "%128, %129, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// glu() of grouped_gemm.cuh on the special-function unit: exp through ex2.approx and
// reciprocals through rcp.approx (a few fp32 ulps each, far below h's bf16 rounding), tanh as
// 1 - 2 / (e^{2|x|} + 1) with the sign restored. The precise forms cost as much as ~10 k-steps
// of MMAs in this epilogue, which nothing overlaps.
__device__ __forceinline__ float fast_rcp(float x) {  // 1/inf = 0
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float fast_sigmoid(float x) { return fast_rcp(1.f + __expf(-x)); }
__device__ __forceinline__ float fast_tanh(float x) {
  return copysignf(1.f - 2.f * fast_rcp(__expf(2.f * fabsf(x)) + 1.f), x);
}
// inv_beta / inv_linear_beta: 1 / p.beta, 1 / p.linear_beta (0 when linear_beta is 0).
__device__ __forceinline__ float glu_fast(float g, float u, const GluParams& p, float inv_beta,
                                          float inv_linear_beta) {
  const float sig = fast_sigmoid(g);
  if (p.activation == 0) return g * sig * u;
  const float gate = p.beta * fast_tanh(g * inv_beta) * sig;
  const float up = p.linear_beta != 0.f ? p.linear_beta * fast_tanh(u * inv_linear_beta) : u;
  return gate * up;
}

struct WgParams {
  const __nv_bfloat16* a;  // gate_up: z [T, L], rows gathered by sorted_token; down: h [T*k, I]
  ExpertWeights w;         // gate_up: w13 [El, 2I, K]; down: w2 [El, L, K]
  Schedule s;
  int K;                    // L (gate_up) or I (down)
  int n_tiles;              // weight tiles per expert: I / 128 (gate_up) or L / 256 (down)
  int64_t rows_per_expert;  // weight rows of one expert: 2I or L
  int mat_gap;              // gate_up: weight rows between gate row n0+127 and up row I+n0, minus 1
  int out_cols;             // I (h) or L (part)
  __nv_bfloat16* h;
  float* part;              // down: [T*k, L], one row per sorted row
  GluParams act;
};

// The CTA's work: blockIdx.x -> (expert, M tile of up to 128 rows, weight tile). CTAs of
// expert e occupy [tile0(e)·n_tiles, (tile0(e) + tiles(e))·n_tiles), weight tile major.
struct WgTile {
  int expert, row0, rows, n_tile;
};
__device__ __forceinline__ bool wg_tile(const Schedule& s, int n_tiles, WgTile& t) {
  const int q = blockIdx.x / n_tiles;  // falls inside expert e's range of M tiles
  if (q >= *s.num_tiles) return false;
  const int e = s.tile_expert[q];
  const int first = s.offsets[e], count = s.offsets[e + 1] - first;
  const int tile0 = q - (s.tile_row[q] - first) / kWgBM;
  const int tiles = (count + kWgBM - 1) / kWgBM;
  const int local = blockIdx.x - tile0 * n_tiles;
  const int m = local % tiles;
  t.expert = e;
  t.n_tile = local / tiles;
  t.row0 = first + m * kWgBM;
  t.rows = min(kWgBM, count - m * kWgBM);
  return true;
}

// Producer warpgroup (128 threads). k-step kt goes to stage kt % kWgStages once the consumers
// released it. Thread t copies 16-byte chunk t % 8 of A rows t/8 + 16i (8 consecutive threads
// read one 128-byte row); bf16: the same for weight rows t/8 + 16i; MXFP4: half t % 2 (32 codes,
// one scale group) of weight rows t/2 + 64i into the stage's raw tile. Then a cp.async arrival
// on the stage's `full` barrier.
template <bool kMxfp4, bool kGateUp>
__device__ __forceinline__ void wg_produce(const WgParams& p, const WgTile& t, __nv_bfloat16* sa, __nv_bfloat16* sb,
                                           uint8_t* raw, uint64_t* full, uint64_t* empty) {
  const int tid = threadIdx.x, chunk = tid % 8, r8 = tid / 8;
  const int K = p.K, nk = K / kWgBK;
  const __nv_bfloat16* a_src[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = r8 + 16 * i;
    const int64_t row = kGateUp ? (int64_t)p.s.sorted_token[t.row0 + min(r, t.rows - 1)] : t.row0 + r;
    a_src[i] = r < t.rows ? p.a + row * K + chunk * 8 : nullptr;
  }
  const int64_t w_row0 = t.expert * p.rows_per_expert + t.n_tile * (kGateUp ? kWgBN / 2 : kWgBN);
  const __nv_bfloat16* b_src = kMxfp4 ? nullptr : p.w.bf16 + w_row0 * K + chunk * 8;
  const int half = tid % 2, r2 = tid / 2;
  const uint8_t* q_src = kMxfp4 ? p.w.packed + (w_row0 + r2) * (K / 2) + half * 16 : nullptr;  // tile row r2

  for (int kt = 0; kt < nk; ++kt) {
    const int st = kt % kWgStages;
    if (kt >= kWgStages) mbar_wait(&empty[st], (kt / kWgStages - 1) & 1);
    const int k0 = kt * kWgBK;
    __nv_bfloat16* a_dst = sa + st * (kWgBM * kWgBK);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (a_src[i] != nullptr) cp_async16(a_dst + wg_swizzle(r8 + 16 * i, chunk), a_src[i] + k0, 16);
    if constexpr (kMxfp4) {
      uint8_t* q_dst = raw + st * kWgRawTileBytes;
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // tile rows r2 + 64i; rows >= 128 are up rows, mat_gap further on
        const int64_t gap = i >= 2 ? (int64_t)p.mat_gap * (K / 2) : 0;
        cp_async16(q_dst + wg_raw_offset(r2 + 64 * i, half), q_src + 64 * i * (K / 2) + gap + k0 / 2, 16);
      }
    } else {
      __nv_bfloat16* b_dst = sb + st * (kWgBN * kWgBK);
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int r = r8 + 16 * i;
        cp_async16(b_dst + wg_swizzle(r, chunk), b_src + (r + (i >= 8 ? p.mat_gap : 0)) * (int64_t)K + k0, 16);
      }
    }
    mbar_cp_async_arrive(&full[st]);
  }
}

// Keeps the compiler from moving accumulator definitions into the wgmma pipeline.
__device__ __forceinline__ void wg_fence_operand(float (&acc)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// MXFP4: 16-byte half `half` of raw row `row` (32 codes, one scale group) -> 4 bf16 chunks.
template <bool kTwoSteps>
__device__ __forceinline__ void wg_dequant_half(const uint8_t* raw, __nv_bfloat16* b, int row, int half,
                                                const Mxfp4Scale& s) {
  const uint4 codes = *reinterpret_cast<const uint4*>(raw + wg_raw_offset(row, half));
  const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    uint32_t v[4];
    mxfp4_dequant8<kTwoSteps>(words[m], s, v);
    *reinterpret_cast<uint4*>(b + wg_swizzle(row, 4 * half + m)) = make_uint4(v[0], v[1], v[2], v[3]);
  }
}

// MXFP4: consumer thread c (0..255) turns weight row c of a stage's raw tile into bf16; the two
// halves' scale bytes are the low and high byte of `scales`.
__device__ __forceinline__ void wg_dequant_row(const uint8_t* raw, __nv_bfloat16* b, int row, uint32_t scales) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const Mxfp4Scale s = mxfp4_scale((scales >> (8 * half)) & 0xFFu);
    if (s.two_steps) {
      wg_dequant_half<true>(raw, b, row, half, s);
    } else {
      wg_dequant_half<false>(raw, b, row, half, s);
    }
  }
}

// Named barrier 1: the 256 consumer threads only (the producer never waits on them).
__device__ __forceinline__ void wg_consumers_sync() { asm volatile("bar.sync 1, 256;\n" ::: "memory"); }

// Consumer warpgroup cw (0 or 1): rows 64cw..64cw+63 of the tile. MXFP4: thread c of the two
// warpgroups also dequantises weight row c of every stage, one k-step ahead of the MMAs: the
// MMAs of kt are issued, then kt+1 is dequantised while they run; each writer fences its stores
// into the async proxy and the barrier after it publishes the whole tile before its MMAs.
template <bool kMxfp4, bool kGateUp>
__device__ __forceinline__ void wg_consume(float (&acc)[128], int cw, const WgParams& p, const WgTile& t,
                                           const __nv_bfloat16* sa, __nv_bfloat16* sb, const uint8_t* raw,
                                           uint64_t* full, uint64_t* empty) {
  const int lane = threadIdx.x % 32, nk = p.K / kWgBK;
  const int row = threadIdx.x - 128;  // MXFP4: the weight row this thread dequantises
  // its two scale bytes per k-step (rows >= 128 are up rows, mat_gap further on)
  const uint16_t* scale_src = nullptr;
  uint32_t scales = 0;  // of the next k-step to dequantise, loaded one k-step ahead
  auto dequant = [&](int kt) {
    const int st = kt % kWgStages;
    mbar_wait(&full[st], (kt / kWgStages) & 1);
    wg_dequant_row(raw + st * kWgRawTileBytes, sb + st * (kWgBN * kWgBK), row, scales);
    fence_proxy_async();  // the stores above and the producer's copies of this stage, for wgmma
    // after the fence, which would otherwise wait for this load too
    if (kt + 1 < nk) scales = __ldg(scale_src + kt + 1);
  };
  if constexpr (kMxfp4) {
    const int64_t w_row = t.expert * p.rows_per_expert + t.n_tile * (kGateUp ? kWgBN / 2 : kWgBN) + row +
                          (row >= kWgBN / 2 ? p.mat_gap : 0);
    scale_src = reinterpret_cast<const uint16_t*>(p.w.scale + w_row * (p.K / kMxGroup));
    scales = __ldg(scale_src);
    dequant(0);
    wg_consumers_sync();
  }
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;
  wg_fence_operand(acc);
  for (int kt = 0; kt < nk; ++kt) {
    const int st = kt % kWgStages;
    if constexpr (!kMxfp4) mbar_wait(&full[st], (kt / kWgStages) & 1);
    const __nv_bfloat16* a = sa + st * (kWgBM * kWgBK) + cw * 64 * kWgBK;
    const __nv_bfloat16* b = sb + st * (kWgBN * kWgBK);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kWgBK / 16; ++ks) wgmma_m64n256k16(acc, wg_desc(a + ks * 16), wg_desc(b + ks * 16), 1);
    wgmma_commit();
    if constexpr (kMxfp4) {
      if (kt + 1 < nk) dequant(kt + 1);
    }
    wgmma_wait<1>();  // the MMAs of k-step kt-1 have retired: release its stage
    if (kt > 0 && lane == 0) mbar_arrive(&empty[(kt - 1) % kWgStages]);
    if constexpr (kMxfp4) wg_consumers_sync();  // k-step kt+1's bf16 tile is complete
  }
  wgmma_wait<0>();
  wg_fence_operand(acc);
}

template <bool kMxfp4, bool kGateUp>
__global__ void __launch_bounds__(kWgThreads, 1) routed_gemm_wgmma_kernel(const __grid_constant__ WgParams p) {
  WgTile t;
  if (!wg_tile(p.s, p.n_tiles, t)) return;
  extern __shared__ uint8_t wg_smem_raw[];
  uint8_t* smem = wg_smem_raw + ((1024 - (smem_addr(wg_smem_raw) & 1023)) & 1023);
  auto* sa = reinterpret_cast<__nv_bfloat16*>(smem);
  auto* sb = reinterpret_cast<__nv_bfloat16*>(smem + kWgStages * kWgATileBytes);
  uint8_t* raw = smem + kWgStages * (kWgATileBytes + kWgBTileBytes);
  auto* bars = reinterpret_cast<uint64_t*>(raw + (kMxfp4 ? kWgStages * kWgRawTileBytes : 0));
  uint64_t *full = bars, *empty = bars + kWgStages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kWgStages; ++s) {
      mbar_init(&full[s], 128);  // every producer thread
      mbar_init(&empty[s], 8);   // every consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<72>();
    wg_produce<kMxfp4, kGateUp>(p, t, sa, sb, raw, full, empty);
    return;
  }
  setmaxnreg_inc<216>();
  const int cw = wg - 1, lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  float acc[128];
  wg_consume<kMxfp4, kGateUp>(acc, cw, p, t, sa, sb, raw, full, empty);
  if (64 * cw >= t.rows) return;

  // Accumulator layout (m64nNk16, fp32): acc[j] is row 16·warp + lane/4 + 8·((j/2) % 2),
  // column 8·(j/4) + 2·(lane % 4) + j % 2 of this warpgroup's 64 x 256 block.
  const int r_lo = 64 * cw + 16 * warp + lane / 4;
  if constexpr (kGateUp) {
    // gate column c is acc[j] and up column c is acc[j + 64]: the GLU needs no exchange.
    const int n0 = t.n_tile * (kWgBN / 2);
    const float inv_beta = 1.f / p.act.beta, inv_lbeta = p.act.linear_beta != 0.f ? 1.f / p.act.linear_beta : 0.f;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = r_lo + 8 * half;
      if (r >= t.rows) continue;
      __nv_bfloat16* out = p.h + (int64_t)(t.row0 + r) * p.out_cols + n0 + 2 * (lane % 4);
#pragma unroll
      for (int c8 = 0; c8 < 16; ++c8) {
        const int j = 4 * c8 + 2 * half;
        const float h0 = glu_fast(acc[j], acc[j + 64], p.act, inv_beta, inv_lbeta);
        const float h1 = glu_fast(acc[j + 1], acc[j + 65], p.act, inv_beta, inv_lbeta);
        *reinterpret_cast<__nv_bfloat162*>(out + 8 * c8) = __floats2bfloat162_rn(h0, h1);
      }
    }
  } else {
    // Lane pairs (2c, 2c+1) swap halves so that the even lane holds row r_lo, columns 4c'..4c'+3
    // (c' = c / 2 within the 8-column group) and the odd lane row r_lo + 8: one float4 store
    // per 4 outputs.
    const bool odd = lane & 1;
    const int r = r_lo + (odd ? 8 : 0);
    const bool valid = r < t.rows;
    const int p_row = t.row0 + (valid ? r : 0);
    const float weight = valid ? p.s.sorted_weight[p_row] : 0.f;
    float* out = p.part + (int64_t)p_row * p.out_cols + t.n_tile * kWgBN + 2 * ((lane % 4) & ~1);
#pragma unroll
    for (int c8 = 0; c8 < 32; ++c8) {
      const float* v = acc + 4 * c8;
      const float s0 = odd ? v[0] : v[2], s1 = odd ? v[1] : v[3];
      const float o0 = __shfl_xor_sync(0xffffffffu, s0, 1), o1 = __shfl_xor_sync(0xffffffffu, s1, 1);
      const float4 x = odd ? make_float4(o0, o1, v[2], v[3]) : make_float4(v[0], v[1], o0, o1);
      if (valid)
        *reinterpret_cast<float4*>(out + 8 * c8) = make_float4(weight * x.x, weight * x.y, weight * x.z, weight * x.w);
    }
  }
}

// Prefill GEMMs on these kernels where the tiles divide the sizes: I in 128-column h tiles,
// L in 256-column output tiles.
inline bool wgmma_tiles_fit(int L, int I) { return L % kWgBN == 0 && I % (kWgBN / 2) == 0; }

// m_tiles: the grid's M tiles (max_m_tiles with kWgBM); CTAs past the schedule's tiles exit.
template <bool kMxfp4, bool kGateUp>
cudaError_t launch_routed_gemm_wgmma(const WgParams& p, int m_tiles, cudaStream_t stream) {
  const auto kernel = routed_gemm_wgmma_kernel<kMxfp4, kGateUp>;
  const size_t smem = wg_smem_bytes(kMxfp4);
  // per device, so set on every launch (not a stream operation: allowed during graph capture)
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err != cudaSuccess) return err;
  kernel<<<(unsigned)m_tiles * p.n_tiles, kWgThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace moe
}  // namespace k3
