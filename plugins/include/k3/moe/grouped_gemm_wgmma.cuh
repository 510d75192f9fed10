// Grouped GEMMs of the routed experts for prefill-sized batches on Hopper warpgroup MMAs
// (wgmma, sm_90a), same math as grouped_gemm.cuh:
//   gate_up: h[r, :] = glu(z[token(r)] · w1[e]ᵀ, z[token(r)] · w3[e]ᵀ), h rounded to bf16
//   down:    part[r, :] = weight(r) · (h[r] · w2[e]ᵀ) in fp32 (combine_kernel sums a token's slots)
//
// CTA: 128 sorted rows of one expert x 256 weight rows (gate_up: 128 gate rows and the
// matching 128 up rows, so the GLU is an epilogue in registers; down: 256 output columns),
// BK = 64 (one 128-byte swizzled row per operand row), kWgStages shared-memory stages.
// Three warpgroups: warpgroup 0 produces (cp.async: A rows gathered through sorted_token,
// which the bulk tensor copy cannot do on sm_90; weight rows likewise), warpgroups 1 and 2 each
// issue m64n256k16 on 64 of the rows. bf16 weights only: MXFP4 weights take the RS form below
// (weights dequantised into the register operand, tokens on N).
// Stages are handed over with mbarriers: `full` (one cp.async arrival per producer thread, which
// fires when its copies land; the thread never waits) and `empty` (consumer warps, after the
// wgmma that read the stage retired).
// CTA order: expert-major, then weight tile, then M tile, so the M tiles of one expert read
// each weight tile at the same time (one HBM read) and each A panel stays hot across N tiles.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

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
constexpr int kWgRawRowBytes = kWgBK / 2;  // MXFP4: code bytes of one weight row and k-step
static_assert(2 * kMxGroup == kWgBK, "MXFP4: two scale groups per weight row and k-step");

__host__ __device__ constexpr size_t wg_smem_bytes() {
  return 1024 /* alignment slack */ + kWgStages * (kWgATileBytes + kWgBTileBytes) + 2 * kWgStages * sizeof(uint64_t);
}

// Element offset of 16-byte chunk c of row r in a tile of 128-byte rows under the 128B swizzle
// (chunk c of row r stored at chunk c ^ (r % 8); 8-row atoms 1024 B, 1024-B aligned).
__device__ __forceinline__ int wg_swizzle(int row, int chunk) { return row * kWgBK + ((chunk ^ (row & 7)) << 3); }

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

// Shared by both kernels below (bf16 SS and MXFP4 RS). The dynamic shared memory from its first
// 1024-byte boundary (the 128B swizzle's 8-row atoms must be 1024-B aligned).
__device__ __forceinline__ uint8_t* wg_smem_aligned(uint8_t* raw) {
  return raw + ((1024 - (smem_addr(raw) & 1023)) & 1023);
}
// Thread 0 initialises each stage's `full` (one cp.async arrival per producer thread) and
// `empty` (one arrival per consumer warp) barrier; the caller's __syncthreads publishes them.
__device__ __forceinline__ void wg_init_stage_barriers(uint64_t* full, uint64_t* empty, int stages) {
  if (threadIdx.x != 0) return;
  for (int s = 0; s < stages; ++s) {
    mbar_init(&full[s], 128);
    mbar_init(&empty[s], 8);
  }
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// m_tiles: the grid's M tiles (max_m_tiles with kWgBM); CTAs past the schedule's tiles exit.
// The shared-memory attribute is per device, so it is set on every launch (not a stream
// operation: allowed during graph capture).
template <typename Kernel>
cudaError_t wg_launch(Kernel kernel, size_t smem, const WgParams& p, int m_tiles, cudaStream_t stream) {
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err != cudaSuccess) return err;
  kernel<<<(unsigned)m_tiles * p.n_tiles, kWgThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

// Producer warpgroup (128 threads). k-step kt goes to stage kt % kWgStages once the consumers
// released it. Thread t copies 16-byte chunk t % 8 of A rows t/8 + 16i (8 consecutive threads
// read one 128-byte row), the same for weight rows t/8 + 16i. Then a cp.async arrival on the
// stage's `full` barrier.
template <bool kGateUp>
__device__ __forceinline__ void wg_produce(const WgParams& p, const WgTile& t, __nv_bfloat16* sa, __nv_bfloat16* sb,
                                           uint64_t* full, uint64_t* empty) {
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
  const __nv_bfloat16* b_src = p.w.bf16 + w_row0 * K + chunk * 8;

  for (int kt = 0; kt < nk; ++kt) {
    const int st = kt % kWgStages;
    if (kt >= kWgStages) mbar_wait(&empty[st], (kt / kWgStages - 1) & 1);
    const int k0 = kt * kWgBK;
    __nv_bfloat16* a_dst = sa + st * (kWgBM * kWgBK);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (a_src[i] != nullptr) cp_async16(a_dst + wg_swizzle(r8 + 16 * i, chunk), a_src[i] + k0, 16);
    __nv_bfloat16* b_dst = sb + st * (kWgBN * kWgBK);
#pragma unroll
    for (int i = 0; i < 16; ++i) {  // rows >= 128 are up rows, mat_gap further on
      const int r = r8 + 16 * i;
      cp_async16(b_dst + wg_swizzle(r, chunk), b_src + (r + (i >= 8 ? p.mat_gap : 0)) * (int64_t)K + k0, 16);
    }
    mbar_cp_async_arrive(&full[st]);
  }
}

// Keeps the compiler from moving accumulator definitions into the wgmma pipeline.
__device__ __forceinline__ void wg_fence_operand(float (&acc)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// Consumer warpgroup cw (0 or 1): rows 64cw..64cw+63 of the tile.
__device__ __forceinline__ void wg_consume(float (&acc)[128], int cw, const WgParams& p, const __nv_bfloat16* sa,
                                           const __nv_bfloat16* sb, uint64_t* full, uint64_t* empty) {
  const int lane = threadIdx.x % 32, nk = p.K / kWgBK;
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;
  wg_fence_operand(acc);
  for (int kt = 0; kt < nk; ++kt) {
    const int st = kt % kWgStages;
    mbar_wait(&full[st], (kt / kWgStages) & 1);
    const __nv_bfloat16* a = sa + st * (kWgBM * kWgBK) + cw * 64 * kWgBK;
    const __nv_bfloat16* b = sb + st * (kWgBN * kWgBK);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kWgBK / 16; ++ks) wgmma_m64n256k16(acc, wg_desc(a + ks * 16), wg_desc(b + ks * 16), 1);
    wgmma_commit();
    wgmma_wait<1>();  // the MMAs of k-step kt-1 have retired: release its stage
    if (kt > 0 && lane == 0) mbar_arrive(&empty[(kt - 1) % kWgStages]);
  }
  wgmma_wait<0>();
  wg_fence_operand(acc);
}

template <bool kGateUp>
__global__ void __launch_bounds__(kWgThreads, 1) routed_gemm_wgmma_kernel(const __grid_constant__ WgParams p) {
  WgTile t;
  if (!wg_tile(p.s, p.n_tiles, t)) return;
  extern __shared__ uint8_t wg_smem_raw[];
  uint8_t* smem = wg_smem_aligned(wg_smem_raw);
  auto* sa = reinterpret_cast<__nv_bfloat16*>(smem);
  auto* sb = reinterpret_cast<__nv_bfloat16*>(smem + kWgStages * kWgATileBytes);
  auto* bars = reinterpret_cast<uint64_t*>(smem + kWgStages * (kWgATileBytes + kWgBTileBytes));
  uint64_t *full = bars, *empty = bars + kWgStages;
  wg_init_stage_barriers(full, empty, kWgStages);
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<72>();
    wg_produce<kGateUp>(p, t, sa, sb, full, empty);
    return;
  }
  setmaxnreg_inc<216>();
  const int cw = wg - 1, lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  float acc[128];
  wg_consume(acc, cw, p, sa, sb, full, empty);
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

template <bool kGateUp>
cudaError_t launch_routed_gemm_wgmma(const WgParams& p, int m_tiles, cudaStream_t stream) {
  return wg_launch(routed_gemm_wgmma_kernel<kGateUp>, wg_smem_bytes(), p, m_tiles, stream);
}


// ---------------------------------------------------------------------------------------------
// MXFP4 prefill GEMMs with the weights as the register A operand of wgmma (the RS form), computed
// transposed: weight rows on M, the tile's tokens on N.
//   gate_up: hᵀ = glu(w1[e] · zᵀ, w3[e] · zᵀ)     down: partᵀ = weight · (w2[e] · hᵀ)
// Why: the form above (tokens on M) dequantises each weight tile into shared memory, fences it
// into the async proxy and meets all 256 consumers at a barrier every k-step, and its 128-row
// M tiles are half empty at one EP8 rank's ~73 rows per expert (8192 rows over 112 experts).
// Here each consumer thread dequantises exactly the A-fragment registers its own wgmma reads
// (no bf16 stores, no proxy fence, no cross-warpgroup barrier), and N is the tile's row count
// rounded up to 16 (16..128), so a 73-row tile costs 80 columns of MMA instead of 128.
// CTA (as above: 384 threads, blockIdx -> expert, weight tile, M tile of <= 128 sorted rows):
// 256 weight rows (gate_up: gate rows n0..n0+127 and up rows I+n0..; down: output columns
// n0..n0+255); consumer warpgroup cw owns two m64 blocks b (gate_up: gate and up rows
// n0 + 64cw + [0, 64), so the GLU pairs sit in one thread; down: columns n0 + 128cw + 64b + [0, 64)).
// k order inside a k-step (64 k, 32 code bytes per weight row): thread c = lane % 4 of the A
// fragment holds logical k 16ks + 8h + 2c + {0, 1} (ks = 0..3, h = 0, 1), i.e. one code byte per
// (ks, h). It is given byte 2jj + (c & 1) + 16(c >> 1) of the row, jj = 2ks + h: the even (c even)
// or odd bytes of one 16-byte half, one shared load and two byte gathers per row. So logical
// chunk jj (8 k) of a token row must hold natural k 4jj..4jj+3 and 32+4jj..32+4jj+3: the token
// tile is copied in 8-byte pieces (4 k) to those places. Every product is the same as in the
// natural order; only the fp32 summation order differs (a fixed one: deterministic).
constexpr int kRsStages = 6;
constexpr int kRsTokTileBytes = kWgBM * kWgBK * 2;  // up to 128 token rows x 64 k, bf16, 128B-swizzled
constexpr int kRsRawTileBytes = kWgBN * kWgBK / 2;  // 256 weight rows x 64 codes, 32-byte rows
// setmaxnreg moves registers inside the CTA's launch allocation (384 threads x the 168 that
// __launch_bounds__(384, 1) gives): an increase past what the producer gave back never returns.
// The consumers need more than 216: there (the producer at 72) ptxas serialized every wgmma of
// both kernels for lack of registers (warning C7512: each MMA waited to retire, so the
// dequantisation of the next k-step never overlapped the MMAs); at 232 it does not, and the
// producer's loop fits 40 without spilling.
constexpr int kRsProducerRegs = 40, kRsConsumerRegs = 232;
static_assert(128 * kRsProducerRegs + 256 * kRsConsumerRegs <= kWgThreads * 168, "CTA register allocation");

__host__ __device__ constexpr size_t rs_smem_bytes() {
  return 1024 /* alignment slack */ + kRsStages * (kRsTokTileBytes + kRsRawTileBytes) +
         256 * sizeof(uint2) /* scale table */ + 2 * kRsStages * sizeof(uint64_t);
}

__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}

// d (64 x N fp32) += A (64 x 16, four bf16x2 registers per thread) · B (N x 16, smem, K-major)ᵀ.
__device__ __forceinline__ void wgmma_rs(float (&d)[8], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, "
      "{%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[16], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[24], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}, "
      "{%24, %25, %26, %27}, %28, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[40], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %45, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, "
      "{%40, %41, %42, %43}, %44, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[48], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, "
      "{%48, %49, %50, %51}, %52, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[56], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %61, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n112k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55}, "
      "{%56, %57, %58, %59}, %60, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1));
}

template <int kNa>
__device__ __forceinline__ void rs_fence_operand(float (&acc)[kNa]) {
#pragma unroll
  for (int i = 0; i < kNa; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// The E8M0 scale byte b as mxfp4_scale's two bf16x2 factors (the second, 1.0 where one suffices
// (b <= 128), is used only when some byte of the k-step needs it).
__device__ __forceinline__ uint2 rs_scale_entry(uint32_t b) {
  const Mxfp4Scale s = mxfp4_scale(b);
  return make_uint2(*reinterpret_cast<const uint32_t*>(&s.first),
                    s.two_steps ? *reinterpret_cast<const uint32_t*>(&s.second) : 0x3F803F80u);
}

// Four code bytes (byte m = elements 2m, 2m+1, the even one in the low nibble) -> four bf16x2
// words, word m = (element 2m, element 2m+1), times the scale: mxfp4.cuh's bit trick with 12
// integer operations per four words instead of 19. y_m gets code 2m at bits 15:12 and code 2m+1
// at 31:28 and zeros elsewhere (each prmt takes its two zero bytes from a half-masked source);
// then the signs stay (bits 15, 31) and the magnitudes move down 6 (bits 8:6, 24:22) in one
// select. The shift is a multiply-high by 2^26, so it runs on the multiply pipe, not the integer
// pipe that the prmt and the select share. kTwo: the scale needs its second factor (b > 128).
template <bool kTwo>
__device__ __forceinline__ void rs_dequant_word(uint32_t packed, uint2 f, uint32_t (&out)[4]) {
  const uint32_t p4 = packed << 4;
  const uint32_t e_lo = p4 & 0x0000F0F0u, e_hi = p4 & 0xF0F00000u;
  const uint32_t o_lo = packed & 0x0000F0F0u, o_hi = packed & 0xF0F00000u;
  uint32_t y[4];
  asm("prmt.b32 %0, %1, %2, 0x4602;" : "=r"(y[0]) : "r"(e_lo), "r"(o_lo));
  asm("prmt.b32 %0, %1, %2, 0x5612;" : "=r"(y[1]) : "r"(e_lo), "r"(o_lo));
  asm("prmt.b32 %0, %1, %2, 0x6420;" : "=r"(y[2]) : "r"(e_hi), "r"(o_hi));
  asm("prmt.b32 %0, %1, %2, 0x7430;" : "=r"(y[3]) : "r"(e_hi), "r"(o_hi));
  constexpr uint32_t kKeep = 0x82008200u;  // bits taken from y (signs, and two that are zero there)
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const uint32_t down6 = __umulhi(y[m], 1u << 26);  // y >> 6
    uint32_t bits;  // (y & kKeep) | (down6 & ~kKeep) as one lop3 (the compiler made it two)
    asm("lop3.b32 %0, %1, %2, %3, 0xE2;" : "=r"(bits) : "r"(y[m]), "n"(kKeep), "r"(down6));
    __nv_bfloat162 v = __hmul2(bf16x2_from_bits(bits), bf16x2_from_bits(f.x));
    if constexpr (kTwo) v = __hmul2(v, bf16x2_from_bits(f.y));
    out[m] = *reinterpret_cast<const uint32_t*>(&v);
  }
}

// Producer warpgroup. Token rows (gate_up: z rows gathered through sorted_token; down: h rows)
// n = 8i + 2·warp + lane/16 (i = 0..15, interleaved so the four warps share a short tile evenly):
// lane u = lane % 16 copies 8-byte piece u (k 4u..4u+3 of the k-step) to chunk (u % 8) ^ (n % 8)
// at byte 8·(u / 8); a row's 16 lanes fill its 128 bytes, each bank once. Rows past the tile
// are not copied (they only feed the MMA columns of absent tokens, which are never stored).
// Weight codes: as in wg_produce, 32-byte rows without swizzle (the 16-byte reads of a quad's
// rows are conflict-free).
template <bool kGateUp>
__device__ __forceinline__ void rs_produce(const WgParams& p, const WgTile& t, uint8_t* tok, uint8_t* raw,
                                           uint64_t* full, uint64_t* empty) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, u = lane % 16;
  const int K = p.K, nk = K / kWgBK;
  const int n0 = 2 * warp + lane / 16;  // row i is n0 + 8i: n % 8 == n0 % 8 for all i
  // source row of tile row n0 + 8u (-1 past the tile), read by the half-warp's lanes through a
  // shuffle (16 registers per lane would spill in the producer's 64)
  const int n_lane = n0 + 8 * u;
  const int my_row = n_lane < t.rows ? (kGateUp ? p.s.sorted_token[t.row0 + n_lane] : t.row0 + n_lane) : -1;
  const int half_lane0 = lane & 16;
  const int t_off = n0 * 128 + (((u % 8) ^ (n0 % 8)) << 4) + 8 * (u / 8);
  const char* a_lane = reinterpret_cast<const char*>(p.a) + 8 * u;
  const uint32_t row_bytes = (uint32_t)K * 2;
  const int half = tid % 2, r2 = tid / 2;
  const int64_t w_row0 = t.expert * p.rows_per_expert + t.n_tile * (kGateUp ? kWgBN / 2 : kWgBN);
  const uint8_t* q_src = p.w.packed + (w_row0 + r2) * (K / 2) + half * 16;
  const int64_t gap = (int64_t)p.mat_gap * (K / 2);

  for (int kt = 0; kt < nk; ++kt) {
    const int st = kt % kRsStages;
    if (kt >= kRsStages) mbar_wait(&empty[st], (kt / kRsStages - 1) & 1);
    uint8_t* t_dst = tok + st * kRsTokTileBytes + t_off;
    const char* a_k = a_lane + kt * 128;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int row = __shfl_sync(0xffffffffu, my_row, half_lane0 + i);
      if (row >= 0) cp_async8(t_dst + 1024 * i, a_k + (uint64_t)(uint32_t)row * row_bytes);
    }
    uint8_t* q_dst = raw + st * kRsRawTileBytes;
#pragma unroll
    for (int i = 0; i < 4; ++i)  // tile rows r2 + 64i; rows >= 128 are mat_gap further on
      cp_async16(q_dst + (r2 + 64 * i) * kWgRawRowBytes + half * 16,
                 q_src + 64 * i * (K / 2) + (i >= 2 ? gap : 0) + kt * kWgRawRowBytes, 16);
    mbar_cp_async_arrive(&full[st]);
  }
}

// Consumer warpgroup cw with N = kN token columns (kN >= t.rows): main loop and epilogue.
// Per k-step each thread dequantises its 4 weight rows (blocks b = 0, 1; rows lr and lr + 8,
// lr = 16·warp + lane/4) into 32 A-fragment registers; the registers of k-step kt+1 are filled
// while the MMAs of kt run (two register sets, the loop unrolled by two so both stay
// registers), after `wgmma.wait_group 1` retired the MMAs of kt-1 that read that set.
template <int kN, bool kGateUp>
__device__ __forceinline__ void rs_consume(int cw, const WgParams& p, const WgTile& t, const uint8_t* tok,
                                           const uint8_t* raw, const uint2* scale_tab, uint64_t* full,
                                           uint64_t* empty) {
  constexpr int kNa = kN / 2;
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4, q = lane / 4, c = lane % 4;
  const int K = p.K, nk = K / kWgBK;
  // Tile row of (b, hr): r0 + 8hr + kBlockRows·b (gate_up: block 1 = the up rows, 128 further in
  // the tile and mat_gap further in the weights); offsets from the (0, 0) row keep the register
  // count down (N = 128 holds 128 accumulators and 64 A registers).
  constexpr int kBlockRows = kGateUp ? kWgBN / 2 : 64;
  const int r0 = (kGateUp ? 64 * cw : 128 * cw) + 16 * warp + q;
  const int row_off = r0 * kWgRawRowBytes + 16 * (c / 2);  // this thread's 16 code bytes in a raw stage
  const int groups = K / kMxGroup;                          // scale bytes per weight row
  const int64_t w_row0 = t.expert * p.rows_per_expert + t.n_tile * (kGateUp ? kWgBN / 2 : kWgBN);
  const uint8_t* scale0 = p.w.scale + (w_row0 + r0) * groups;
  const int hr_step = 8 * groups, b_step = (kBlockRows + (kGateUp ? p.mat_gap : 0)) * groups;
  auto scale_pair = [&](int b, int hr, int kt) {  // the two scale bytes of k-step kt
    return (uint32_t)__ldg(reinterpret_cast<const uint16_t*>(scale0 + hr * hr_step + b * b_step) + kt);
  };
  uint32_t sc[2][2];  // the two scale bytes of the next k-step to dequantise
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) sc[b][hr] = scale_pair(b, hr, 0);
  const int group_shift = 8 * (c / 2);                     // the 16 codes lie in scale group c / 2
  const uint32_t gather = c % 2 ? 0x7531u : 0x6420u;       // odd or even bytes of two words
  const uint64_t desc0 = wg_desc(tok);                     // + (byte offset >> 4) per stage and k16

  auto dequant = [&](int kt, uint32_t (&a)[4][2][4]) {
    const int st = kt % kRsStages;
    mbar_wait(&full[st], (kt / kRsStages) & 1);
    const uint8_t* rs = raw + st * kRsRawTileBytes;
    uint32_t bytes[2][2];
    bool two = false;
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        bytes[b][hr] = (sc[b][hr] >> group_shift) & 0xFFu;
        two |= bytes[b][hr] > 128u;
      }
    auto rows = [&](auto two_steps) {
#pragma unroll
      for (int b = 0; b < 2; ++b)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const uint4 v = *reinterpret_cast<const uint4*>(rs + row_off + (8 * hr + kBlockRows * b) * kWgRawRowBytes);
          const uint2 f = scale_tab[bytes[b][hr]];
          uint32_t g0, g1, o[4];
          asm("prmt.b32 %0, %1, %2, %3;" : "=r"(g0) : "r"(v.x), "r"(v.y), "r"(gather));
          asm("prmt.b32 %0, %1, %2, %3;" : "=r"(g1) : "r"(v.z), "r"(v.w), "r"(gather));
          rs_dequant_word<decltype(two_steps)::value>(g0, f, o);  // chunks jj 0..3: k16 steps 0 and 1
          a[0][b][hr] = o[0], a[0][b][hr + 2] = o[1], a[1][b][hr] = o[2], a[1][b][hr + 2] = o[3];
          rs_dequant_word<decltype(two_steps)::value>(g1, f, o);  // chunks jj 4..7: k16 steps 2 and 3
          a[2][b][hr] = o[0], a[2][b][hr + 2] = o[1], a[3][b][hr] = o[2], a[3][b][hr + 2] = o[3];
        }
    };
    if (two) {  // scale bytes > 128: never in practice, but exact when they occur
      rows(std::true_type{});
    } else {
      rows(std::false_type{});
    }
    if (kt + 1 < nk) {
#pragma unroll
      for (int b = 0; b < 2; ++b)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) sc[b][hr] = scale_pair(b, hr, kt + 1);
    }
  };

  float acc[2][kNa];
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int i = 0; i < kNa; ++i) acc[b][i] = 0.f;
  rs_fence_operand(acc[0]);
  rs_fence_operand(acc[1]);
  uint32_t a0[4][2][4], a1[4][2][4];

  auto step = [&](int kt, uint32_t (&cur)[4][2][4], uint32_t (&next)[4][2][4]) {
    const uint64_t desc = desc0 + (uint64_t)((kt % kRsStages) * (kRsTokTileBytes >> 4));
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kWgBK / 16; ++ks)
#pragma unroll
      for (int b = 0; b < 2; ++b) wgmma_rs(acc[b], cur[ks][b], desc + 2 * ks);  // 32 bytes per k16
    wgmma_commit();
    wgmma_wait<1>();  // the MMAs of kt-1 have retired: `next` and their token stage are free
    if (kt > 0 && lane == 0) mbar_arrive(&empty[(kt - 1) % kRsStages]);
    if (kt + 1 < nk) dequant(kt + 1, next);
  };
  dequant(0, a0);
  for (int kt = 0; kt < nk; kt += 2) {
    step(kt, a0, a1);
    if (kt + 1 < nk) step(kt + 1, a1, a0);
  }
  wgmma_wait<0>();
  rs_fence_operand(acc[0]);
  rs_fence_operand(acc[1]);

  // Accumulator layout (m64nNk16, fp32): acc[b][j] is weight row lr = 16·warp + lane/4 +
  // 8·((j/2) % 2) of block b, token column 8·(j/4) + 2·(lane % 4) + j % 2.
  if constexpr (kGateUp) {
    const int col0 = t.n_tile * (kWgBN / 2) + 64 * cw + 16 * warp + q;
    const float inv_beta = 1.f / p.act.beta, inv_lbeta = p.act.linear_beta != 0.f ? 1.f / p.act.linear_beta : 0.f;
#pragma unroll
    for (int j = 0; j < kNa; ++j) {
      const int tk = 8 * (j / 4) + 2 * c + j % 2;
      if (tk >= t.rows) continue;
      const float hv = glu_fast(acc[0][j], acc[1][j], p.act, inv_beta, inv_lbeta);
      p.h[(int64_t)(t.row0 + tk) * p.out_cols + col0 + 8 * ((j / 2) % 2)] = __float2bfloat16_rn(hv);
    }
  } else {
    const int col0 = t.n_tile * kWgBN + 128 * cw + 16 * warp + q;
#pragma unroll
    for (int j = 0; j < kNa; ++j) {
      const int tk = 8 * (j / 4) + 2 * c + j % 2;
      if (tk >= t.rows) continue;
      const float weight = p.s.sorted_weight[t.row0 + tk];
      float* out = p.part + (int64_t)(t.row0 + tk) * p.out_cols + col0 + 8 * ((j / 2) % 2);
      out[0] = weight * acc[0][j];
      out[64] = weight * acc[1][j];
    }
  }
}

template <bool kGateUp>
__global__ void __launch_bounds__(kWgThreads, 1) routed_gemm_rs_kernel(const __grid_constant__ WgParams p) {
  WgTile t;
  if (!wg_tile(p.s, p.n_tiles, t)) return;
  extern __shared__ uint8_t rs_smem_raw[];
  uint8_t* smem = wg_smem_aligned(rs_smem_raw);
  uint8_t* tok = smem;
  uint8_t* raw = smem + kRsStages * kRsTokTileBytes;
  auto* scale_tab = reinterpret_cast<uint2*>(raw + kRsStages * kRsRawTileBytes);
  auto* bars = reinterpret_cast<uint64_t*>(scale_tab + 256);
  uint64_t *full = bars, *empty = bars + kRsStages;
  if (threadIdx.x < 256) scale_tab[threadIdx.x] = rs_scale_entry(threadIdx.x);
  wg_init_stage_barriers(full, empty, kRsStages);
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<kRsProducerRegs>();
    rs_produce<kGateUp>(p, t, tok, raw, full, empty);
    return;
  }
  setmaxnreg_inc<kRsConsumerRegs>();
  const int cw = wg - 1;
  // N: the tile's rows rounded up to 16 (uniform over the CTA, so each warpgroup issues the
  // same wgmma shape)
  switch ((t.rows + 15) / 16) {
    case 1: rs_consume<16, kGateUp>(cw, p, t, tok, raw, scale_tab, full, empty); break;
    case 2: rs_consume<32, kGateUp>(cw, p, t, tok, raw, scale_tab, full, empty); break;
    case 3: rs_consume<48, kGateUp>(cw, p, t, tok, raw, scale_tab, full, empty); break;
    case 4: rs_consume<64, kGateUp>(cw, p, t, tok, raw, scale_tab, full, empty); break;
    case 5: rs_consume<80, kGateUp>(cw, p, t, tok, raw, scale_tab, full, empty); break;
    case 6: rs_consume<96, kGateUp>(cw, p, t, tok, raw, scale_tab, full, empty); break;
    case 7: rs_consume<112, kGateUp>(cw, p, t, tok, raw, scale_tab, full, empty); break;
    default: rs_consume<128, kGateUp>(cw, p, t, tok, raw, scale_tab, full, empty); break;
  }
}

// MXFP4 prefill GEMMs (same grids, params and schedule as launch_routed_gemm_wgmma).
template <bool kGateUp>
cudaError_t launch_routed_gemm_rs(const WgParams& p, int m_tiles, cudaStream_t stream) {
  return wg_launch(routed_gemm_rs_kernel<kGateUp>, rs_smem_bytes(), p, m_tiles, stream);
}

}  // namespace moe
}  // namespace k3
