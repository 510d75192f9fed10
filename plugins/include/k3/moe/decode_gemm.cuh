// Decode-sized grouped GEMMs: a few sorted rows (tokens) per expert, so every weight byte is
// read once and the kernels are streams over the touched experts' weights (W4A16 / W16A16).
// Roles are swapped on mma.sync m16n8k16: a warp's 16 weight rows are the MMA's M side and
// the tile's tokens its N side (kTiles n8 tiles: 8 rows per tile for T <= 8, where no expert
// can get more rows, else 16). A lane then loads whole 16-byte runs of its weight rows (bf16:
// 8 elements; MXFP4: 32, or 16 in 8 bytes where K % 128 != 0) from global memory straight into
// A fragments (shared memory only for the MXFP4 table). The k order inside a slab is permuted
// the same way for weights and activations (a dot product does not depend on it): lane
// (r = lane/4, q = lane%4) holds elements [slab·W + q·E, +E) of weight rows r and r+8 and of
// tokens r (and 8+r), and MMA j of the slab takes the lane's elements 4j..4j+3 (A/B register
// pairs 2j, 2j+1).
//
// Bytes in flight (bench/NOTES_moe.md, sessions 15-16): bf16 loads 4 slabs (64 bytes of each
// row, 64 registers) per lane before their MMAs, 8 KiB per warp. MXFP4 streams through two
// register stages of 4 KiB per warp in the source, but ptxas issues each slab's loads about one
// slab before its MMAs whatever the source order (SASS), so ~1 KiB per warp is in flight; an
// L2 prefetch of the stages ahead (bytes in flight without registers) measured no faster, so
// that is not what bounds these kernels either. More CTAs per SM measured slower (likely: their
// tables shrink the L1 that holds the activations and scale bytes). Session 18: with the L1/TEX
// pipe at 82-94% (ncu, T >= 8) the table lookups were a third of its wavefronts, yet register
// dequantisation (no table, one vector load per stage for a row's scale bytes) measured 5-24%
// slower at every T but EP8 T = 32 (bench/NOTES_moe.md, session 18). Session 20: a bulk L2
// prefetch (cp.async.bulk.prefetch) of each work item's whole weight rows at its start, and of
// the down GEMV's experts by gate_up's idle CTAs, both when they fit in 24-48 MiB of L2 (EP8
// T = 1), measured 3-13% slower there and 1-7% slower at T <= 8 where they did not apply (the
// kernels carrying the prefetch code); the down GEMV's 16-row tiles take two row groups per warp.
#pragma once

#include "grouped_gemm.cuh"
#include "pdl.cuh"

namespace k3 {
namespace moe {

constexpr int kDecodeMaxRows = 16;  // sorted rows per tile: at most two n8 MMA tiles
constexpr int kDecodeWarps = 4, kDecodeThreads = 32 * kDecodeWarps;
constexpr int kDecodeFeatures = 16 * kDecodeWarps;  // output features (per matrix) per CTA
// k3_moe_supported checks multiples of BN for latent and inter: whole CTAs and whole MXFP4 slabs.
static_assert(kDecodeFeatures == BN && BN % 64 == 0, "decode grids and slabs rely on multiples of BN");

// A slab: kElems elements of k per lane and weight row (4 lanes cover kWidth). bf16: 8 (16
// bytes). MXFP4: 32 (16 bytes, one scale group) in the 8-row tiles where K % 128 == 0 (every
// K3 size, decode_wide_applies), else 16 (8 bytes). The wide slab halves the load instructions
// and the scale loads per weight byte (a warp's weight load covers 64 contiguous bytes of each
// of its 8 rows instead of 32): 10-16% faster GEMVs at T <= 8, 4-6% slower with 16-row tiles.
template <bool kMxfp4, int kElemsPerLane = kMxfp4 ? 16 : 8>
struct DecodeSlab {
  static constexpr bool kMx = kMxfp4;
  static constexpr int kElems = kElemsPerLane;
  static constexpr int kWidth = 4 * kElems;                             // k covered by a slab
  static constexpr int kWords = kElems / 2;                             // bf16x2 words per lane and row
  static constexpr int kRawWords = kMxfp4 ? kElems / 8 : kElems / 2;    // loaded words per lane and row
  static constexpr int kRowBytes = kMxfp4 ? kWidth / 2 : 2 * kWidth;    // weight bytes per row and slab
};
constexpr int kDecodeWideElems = 32;
__host__ __device__ constexpr bool decode_wide_applies(int K) { return K % (4 * kDecodeWideElems) == 0; }

// Slabs per block (bf16) or register stage (MXFP4: 4 KiB of weights per warp, i.e. 8 narrow or
// 4 wide slabs of one matrix, half as many of two), and CTAs per SM the register allocation
// must allow: 4 (<= 128 registers, 16 warps) with one n tile, 3 with two, whose activation
// registers would spill at 128.
template <int kMats, class S>
constexpr int decode_unroll() { return S::kMx ? 128 / (S::kElems * kMats) : 4; }
constexpr int decode_min_blocks(int n_tiles) { return n_tiles == 1 ? 4 : 3; }

// Weights are read once: keep them out of L1. bf16 (16 bytes) volatile, so a block's loads stay
// ahead of its MMAs in source order; MXFP4 not, so the compiler may move them across the other
// stage's work (the weights never change; their addresses come after pdl_wait).
__device__ __forceinline__ void ld_weights(uint32_t (&v)[4], const uint8_t* p) {
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
               : "l"(p));
}
__device__ __forceinline__ void ld_weights_mx(uint32_t (&v)[2], const uint8_t* p) {
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];\n" : "=r"(v[0]), "=r"(v[1]) : "l"(p));
}
__device__ __forceinline__ void ld_weights_mx(uint32_t (&v)[4], const uint8_t* p) {
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
      : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
      : "l"(p));
}

// ptx.cuh's mma_bf16 without `volatile`, for MXFP4: registers only, so the compiler may
// interleave the MMAs with the next slab's dequantisation instead of keeping source order.
__device__ __forceinline__ void decode_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A lane's operands at slab 0 (the loops index or advance them).
template <int kMats, int kTiles>
struct DecodeOperands {
  const uint8_t* w[kMats][2];      // weight rows r and r+8 of each matrix, at the lane's first element
  const uint8_t* scale[kMats][2];  // MXFP4: the scale byte of that first element
  const __nv_bfloat16* x[kTiles];  // tokens r (and 8+r) at the lane's first element (attach_table_and_rows)
  Mxfp4LaneTable table;            // MXFP4: the CTA's dequantisation table
};

// Two MMAs (k16 each) per matrix and n tile: weight words w[mat][h][0..3] (rows r, r+8) against
// activation words x[t][4g .. 4g+3].
template <int kMats, int kTiles, bool kMxfp4, int kXWords>
__device__ __forceinline__ void decode_mma_group(float (&acc)[kMats][kTiles][4], const uint32_t (&w)[kMats][2][4],
                                                 const uint32_t (&x)[kTiles][kXWords], int g) {
#pragma unroll
  for (int jj = 0; jj < 2; ++jj)
#pragma unroll
    for (int mat = 0; mat < kMats; ++mat) {
      const uint32_t a[4] = {w[mat][0][2 * jj], w[mat][1][2 * jj], w[mat][0][2 * jj + 1], w[mat][1][2 * jj + 1]};
      const int j = 2 * g + jj;
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
        if constexpr (kMxfp4) {
          decode_mma(acc[mat][t], a, x[t][2 * j], x[t][2 * j + 1]);
        } else {
          mma_bf16(acc[mat][t], a, x[t][2 * j], x[t][2 * j + 1]);
        }
      }
    }
}

// The MMAs of one MXFP4 slab: each packed word (8 codes) of each row dequantised through the
// CTA's table (mxfp4.cuh: measured 10-20% faster here than the bit-move form in session 15, and
// 5-24% faster than GEMVs with two bit-move forms in session 18; the prefill GEMMs keep the bit
// moves since their MMAs, not dequantisation, bound them), then its two MMAs.
template <int kMats, int kTiles, class S>
__device__ __forceinline__ void decode_slab_mxfp4(float (&acc)[kMats][kTiles][4],
                                                  const uint32_t (&raw)[kMats][2][S::kRawWords],
                                                  const uint32_t (&scale)[kMats][2],
                                                  const uint32_t (&x)[kTiles][S::kWords], const Mxfp4LaneTable& table) {
  __nv_bfloat162 sc[kMats][2];
#pragma unroll
  for (int mat = 0; mat < kMats; ++mat)
#pragma unroll
    for (int h = 0; h < 2; ++h) sc[mat][h] = mxfp4_scale_lookup(scale[mat][h], table);
#pragma unroll
  for (int g = 0; g < S::kRawWords; ++g) {
    uint32_t w[kMats][2][4];
#pragma unroll
    for (int mat = 0; mat < kMats; ++mat)
#pragma unroll
      for (int h = 0; h < 2; ++h) mxfp4_dequant8_table(raw[mat][h][g], table, sc[mat][h], w[mat][h]);
    decode_mma_group<kMats, kTiles, true>(acc, w, x, g);
  }
}

// bf16: blocks of U slabs, each all its loads, then its MMAs (activations of lanes past the
// tile's end are zeros: x[t] == nullptr).
template <int kMats, int kTiles>
__device__ __forceinline__ void decode_mainloop_bf16(float (&acc)[kMats][kTiles][4],
                                                     const DecodeOperands<kMats, kTiles>& op, int nslab) {
  using S = DecodeSlab<false>;
  constexpr int U = decode_unroll<kMats, S>();
  for (int s0 = 0; s0 < nslab; s0 += U) {
    uint32_t raw[U][kMats][2][S::kRawWords];
    uint32_t x[U][kTiles][S::kWords];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (s0 + u >= nslab) continue;
      const int64_t s = s0 + u;
#pragma unroll
      for (int mat = 0; mat < kMats; ++mat)
#pragma unroll
        for (int h = 0; h < 2; ++h) ld_weights(raw[u][mat][h], op.w[mat][h] + s * S::kRowBytes);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (s0 + u >= nslab) continue;
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
        const __nv_bfloat16* p = op.x[t];
#pragma unroll
        for (int i = 0; i < S::kWords / 4; ++i) {
          uint4 v = make_uint4(0u, 0u, 0u, 0u);
          if (p != nullptr) v = __ldg(reinterpret_cast<const uint4*>(p + (int64_t)(s0 + u) * S::kWidth) + i);
          x[u][t][4 * i] = v.x, x[u][t][4 * i + 1] = v.y, x[u][t][4 * i + 2] = v.z, x[u][t][4 * i + 3] = v.w;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (s0 + u >= nslab) continue;
      decode_mma_group<kMats, kTiles, false>(acc, raw[u], x[u], 0);
    }
  }
}

// MXFP4: the weights of U slabs (one register stage), loaded from op's pointers, which then
// move past them (pointer increments, so the loads address with immediate offsets).
template <int U, int kMats, class S>
struct DecodeStage {
  uint32_t raw[U][kMats][2][S::kRawWords];
};

template <int U, int kMats, int kTiles, class S>
__device__ __forceinline__ void decode_stage_load(DecodeStage<U, kMats, S>& st, DecodeOperands<kMats, kTiles>& op) {
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int mat = 0; mat < kMats; ++mat)
#pragma unroll
      for (int h = 0; h < 2; ++h) ld_weights_mx(st.raw[u][mat][h], op.w[mat][h] + u * S::kRowBytes);
#pragma unroll
  for (int mat = 0; mat < kMats; ++mat)
#pragma unroll
    for (int h = 0; h < 2; ++h) op.w[mat][h] += U * S::kRowBytes;
}

// The MMAs of a loaded stage, each slab's scale bytes and activations loaded with it (mostly
// L1 hits: a 32-byte sector of scale bytes serves 8-16 slabs of a row, and the CTA's 4 warps
// read the same activations). Lanes past the tile's end read its first row (attach_table_and_rows).
template <int U, int kMats, int kTiles, class S>
__device__ __forceinline__ void decode_stage_compute(float (&acc)[kMats][kTiles][4],
                                                     const DecodeStage<U, kMats, S>& st,
                                                     DecodeOperands<kMats, kTiles>& op) {
  constexpr int kScaleStep = S::kWidth / kMxGroup;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    uint32_t scale[kMats][2];
    uint32_t x[kTiles][S::kWords];
#pragma unroll
    for (int mat = 0; mat < kMats; ++mat)
#pragma unroll
      for (int h = 0; h < 2; ++h) scale[mat][h] = __ldg(op.scale[mat][h] + u * kScaleStep);
#pragma unroll
    for (int t = 0; t < kTiles; ++t)
#pragma unroll
      for (int i = 0; i < S::kWords / 4; ++i) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(op.x[t] + u * S::kWidth) + i);
        x[t][4 * i] = v.x, x[t][4 * i + 1] = v.y, x[t][4 * i + 2] = v.z, x[t][4 * i + 3] = v.w;
      }
    decode_slab_mxfp4<kMats, kTiles, S>(acc, st.raw[u], scale, x, op.table);
  }
#pragma unroll
  for (int mat = 0; mat < kMats; ++mat)
#pragma unroll
    for (int h = 0; h < 2; ++h) op.scale[mat][h] += U * kScaleStep;
#pragma unroll
  for (int t = 0; t < kTiles; ++t) op.x[t] += U * S::kWidth;
}

// MXFP4 without whole stages (small K in the tests): U slabs at op's pointers, all their loads,
// then their MMAs; then op moves past them.
template <int U, int kMats, int kTiles, class S>
__device__ __forceinline__ void decode_block(float (&acc)[kMats][kTiles][4], DecodeOperands<kMats, kTiles>& op) {
  constexpr int kScaleStep = S::kWidth / kMxGroup;
  uint32_t raw[U][kMats][2][S::kRawWords];
  uint32_t scale[U][kMats][2];
  uint32_t x[U][kTiles][S::kWords];
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int mat = 0; mat < kMats; ++mat)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        ld_weights_mx(raw[u][mat][h], op.w[mat][h] + u * S::kRowBytes);
        scale[u][mat][h] = __ldg(op.scale[mat][h] + u * kScaleStep);
      }
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
      const __nv_bfloat16* p = op.x[t];
#pragma unroll
      for (int i = 0; i < S::kWords / 4; ++i) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(p + u * S::kWidth) + i);
        x[u][t][4 * i] = v.x, x[u][t][4 * i + 1] = v.y, x[u][t][4 * i + 2] = v.z, x[u][t][4 * i + 3] = v.w;
      }
    }
#pragma unroll
  for (int mat = 0; mat < kMats; ++mat)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      op.w[mat][h] += U * S::kRowBytes;
      op.scale[mat][h] += U * kScaleStep;
    }
#pragma unroll
  for (int t = 0; t < kTiles; ++t) op.x[t] += U * S::kWidth;
#pragma unroll
  for (int u = 0; u < U; ++u) decode_slab_mxfp4<kMats, kTiles, S>(acc, raw[u], scale[u], x[u], op.table);
}

// The two register stages over nstage whole stages.
template <int U, int kMats, int kTiles, class S>
__device__ __forceinline__ void decode_stages(float (&acc)[kMats][kTiles][4], DecodeOperands<kMats, kTiles>& op,
                                              int nstage) {
  DecodeStage<U, kMats, S> a, b;
  decode_stage_load(a, op);  // stage 0
  int i = 1;                 // a holds stage i - 1
  for (; i + 1 < nstage; i += 2) {
    decode_stage_load(b, op);  // stage i
    decode_stage_compute(acc, a, op);
    decode_stage_load(a, op);  // stage i + 1
    decode_stage_compute(acc, b, op);
  }
  if (i < nstage) {  // an even number of stages: one after a's
    decode_stage_load(b, op);
    decode_stage_compute(acc, a, op);
    decode_stage_compute(acc, b, op);
  } else {
    decode_stage_compute(acc, a, op);
  }
}

// MXFP4: two register stages a, b when whole stages cover K (all K3 sizes): b's loads are
// issued before a's MMAs and the next a's before b's. Otherwise whole blocks, then single slabs.
template <int kMats, int kTiles, class S>
__device__ __forceinline__ void decode_mainloop_mxfp4(float (&acc)[kMats][kTiles][4], DecodeOperands<kMats, kTiles> op,
                                                      int nslab) {
  constexpr int U = decode_unroll<kMats, S>();
  if (nslab % U != 0) {
    int s = 0;
    for (; s + U <= nslab; s += U) decode_block<U, kMats, kTiles, S>(acc, op);
    for (; s < nslab; ++s) decode_block<1, kMats, kTiles, S>(acc, op);
    return;
  }
  decode_stages<U, kMats, kTiles, S>(acc, op, nslab / U);
}

// acc[mat][n tile][c] += W_mat[16 rows] · X[16 tokens]ᵀ over nslab slabs.
template <int kMats, int kTiles, class S>
__device__ __forceinline__ void decode_mainloop(float (&acc)[kMats][kTiles][4],
                                                const DecodeOperands<kMats, kTiles>& op, int nslab) {
  if constexpr (S::kMx) {
    decode_mainloop_mxfp4<kMats, kTiles, S>(acc, op, nslab);
  } else {
    decode_mainloop_bf16(acc, op, nslab);
  }
}

// The lane's operands for weight rows first_row + {r, r+8} (+ mat·mat_stride_rows) of K inputs.
template <int kMats, int kTiles, class S>
__device__ __forceinline__ DecodeOperands<kMats, kTiles> decode_operands(const ExpertWeights& ew, int64_t first_row,
                                                                         int64_t mat_stride_rows, int K) {
  const int lane = threadIdx.x % 32, r = lane / 4, q = lane % 4;
  DecodeOperands<kMats, kTiles> op{};
#pragma unroll
  for (int mat = 0; mat < kMats; ++mat)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = first_row + mat * mat_stride_rows + r + 8 * h;
      if constexpr (S::kMx) {
        op.w[mat][h] = ew.packed + row * (K / 2) + q * (S::kElems / 2);
        op.scale[mat][h] = ew.scale + row * (K / kMxGroup) + q * S::kElems / kMxGroup;
      } else {
        op.w[mat][h] = reinterpret_cast<const uint8_t*>(ew.bf16 + row * K + q * S::kElems);
      }
    }
  return op;
}

// What a kernel keeps in shared memory: the MXFP4 dequantisation table, nothing for bf16.
template <bool kMxfp4>
struct DecodeShared {};
template <>
struct DecodeShared<true> {
  Mxfp4DecodeTable table;
};

// Kernel start, before anything the previous kernels wrote is read: lets the next kernel
// launch, fills the MXFP4 table while the previous kernel may still run (it depends on
// nothing), then waits for the previous kernels (pdl.cuh).
template <bool kMxfp4>
__device__ __forceinline__ void decode_prologue(DecodeShared<kMxfp4>& sm) {
  pdl_launch_dependents();
  if constexpr (kMxfp4) {
    mxfp4_table_fill(sm.table);
    __syncthreads();
  }
  pdl_wait();
}

// The rest of a kernel's operands: the lane's view of the MXFP4 table and its activation rows,
// row_of(sorted row) for the tile's rows r (and 8+r). Past the tile's end: bf16 nullptr (zeros);
// MXFP4 the tile's first row, since MMA output column n depends on activation column n alone and
// the epilogue drops those columns, so its loads need no predicate or zero fill.
template <class S, int kMats, int kTiles, typename RowOf>
__device__ __forceinline__ void attach_table_and_rows(DecodeOperands<kMats, kTiles>& op, DecodeShared<S::kMx>& sm,
                                                      const TileInfo& t, RowOf row_of) {
  constexpr bool kMxfp4 = S::kMx;
  const int lane = threadIdx.x % 32;
  if constexpr (kMxfp4) op.table = {reinterpret_cast<const char*>(sm.table.pairs) + 4 * lane, sm.table.scales};
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
    const int n = 8 * i + lane / 4;
    if constexpr (kMxfp4) {
      op.x[i] = row_of(t.row0 + (n < t.rows ? n : 0)) + (lane % 4) * S::kElems;
    } else {
      op.x[i] = n < t.rows ? row_of(t.row0 + n) + (lane % 4) * S::kElems : nullptr;
    }
  }
}

// Accumulator element c of n tile t: feature r + 8·(c/2), tile row 8t + 2q + c%2.
struct FragmentPos {
  int feature, row;
};
__device__ __forceinline__ FragmentPos fragment_pos(int t, int c) {
  const int lane = threadIdx.x % 32;
  return {lane / 4 + 8 * (c / 2), 8 * t + 2 * (lane % 4) + c % 2};
}

// The decode GEMVs run one wave of `target` CTAs (SMs x CTAs per SM: 528 on the H200 with 8-row
// tiles), each looping over work items (blockIdx.x, then decode_next_item's): no spare CTAs past the
// wave (each would fill its 33 KB table and, launched after the others, delay the programmatic
// launch of the next kernel), one table fill per CTA. Items are (M tile, column block) pairs,
// split over K when that evens out the wave: decode at one EP rank touches 1-3 of its experts
// per layer at batch 1, whose pairs alone (96-144 for gate_up) would leave most of the GPU idle
// while each CTA streams at a few GB/s (bytes in flight per warp, see above). Then each pair's K
// range is cut into `splits` chunks of whole register stages, the split count minimising
// rounds x (chunk length + 1 stage). Each split CTA stores its fp32 accumulators (L2, in the
// workspace), counts its arrival with an integer atomic, and the pair's last CTA sums the
// splits' partials in split order, 0 first, then runs the epilogue: the bits do not depend on
// which CTA finished last, and splits == 1 is the unsplit kernel's arithmetic exactly. The split
// count follows the tile count (read on the device), so a forward's bits depend on its input alone.
constexpr int kSplitMax = 16;
static_assert(2 * 2 * 4 <= kSplitAccMax, "gate_up's accumulators of two n tiles fit a partial slot");

struct DecodeWork {
  TileInfo t;
  int col;           // column block (kDecodeFeatures output features per matrix)
  int pair;          // tile * cols + col
  int split, splits; // this CTA's K chunk of the pair's splits
  int slab0, nslab;  // the chunk's slabs of K
};

// The pair count and the split of K for this GEMV (the same in every CTA): splits and slabs per
// chunk (a multiple of U, the register stage / bf16 block).
struct DecodeSplit {
  int pairs, splits, per;
};
template <int U, int N>
__device__ __forceinline__ DecodeSplit decode_split(const Schedule& s, int cols, int target, int nslab) {
  DecodeSplit d{*s.num_tiles * cols, 1, nslab};
  if (d.pairs == 0 || d.pairs > kSplitCounters || nslab % U != 0 || s.split_part == nullptr) return d;
  const int units = nslab / U, cap = units < kSplitMax ? units : kSplitMax;
  constexpr int64_t kMaxItems = (int64_t)kSplitItemsMax * kSplitAccMax / N;  // partial slots of N floats
  // Cost: rounds x (chunk length + one stage for an item's pipeline start and partials).
  int best = (d.pairs + target - 1) / target * (units + 1);
  for (int want = 2; want <= cap; ++want) {
    const int per_units = (units + want - 1) / want, splits = (units + per_units - 1) / per_units;
    const int64_t items = (int64_t)d.pairs * splits;
    if (items > kMaxItems) break;
    const int cost = (int)((items + target - 1) / target) * (per_units + 1);
    if (cost < best) {  // ties keep fewer splits (less partial traffic)
      best = cost;
      d.splits = splits;
      d.per = per_units * U;
    }
  }
  return d;
}

// Work item `id` of the split d; false past the last item.
__device__ __forceinline__ bool decode_work(const Schedule& s, const DecodeSplit& d, int bm, int cols, int nslab,
                                            int id, DecodeWork& w) {
  if (id >= d.pairs * d.splits) return false;
  w.splits = d.splits;
  w.pair = id / d.splits;
  w.col = w.pair % cols;
  const int tile = w.pair / cols;
  w.t.expert = s.tile_expert[tile];
  w.t.row0 = s.tile_row[tile];
  const int end = s.offsets[w.t.expert + 1];
  w.t.rows = end - w.t.row0 < bm ? end - w.t.row0 : bm;
  w.split = id % d.splits;
  w.slab0 = w.split * d.per;
  w.nslab = nslab - w.slab0 < d.per ? nslab - w.slab0 : d.per;
  return true;
}

// The CTA's next work item after its first (blockIdx.x): handed out in order by the GEMV's
// counter (which = 0 gate_up, 1 down), so CTAs that finish early take the rest, as the block
// scheduler would give spare CTAs (a static stride left the items of a wave and a half on the
// SMs of the first CTAs). Which CTA runs an item changes no bit of it. No counter (split_count
// nullptr): the static stride.
__device__ __forceinline__ int decode_next_item(const Schedule& s, int which, int id, int* next) {
  if (s.split_count == nullptr) return id + gridDim.x;
  __syncthreads();  // every thread has read *next
  if (threadIdx.x == 0) *next = gridDim.x + atomicAdd(s.split_count + kSplitCounters + which, 1);
  __syncthreads();
  return *next;
}

// Moves a lane's operands to slab `slab0` of K.
template <class S, int kMats, int kTiles>
__device__ __forceinline__ void decode_advance(DecodeOperands<kMats, kTiles>& op, int slab0) {
  const int64_t s0 = slab0;
#pragma unroll
  for (int mat = 0; mat < kMats; ++mat)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      op.w[mat][h] += s0 * S::kRowBytes;
      if constexpr (S::kMx) op.scale[mat][h] += s0 * (S::kWidth / kMxGroup);
    }
#pragma unroll
  for (int t = 0; t < kTiles; ++t)
    if (op.x[t] != nullptr) op.x[t] += s0 * S::kWidth;
}

// Split CTAs: store acc, count the arrival; the last CTA of the pair replaces acc by the sum of
// all splits' partials in split order and returns true (the others false). splits == 1: true.
template <int N>
__device__ __forceinline__ bool decode_split_reduce(float (&acc)[N], const Schedule& s, const DecodeWork& w) {
  static_assert(N % 4 == 0 && N <= kSplitAccMax, "partials are stored as float4");
  if (w.splits == 1) return true;
  float* base = s.split_part + (int64_t)w.pair * w.splits * kDecodeThreads * N;
  float4* mine = reinterpret_cast<float4*>(base + ((int64_t)w.split * kDecodeThreads + threadIdx.x) * N);
#pragma unroll
  for (int i = 0; i < N / 4; ++i) __stcg(mine + i, make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]));
  __threadfence();  // the partials are visible device-wide before the arrival is counted
  __syncthreads();  // every thread's partials, not only thread 0's
  int old = 0;
  if (threadIdx.x == 0) old = atomicAdd(s.split_count + w.pair, 1);
  if (!__syncthreads_or(threadIdx.x == 0 && old == w.splits - 1)) return false;
  if (threadIdx.x == 0) s.split_count[w.pair] = 0;  // every split has arrived: ready for the next GEMV
  __threadfence();
  // 0 + partial 0 is partial 0 (but for the sign of a zero), then the others in split order.
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i] = 0.0f;
  for (int sp = 0; sp < w.splits; ++sp) {
    const float4* p = reinterpret_cast<const float4*>(base + ((int64_t)sp * kDecodeThreads + threadIdx.x) * N);
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const float4 v = __ldcg(p + i);  // L2: written by other SMs
      acc[4 * i] += v.x, acc[4 * i + 1] += v.y, acc[4 * i + 2] += v.z, acc[4 * i + 3] += v.w;
    }
  }
  return true;
}

// The work loop of both GEMVs: each item's operands (kMats matrices of M output features, K
// inputs; activation rows row_of(sorted row)), its K chunk, the split-K reduction, then
// epilogue(tile, first feature of the warp, acc) where the pair is complete (its last split
// CTA; every CTA unsplit). which: the GEMV's work counter (decode_next_item).
// kRowGroups: the kMats operands of a warp are row groups 64 features apart of one matrix (the
// down GEMV: a CTA covers kMats * 64 features and each activation load serves twice the MMAs,
// as gate_up's two matrices do); else kMats matrices M rows apart (gate_up: w1, w3).
template <int kMats, int kTiles, class S, bool kRowGroups, typename RowOf, typename Epilogue>
__device__ __forceinline__ void decode_gemv(const ExpertWeights& ew, const Schedule& s, int M, int K, int which,
                                            int target, RowOf row_of, Epilogue epilogue) {
  constexpr int N = kMats * kTiles * 4;
  constexpr int kCtaFeatures = kRowGroups ? kMats * kDecodeFeatures : kDecodeFeatures;
  const int64_t expert_rows = kRowGroups ? M : (int64_t)kMats * M, op_stride = kRowGroups ? kDecodeFeatures : M;
  __shared__ DecodeShared<S::kMx> sm;
  decode_prologue(sm);  // the schedule and the activations come from the kernels before
  const int cols = M / kCtaFeatures, nslab = K / S::kWidth;
  const DecodeSplit d = decode_split<decode_unroll<kMats, S>(), N>(s, cols, target, nslab);
  DecodeWork w;
  __shared__ int next;
  for (int id = blockIdx.x; decode_work(s, d, 8 * kTiles, cols, nslab, id, w);
       id = decode_next_item(s, which, id, &next)) {
    const int f0 = w.col * kCtaFeatures + threadIdx.x / 32 * 16;
    auto op = decode_operands<kMats, kTiles, S>(ew, w.t.expert * expert_rows + f0, op_stride, K);
    attach_table_and_rows<S>(op, sm, w.t, row_of);
    decode_advance<S>(op, w.slab0);
    float acc[kMats][kTiles][4] = {};
    decode_mainloop<kMats, kTiles, S>(acc, op, w.nslab);
    if (decode_split_reduce(reinterpret_cast<float(&)[N]>(acc), s, w)) epilogue(w.t, f0, acc);
  }
}

// grid: target CTAs (one wave, decode_split_target): h[row] = glu(z[token(row)] · w1ᵀ, · w3ᵀ).
// kElems: the slab (DecodeSlab); MXFP4's wide one needs decode_wide_applies(L).
template <bool kMxfp4, int kTiles, int kElems>
__global__ void __launch_bounds__(kDecodeThreads, decode_min_blocks(kTiles)) gate_up_decode_kernel(const __nv_bfloat16* __restrict__ z,
                                                                        ExpertWeights w13,
                                                                        __nv_bfloat16* __restrict__ h, Schedule s,
                                                                        int L, int I, GluParams act, int target) {
  decode_gemv<2, kTiles, DecodeSlab<kMxfp4, kElems>, false>(
      w13, s, I, L, 0, target, [&](int row) { return z + (int64_t)s.sorted_token[row] * L; },
      [&](const TileInfo& t, int f0, const float (&acc)[2][kTiles][4]) {
#pragma unroll
        for (int i = 0; i < kTiles; ++i)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const FragmentPos p = fragment_pos(i, c);
            if (p.row < t.rows)
              h[(int64_t)(t.row0 + p.row) * I + f0 + p.feature] = __float2bfloat16_rn(glu(acc[0][i][c], acc[1][i][c], act));
          }
      });
}

// grid: target CTAs (one wave): part[row] = weight(row) · h[row] · w2ᵀ in fp32, one partial row
// per (token, slot) assignment; combine_kernel sums them in slot order. kElems: as
// gate_up_decode_kernel's, with decode_wide_applies(I). kGroups 2 (L % 128 == 0): two 16-row
// groups per warp, 128 features per CTA (decode_gemv's kRowGroups); each output feature's
// arithmetic is the same as with one.
template <bool kMxfp4, int kTiles, int kElems, int kGroups = 1>
__global__ void __launch_bounds__(kDecodeThreads, decode_min_blocks(kTiles)) down_decode_kernel(const __nv_bfloat16* __restrict__ h,
                                                                     ExpertWeights w2, float* __restrict__ part,
                                                                     Schedule s, int L, int I, int target) {
  decode_gemv<kGroups, kTiles, DecodeSlab<kMxfp4, kElems>, (kGroups > 1)>(
      w2, s, L, I, 1, target, [&](int row) { return h + (int64_t)row * I; },
      [&](const TileInfo& t, int f0, const float (&acc)[kGroups][kTiles][4]) {
#pragma unroll
        for (int g = 0; g < kGroups; ++g)
#pragma unroll
          for (int i = 0; i < kTiles; ++i)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              const FragmentPos p = fragment_pos(i, c);
              if (p.row < t.rows) {
                const int row = t.row0 + p.row;
                part[(int64_t)row * L + f0 + g * kDecodeFeatures + p.feature] =
                    s.sorted_weight[row] * acc[g][i][c];
              }
            }
      });
}

}  // namespace moe
}  // namespace k3
