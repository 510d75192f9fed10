// Causal flash attention of the expanded MLA prefill on Hopper warpgroup MMAs (wgmma,
// sm_90a), for the K3 dims (DN 128, DR 64, DV 128): the same items, passes, masks and
// outputs as flash_prefill_kernel (flash_attention.cuh), which serves other dims.
//
// CTA = 3 warpgroups over one item (128 query rows of one sequence x one head):
// warpgroup 0 produces. Thread 0 loads by TMA (2-D tensor maps made by the host, 64-column
// boxes, 128B swizzle) each item's query rows into the consumers' Q buffers and 128-key K
// tiles (192 wide: k_nope | k_pe) and V tiles (128 wide) into a 2-stage ring of
// 128B-swizzled column blocks. K rows past the item's last key (stale, another sequence's,
// or zeros past the pass) only meet masked scores; V rows there must be zeros (probability
// 0 times a stale NaN is NaN), so a tile with such rows takes V by cp.async with zero-fill
// from all 128 threads. Warpgroups 1 and 2 each own 64 query rows: S = Q·K^T as
// m64n128k16 with Q and K from shared memory, online softmax in log2 units in registers,
// then O += P·V with P straight from the S accumulators as the register A operand and V
// read MN-major from shared memory. K and V of a stage have their own `full` and `empty`
// mbarriers: each consumer thread releases K once its S retired and V once its P·V did,
// and Q once the item's last S retired, so the next loads start a softmax earlier. The two
// consumers drift freely, so one's softmax can overlap the other's MMAs (FA3's ping-pong
// and its intra-warpgroup pipelining measured no faster here: bench/NOTES_mla.md).
// Items are numbered by groups of heads (flash_item), so that the CTAs running at once
// share their keys through L2.
//
// Ring protocol: tile n of the CTA (counted over all its items) uses stage n % 2 in round
// n / 2. The producer waits for `empty` round-1 parity (a fresh barrier passes parity 1),
// consumers wait for `full` with parity round & 1 (the Q barriers the same by items).
// Producer and consumers walk the same items and tiles, and every consumer thread waits
// and arrives for every tile, also where its rows see none of the tile's keys, so the
// counts always match.
#pragma once

#include <cuda.h>  // CUtensorMap

#include <cmath>

#include "k3/mla/flash_attention.cuh"
#include "k3/mla/wgmma.cuh"

namespace k3::mla {

// d (64x128 fp32) = (scale_d ? d : 0) + A (64x16, K-major smem) * B (16x128, K-major smem).
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}
// d (64x128 fp32) += A (64x16 bf16 in registers, the m16n8k16 A layout per warp) * B
// (16x128, MN-major smem).
__device__ __forceinline__ void wgmma_m64n128k16_rs_mn(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// Keeps the compiler from moving register reads or writes across in-flight wgmmas.
template <int N>
__device__ __forceinline__ void fence_operand(float (&x)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(x[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_operand(uint32_t (&x)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(x[i][j])::"memory");
}

struct FlashWgmmaConfig {
  static constexpr int DN = 128, DR = 64, DV = 128, DQK = DN + DR;
  static constexpr int BM = 128, BN = 128, STAGES = 2;
  static constexpr int CONSUMERS = BM / 64, THREADS = 128 * (CONSUMERS + 1);
  static constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;  // 128·40 + 256·232 <= 64K
  static constexpr int Q_ELEMS = BM * DQK, K_ELEMS = BN * DQK, V_ELEMS = BN * DV;
  static constexpr size_t SMEM_BYTES =
      (Q_ELEMS + STAGES * (K_ELEMS + V_ELEMS)) * sizeof(bf16) + (4 * STAGES + 2 * CONSUMERS) * sizeof(uint64_t) + 1024;
};

// Element offset of 16-B chunk `chunk` of row `row` in a tile of ROWS rows stored as
// 128B-swizzled column blocks of 64 elements (ROWS x 128 B each, 1024-B aligned).
template <int ROWS>
__device__ __forceinline__ int sw128_tile_offset(int row, int chunk) {
  return (chunk >> 3) * (ROWS * 64) + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
}

// `count` rows `step` apart of one 16-B column chunk of a tile by cp.async: row i from
// `src` + i·src_step to shared address `dst` + i·dst_step bytes, zero-filled from row
// `valid` on. A rolled loop stepping two pointers: the producer's 40 registers cannot hold
// a table of per-row offsets (unrolled, they spilled).
__device__ __forceinline__ void copy_rows(uint32_t dst, uint32_t dst_step, const bf16* src, int64_t src_step, int count,
                                          int first, int step, int valid, const void* dummy) {
#pragma unroll 1
  for (int i = 0, r = first; i < count; ++i, r += step, dst += dst_step, src += src_step) {
    const bool ok = r < valid;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(ok ? src : dummy), "r"(ok ? 16 : 0));
  }
}

// 2-D TMA load of the map's box (64 columns x its box rows) at (x, y) (elements, rows) into
// 128B-swizzled shared memory, completing on `bar` (bytes counted by the barrier's expect_tx).
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int x, int y, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(smem_addr(bar))
      : "memory");
}

// One item's query tile and key range (flash_prefill_kernel's rules); false: nothing to do.
struct FlashItem {
  int head, q_row0, rows, first_pos, key_row0, kbeg, kend;  // key_row0: pass row of key 0
};
// Items are numbered by groups of `group` heads (the last group may be smaller), query
// tiles heaviest-first within a group, heads innermost: the ~SM-count CTAs running at once
// then cover few heads, each head's keys streamed by several CTAs together (read from L2,
// not DRAM, by all but the first).
__device__ __forceinline__ bool flash_item(const FlashParams& p, int64_t item, int total_tiles, int bm, int group,
                                           FlashItem& w) {
  const int64_t per_group = static_cast<int64_t>(group) * p.tile_bound;
  const int g = static_cast<int>(item / per_group), r = static_cast<int>(item - g * per_group);
  const int heads = min(group, p.num_heads - g * group);
  const int tile = p.tile_bound - 1 - r / heads;
  w.head = g * group + r % heads;
  if (tile >= total_tiles) return false;
  const int seq = sequence_of(p.tile_offsets, p.num_seqs, tile);
  const int q_begin = __ldg(p.cu_seqlens + seq);
  const int r0 = (tile - __ldg(p.tile_offsets + seq)) * bm;
  w.q_row0 = q_begin + r0;
  w.rows = min(bm, __ldg(p.cu_seqlens + seq + 1) - w.q_row0);
  w.first_pos = __ldg(p.context_lens + seq) + r0;
  const int key_base = __ldg(p.key_offsets + seq);
  w.key_row0 = key_base - p.pass_begin;
  w.kbeg = max(0, -w.key_row0);
  w.kend = min(w.first_pos + w.rows, p.pass_keys - w.key_row0);
  return w.kbeg < w.kend;
}

__global__ void __launch_bounds__(FlashWgmmaConfig::THREADS, 1) flash_prefill_wgmma_kernel(
    const FlashParams p, const __grid_constant__ CUtensorMap tm_kn, const __grid_constant__ CUtensorMap tm_kpe,
    const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_q) {
  using C = FlashWgmmaConfig;
  constexpr int DN = C::DN, DV = C::DV, DQK = C::DQK, BN = C::BN, STAGES = C::STAGES;
  extern __shared__ unsigned char smem_raw[];
  // wgmma's swizzle atoms must be 1024-byte aligned in the shared window.
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  bf16* const sq = reinterpret_cast<bf16*>(smem);
  bf16* const sk = sq + C::Q_ELEMS;
  bf16* const sv = sk + STAGES * C::K_ELEMS;
  // K and V halves of a stage have their own barriers: K is released right after S.
  uint64_t* const full_k = reinterpret_cast<uint64_t*>(sv + STAGES * C::V_ELEMS);
  uint64_t* const full_v = full_k + STAGES;
  uint64_t* const empty_k = full_v + STAGES;
  uint64_t* const empty_v = empty_k + STAGES;
  uint64_t* const q_full = empty_v + STAGES;  // per consumer warpgroup: its 64 query rows
  uint64_t* const q_empty = q_full + C::CONSUMERS;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full_k + s, 1);    // producer thread 0 (TMA, expect_tx)
      mbar_init(full_v + s, 128);  // every producer thread (thread 0 with expect_tx, or cp.async)
      mbar_init(empty_k + s, 128 * C::CONSUMERS);  // every consumer thread
      mbar_init(empty_v + s, 128 * C::CONSUMERS);
    }
    for (int c = 0; c < C::CONSUMERS; ++c) {
      mbar_init(q_full + c, 1);      // producer thread 0 (TMA)
      mbar_init(q_empty + c, 128);  // the warpgroup's threads, once its item's last S retired
    }
    fence_mbar_init();
  }
  __syncthreads();

  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  const int total_tiles = __ldg(p.tile_offsets + p.num_seqs);
  const int64_t items = static_cast<int64_t>(p.tile_bound) * p.num_heads;
  // Heads per item group: about 16 rounds of the grid's items per group (so the snake order
  // still balances the CTAs' work), the groups equal in size.
  const int group_min = (16 * static_cast<int>(gridDim.x) + p.tile_bound - 1) / p.tile_bound;
  const int groups = (p.num_heads + group_min - 1) / group_min;
  const int group = (p.num_heads + groups - 1) / groups;
  const int64_t v_stride = static_cast<int64_t>(p.num_heads) * DV;
  uint32_t n = 0;  // tiles of this CTA so far: ring stage n % STAGES, round n / STAGES

  if (wg == 0) {
    setmaxnreg_dec<C::PRODUCER_REGS>();
    // cp.async of a partial V tile: thread t copies chunk t % 16 of rows t/16 + 8i (16
    // threads per 256-B row).
    const int ch16 = t & 15, r16 = t >> 4;
    uint32_t q_round = 0;  // items of this CTA so far
    for (int64_t k = 0;; ++k) {
      const int64_t item = snake_item(k, blockIdx.x, gridDim.x);
      if (item >= items) break;
      FlashItem w;
      if (!flash_item(p, item, total_tiles, C::BM, group, w)) continue;
      const bf16* vv = p.v + w.head * DV + ch16 * 8;
      for (int k0 = w.kbeg; k0 < w.kend; k0 += BN, ++n) {
        const int stage = n % STAGES;
        const uint32_t parity = ((n / STAGES) & 1) ^ 1;
        const uint32_t dk = smem_addr(sk + stage * C::K_ELEMS), dv = smem_addr(sv + stage * C::V_ELEMS);
        const int64_t row0 = static_cast<int64_t>(w.key_row0) + k0;
        const int valid = w.kend - k0;
        // Column blocks of BN rows x 128 B: k_nope 0-63, 64-127, k_pe; V 0-63, 64-127.
        if (t == 0) {
          mbar_wait(empty_k + stage, parity);
          mbar_arrive_expect_tx(full_k + stage, C::K_ELEMS * sizeof(bf16));
          tma_load_2d(dk, &tm_kn, w.head * DN, static_cast<int>(row0), full_k + stage);
          tma_load_2d(dk + BN * 128, &tm_kn, w.head * DN + 64, static_cast<int>(row0), full_k + stage);
          tma_load_2d(dk + 2 * BN * 128, &tm_kpe, 0, static_cast<int>(row0), full_k + stage);
        }
        mbar_wait(empty_v + stage, parity);
        if (valid >= BN) {
          if (t == 0) {
            mbar_arrive_expect_tx(full_v + stage, C::V_ELEMS * sizeof(bf16));
            tma_load_2d(dv, &tm_v, w.head * DV, static_cast<int>(row0), full_v + stage);
            tma_load_2d(dv + BN * 128, &tm_v, w.head * DV + 64, static_cast<int>(row0), full_v + stage);
          } else {
            mbar_arrive(full_v + stage);
          }
        } else {  // rows r and r + 8 share their swizzle: 8 rows = 1024 B further in a block
          copy_rows(dv + 2 * sw128_tile_offset<BN>(r16, ch16), 1024, vv + (row0 + r16) * v_stride, 8 * v_stride,
                    BN / 8, r16, 8, valid, p.k_pe);
          mbar_cp_async_arrive(full_v + stage);
        }
        // The item's query rows after its first tile (not before: the ring's next stage
        // frees at about the time the consumers' last S of the previous item retires).
        if (k0 == w.kbeg && t == 0) {
#pragma unroll
          for (int c = 0; c < C::CONSUMERS; ++c) {
            const uint32_t dq = smem_addr(sq + c * 64 * DQK);
            mbar_wait(q_empty + c, (q_round & 1) ^ 1);
            mbar_arrive_expect_tx(q_full + c, 64 * DQK * sizeof(bf16));
#pragma unroll
            for (int cb = 0; cb < DQK / 64; ++cb)
              tma_load_2d(dq + cb * 64 * 128, &tm_q, w.head * DQK + cb * 64, w.q_row0 + 64 * c, q_full + c);
          }
        }
      }
      ++q_round;
    }
    cp_async_wait_all();
    return;
  }

  setmaxnreg_inc<C::CONSUMER_REGS>();
  const int cw = wg - 1, warp = t >> 5, lane = t & 31, g = lane >> 2, cq = lane & 3;
  bf16* const my_q = sq + cw * 64 * DQK;  // this warpgroup's 64 rows: 3 column blocks of 64x64
  uint32_t q_round = 0;

  for (int64_t k = 0;; ++k) {
    const int64_t item = snake_item(k, blockIdx.x, gridDim.x);
    if (item >= items) break;
    FlashItem w;
    if (!flash_item(p, item, total_tiles, C::BM, group, w)) continue;

    // This warpgroup's query rows, by the producer's TMA (rows past the sequence end are
    // the next tokens' or zeros: computed, never written out).
    mbar_wait(q_full + cw, q_round & 1);
    ++q_round;

    const int wg_pos = w.first_pos + 64 * cw;   // position of the warpgroup's row 0
    const int row_pos = wg_pos + 16 * warp + g;  // this thread's rows: row_pos, row_pos + 8
    const bool has_rows = 64 * cw < w.rows;
    float o[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};

    auto issue_qk = [&](float (&s)[64], int stage) {
      const bf16* tk = sk + stage * C::K_ELEMS;
#pragma unroll
      for (int i = 0; i < 64; ++i) s[i] = 0.f;
      fence_operand(s);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < DQK / 16; ++kk) {
        const int cb = kk >> 2, col = (kk & 3) * 16;
        wgmma_m64n128k16_ss(s, sw128_desc(my_q + cb * 64 * 64 + col, 16, 1024),
                            sw128_desc(tk + cb * BN * 64 + col, 16, 1024), kk > 0);
      }
      wgmma_commit();
    };
    // Masks and exponentiates s in place (the scale folded into one FFMA per score),
    // updates the row statistics (log2 units), packs P into the A fragments and returns the
    // factors that rescale O.
    auto softmax = [&](float (&s)[64], int k0, uint32_t (&pa)[BN / 16][4], float (&alpha)[2]) {
      if (k0 + BN > w.kend || k0 + BN - 1 > wg_pos) {
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = k0 + 8 * j + 2 * cq + (e & 1), pos = row_pos + 8 * (e >> 1);
            s[4 * j + e] = (key >= w.kend) | (key > pos) ? -INFINITY : s[4 * j + e];
          }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * half], s[4 * j + 2 * half + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        mx = fmaxf(row_max[half], mx * p.scale_log2);
        const float ref = mx == -INFINITY ? 0.f : mx;  // a row with no key yet: all terms 0
        alpha[half] = fast_exp2(row_max[half] - ref);
        row_max[half] = mx;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          s[4 * j + 2 * half] = fast_exp2(fmaf(s[4 * j + 2 * half], p.scale_log2, -ref));
          s[4 * j + 2 * half + 1] = fast_exp2(fmaf(s[4 * j + 2 * half + 1], p.scale_log2, -ref));
          sum += s[4 * j + 2 * half] + s[4 * j + 2 * half + 1];
        }
        row_sum[half] = row_sum[half] * alpha[half] + sum;  // this thread's columns; quad-reduced at the end
      }
      // Keys 16kk..16kk+15 are accumulator groups 2kk and 2kk+1: exactly the A fragment.
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        pa[kk][0] = pack_bf16(s[8 * kk + 0], s[8 * kk + 1]);
        pa[kk][1] = pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
        pa[kk][2] = pack_bf16(s[8 * kk + 4], s[8 * kk + 5]);
        pa[kk][3] = pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
      }
    };
    auto rescale = [&](const float (&alpha)[2]) {
#pragma unroll
      for (int j = 0; j < DV / 8; ++j) {
        o[4 * j] *= alpha[0];
        o[4 * j + 1] *= alpha[0];
        o[4 * j + 2] *= alpha[1];
        o[4 * j + 3] *= alpha[1];
      }
    };
    // V tile: column blocks of 64 values x BN keys (BN·128 B apart), 8-key groups 1024 B apart.
    auto issue_pv = [&](uint32_t (&pa)[BN / 16][4], int stage) {
      const bf16* tv = sv + stage * C::V_ELEMS;
      fence_operand(o);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
        wgmma_m64n128k16_rs_mn(o, pa[kk], sw128_desc(tv + kk * 16 * 64, BN * 128, 1024));
      wgmma_commit();
    };
    auto wait_full = [&](uint64_t* full, uint32_t tile) {
      mbar_wait(full + tile % STAGES, (tile / STAGES) & 1);
      fence_proxy_async();  // the producer's cp.async writes, read next by the async proxy
    };

    // The tiles this warpgroup computes are a prefix of the item's (i < active_tiles); each
    // tile's wgmmas retire within its iteration, and no wgmma sits in a branch.
    const int active_end = has_rows ? min(w.kend, wg_pos + 64) : w.kbeg;
    const int active_tiles = max(0, active_end - w.kbeg + BN - 1) / BN;
    const int tiles = (w.kend - w.kbeg + BN - 1) / BN;
    for (int i = 0; i < active_tiles; ++i, ++n) {
      const int stage = n % STAGES;
      wait_full(full_k, n);
      float s[64];
      issue_qk(s, stage);
      wgmma_wait<0>();
      fence_operand(s);
      mbar_arrive(empty_k + stage);
      if (i == active_tiles - 1) mbar_arrive(q_empty + cw);  // Q read for the last time
      uint32_t pa[BN / 16][4];
      float alpha[2];
      softmax(s, w.kbeg + i * BN, pa, alpha);
      rescale(alpha);
      wait_full(full_v, n);
      issue_pv(pa, stage);
      wgmma_wait<0>();
      fence_operand(o);
      fence_operand(pa);
      mbar_arrive(empty_v + stage);
    }
    if (active_tiles == 0) mbar_arrive(q_empty + cw);
    for (int i = active_tiles; i < tiles; ++i, ++n) {  // keys past this warpgroup's rows
      wait_full(full_k, n);
      mbar_arrive(empty_k + n % STAGES);
      wait_full(full_v, n);
      mbar_arrive(empty_v + n % STAGES);
    }

    float old_lse[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], 1);
      row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], 2);
      const int row = 64 * cw + 16 * warp + g + 8 * half;
      old_lse[half] = p.acc != nullptr && row < w.rows && row_sum[half] > 0.f
                          ? p.acc_lse[static_cast<int64_t>(w.q_row0 + row) * p.num_heads + w.head]
                          : -INFINITY;
    }
    __syncwarp();  // every lane of a quad has read the old lse before lane 0 replaces it
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = 64 * cw + 16 * warp + g + 8 * half;
      const float rsum = row_sum[half];
      // A row whose keys all lie outside this pass has nothing to add (several passes only).
      if (row >= w.rows || rsum == 0.f) continue;
      const int64_t token = w.q_row0 + row;
      if (p.acc == nullptr) {
        const float inv = 1.f / rsum;
        bf16* dst = p.out + token * v_stride + w.head * DV + 2 * cq;
#pragma unroll
        for (int j = 0; j < DV / 8; ++j)
          *reinterpret_cast<uint32_t*>(dst + j * 8) = pack_bf16(o[4 * j + 2 * half] * inv, o[4 * j + 2 * half + 1] * inv);
        continue;
      }
      const float lse = row_max[half] + log2f(rsum);
      const float top = fmaxf(lse, old_lse[half]);
      const float w_old = fast_exp2(old_lse[half] - top), w_new = fast_exp2(lse - top);
      const float total = w_old + w_new;
      const float keep = w_old / total, add = w_new / (total * rsum);
      float* dst = p.acc + (token * p.num_heads + w.head) * DV + 2 * cq;
      const bool first = old_lse[half] == -INFINITY;  // accumulators not yet written
#pragma unroll
      for (int j = 0; j < DV / 8; ++j) {
        float2 prev = first ? make_float2(0.f, 0.f) : *reinterpret_cast<const float2*>(dst + j * 8);
        prev.x = prev.x * keep + o[4 * j + 2 * half] * add;
        prev.y = prev.y * keep + o[4 * j + 2 * half + 1] * add;
        *reinterpret_cast<float2*>(dst + j * 8) = prev;
      }
      if (cq == 0) p.acc_lse[token * p.num_heads + w.head] = top + log2f(total);
    }
  }
}

}  // namespace k3::mla
