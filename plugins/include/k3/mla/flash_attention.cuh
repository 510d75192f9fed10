// Causal flash attention of the expanded MLA prefill (spec §4.4.3) over one pass of
// expanded keys (prefill_expanded.cuh): per head, key = [k_nope_h (DN) | k_pe (DR, shared
// by all heads)], value v_h (DV); fp32 online softmax in the log2 domain.
//
// One work item = BM new tokens of one sequence (a query tile) x one head; 8 warps of 16·MB
// query rows, 64-key K/V tiles in a 2-stage cp.async ring (padded rows: conflict-free
// ldmatrix). MB = 1: BM = 128, queries held in registers as mma.sync A fragments. MB = 2:
// BM = 256, queries re-read from shared memory at each k step; every K/V fragment then
// feeds two row blocks, which halves the ldmatrix traffic per MMA (shared-memory bandwidth,
// 256 B per m16n8k16 with MB = 1, is what bounds this kernel). The grid is persistent
// (about one CTA per SM) and walks the items heaviest-first in a snake order, so passes
// or query tiles with no work cost one check, not a CTA launch.
//
// Keys are numbered per sequence (positions 0..context+n-1) and flattened over the batch
// (key_offsets); a pass holds flattened keys [pass_begin, pass_begin + pass_keys). Query i
// of a sequence with context c sits at position c+i and sees positions 0..c+i. With one
// pass the normalised output goes straight to `out` (bf16); with several, each pass merges
// its normalised output and log2-sum-exp into fp32 accumulators (acc, acc_lse), which
// finalize_passes_kernel converts at the end.
//
// The K3 dims (128, 64, 128) run flash_prefill_wgmma_kernel (flash_attention_wgmma.cuh,
// warpgroup MMAs) instead; this kernel serves the other dims (the tiny model's 32, 16, 32).
#pragma once

#include <cmath>

#include "k3/mla/ptx.cuh"
#include "k3/mla/step_offsets.cuh"

namespace k3::mla {

struct FlashParams {
  const bf16* q;       // [T, H, DN+DR]
  const bf16* k_nope;  // [pass_keys, H, DN]: row r holds flattened key pass_begin + r
  const bf16* k_pe;    // [pass_keys, DR]
  const bf16* v;       // [pass_keys, H, DV]
  const int* cu_seqlens;
  const int* context_lens;
  const int* key_offsets;   // [B+1] flattened index of each sequence's key 0; [B] = total
  const int* tile_offsets;  // [B+1] first query tile of each sequence; [B] = total
  bf16* out;                // [T, H*DV], written when acc == nullptr
  float* acc;               // [T, H, DV] normalised output so far (several passes)
  float* acc_lse;           // [T, H] its log2-sum-exp; -inf before the first contribution
  int num_seqs, num_heads;
  int tile_bound;  // >= tile_offsets[B], known on the host: ceil(T/BM) + B
  int pass_begin, pass_keys;
  float scale_log2;  // softmax_scale * log2(e)
};

template <int DN, int DR, int DV, int MB>
struct FlashConfig {
  static constexpr int DQK = DN + DR;
  static constexpr int WARPS = 8, THREADS = 32 * WARPS, BM = 16 * MB * WARPS, BN = 64;
  // Rows padded by 16 B: eight consecutive rows start in eight different 16-B bank groups.
  static constexpr int K_STRIDE = DQK + 8, V_STRIDE = DV + 8;
  static constexpr int Q_ELEMS = BM * K_STRIDE, K_ELEMS = BN * K_STRIDE, V_ELEMS = BN * V_STRIDE;
  static constexpr size_t SMEM_BYTES = (Q_ELEMS + 2 * (K_ELEMS + V_ELEMS)) * sizeof(bf16);
  static_assert(DQK % 16 == 0 && DV % 16 == 0 && DN % 8 == 0 && DR % 8 == 0, "MMA tile shapes");
};

// Item k of CTA `cta` among `ctas`: round r = k walks forward on even rounds and backward
// on odd ones, so the CTA that got the heaviest item of one round gets the lightest of the next.
__device__ __forceinline__ int64_t snake_item(int64_t k, int cta, int ctas) {
  return k * ctas + ((k & 1) ? ctas - 1 - cta : cta);
}

template <int DN, int DR, int DV, int MB>
__global__ void __launch_bounds__(256, 1) flash_prefill_kernel(const FlashParams p) {
  using C = FlashConfig<DN, DR, DV, MB>;
  constexpr int DQK = C::DQK, BM = C::BM, BN = C::BN, THREADS = C::THREADS;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* const sq = reinterpret_cast<bf16*>(smem_raw);
  bf16* const sk = sq + C::Q_ELEMS;
  bf16* const sv = sk + 2 * C::K_ELEMS;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, cq = lane & 3;
  const int total_tiles = __ldg(p.tile_offsets + p.num_seqs);
  const int64_t q_stride = static_cast<int64_t>(p.num_heads) * DQK;
  const int64_t kn_stride = static_cast<int64_t>(p.num_heads) * DN;
  const int64_t v_stride = static_cast<int64_t>(p.num_heads) * DV;
  const int64_t items = static_cast<int64_t>(p.tile_bound) * p.num_heads;

  for (int64_t k = 0;; ++k) {
    const int64_t item = snake_item(k, blockIdx.x, gridDim.x);
    if (item >= items) break;
    // Later query tiles of a sequence see more keys: take tiles from the last one down.
    const int tile = p.tile_bound - 1 - static_cast<int>(item / p.num_heads);
    const int head = static_cast<int>(item % p.num_heads);
    if (tile >= total_tiles) continue;
    const int seq = sequence_of(p.tile_offsets, p.num_seqs, tile);
    const int q_begin = __ldg(p.cu_seqlens + seq);
    const int r0 = (tile - __ldg(p.tile_offsets + seq)) * BM;
    const int rows = min(BM, __ldg(p.cu_seqlens + seq + 1) - q_begin - r0);
    const int first_pos = __ldg(p.context_lens + seq) + r0;  // position of query row 0
    const int key_base = __ldg(p.key_offsets + seq);
    const int kbeg = max(0, p.pass_begin - key_base);
    const int kend = min(first_pos + rows, p.pass_begin + p.pass_keys - key_base);
    if (kbeg >= kend) continue;

    const bf16* qg = p.q + static_cast<int64_t>(q_begin + r0) * q_stride + head * DQK;
    constexpr int QCH = DQK / 8;
#pragma unroll
    for (int i = 0; i < (BM * QCH + THREADS - 1) / THREADS; ++i) {
      const int id = tid + i * THREADS;
      if (id < BM * QCH) {
        const int r = id / QCH, ch = id % QCH;
        const bool ok = r < rows;  // rows past the sequence end: zero queries, never written
        cp_async16(sq + r * C::K_STRIDE + ch * 8, ok ? qg + r * q_stride + ch * 8 : qg, ok ? 16 : 0);
      }
    }
    cp_async_commit();

    // Keys past kend are zero-filled (a stale NaN times probability 0 would still be NaN).
    auto load_kv = [&](int k0, int stage) {
      bf16* dk = sk + stage * C::K_ELEMS;
      bf16* dv = sv + stage * C::V_ELEMS;
      constexpr int NCH = DN / 8, KCH = DQK / 8, VCH = DV / 8;
#pragma unroll
      for (int i = 0; i < (BN * KCH + THREADS - 1) / THREADS; ++i) {
        const int id = tid + i * THREADS;
        if (id < BN * KCH) {
          const int r = id / KCH, ch = id % KCH;
          const bool ok = k0 + r < kend;
          const int64_t row = key_base + k0 + r - p.pass_begin;
          const bf16* src = ch < NCH ? p.k_nope + row * kn_stride + head * DN + ch * 8
                                     : p.k_pe + row * DR + (ch - NCH) * 8;
          cp_async16(dk + r * C::K_STRIDE + ch * 8, ok ? src : p.k_pe, ok ? 16 : 0);
        }
      }
#pragma unroll
      for (int i = 0; i < (BN * VCH + THREADS - 1) / THREADS; ++i) {
        const int id = tid + i * THREADS;
        if (id < BN * VCH) {
          const int r = id / VCH, ch = id % VCH;
          const bool ok = k0 + r < kend;
          const int64_t row = key_base + k0 + r - p.pass_begin;
          cp_async16(dv + r * C::V_STRIDE + ch * 8, ok ? p.v + row * v_stride + head * DV + ch * 8 : p.v,
                     ok ? 16 : 0);
        }
      }
    };

    load_kv(kbeg, 0);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const int warp_row = warp * 16 * MB;  // the warp's first query row in the tile
    uint32_t qf[MB == 1 ? DQK / 16 : 1][4];
    if constexpr (MB == 1) {
#pragma unroll
      for (int ks = 0; ks < DQK / 16; ++ks)
        ldmatrix_x4(qf[ks], sq + (warp_row + (lane & 15)) * C::K_STRIDE + ks * 16 + (lane >> 4) * 8);
    }

    float o[MB][DV / 8][4] = {};
    float row_max[MB][2], row_sum[MB][2];
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        row_max[mb][half] = -INFINITY;
        row_sum[mb][half] = 0.f;
      }
    const int warp_pos = first_pos + warp_row;  // position of the warp's first row
    const int n_tiles = (kend - kbeg + BN - 1) / BN;
    for (int it = 0; it < n_tiles; ++it) {
      const int k0 = kbeg + it * BN;
      if (it + 1 < n_tiles) {
        load_kv(k0 + BN, (it + 1) & 1);
        cp_async_commit();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
      const bf16* tk = sk + (it & 1) * C::K_ELEMS;
      const bf16* tv = sv + (it & 1) * C::V_ELEMS;

      float s[MB][BN / 8][4] = {};
#pragma unroll
      for (int ks = 0; ks < DQK / 16; ++ks) {
        uint32_t a[MB][4];
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) {
          if constexpr (MB == 1) {
#pragma unroll
            for (int j = 0; j < 4; ++j) a[mb][j] = qf[ks][j];
          } else {
            ldmatrix_x4(a[mb], sq + (warp_row + mb * 16 + (lane & 15)) * C::K_STRIDE + ks * 16 + (lane >> 4) * 8);
          }
        }
#pragma unroll
        for (int nj = 0; nj < BN / 16; ++nj) {
          uint32_t b[4];
          ldmatrix_x4(b, tk + (nj * 16 + (lane & 7) + ((lane >> 4) << 3)) * C::K_STRIDE + ks * 16 +
                             ((lane >> 3) & 1) * 8);
#pragma unroll
          for (int mb = 0; mb < MB; ++mb) {
            mma_bf16(s[mb][2 * nj], a[mb], b[0], b[1]);
            mma_bf16(s[mb][2 * nj + 1], a[mb], b[2], b[3]);
          }
        }
      }

      const bool masked = k0 + BN > kend || k0 + BN - 1 > warp_pos;
#pragma unroll
      for (int mb = 0; mb < MB; ++mb)
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = k0 + nt * 8 + 2 * cq + (e & 1);
            const int pos = warp_pos + mb * 16 + g + (e >> 1) * 8;
            s[mb][nt][e] = (masked && (key >= kend || key > pos)) ? -INFINITY : s[mb][nt][e] * p.scale_log2;
          }

#pragma unroll
      for (int mb = 0; mb < MB; ++mb)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float mx = row_max[mb][half];
#pragma unroll
          for (int nt = 0; nt < BN / 8; ++nt) mx = fmaxf(mx, fmaxf(s[mb][nt][2 * half], s[mb][nt][2 * half + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float ref = mx == -INFINITY ? 0.f : mx;  // a row with no key yet: all terms 0
          const float alpha = fast_exp2(row_max[mb][half] - ref);
          row_max[mb][half] = mx;
          float sum = 0.f;
#pragma unroll
          for (int nt = 0; nt < BN / 8; ++nt) {
            s[mb][nt][2 * half] = fast_exp2(s[mb][nt][2 * half] - ref);
            s[mb][nt][2 * half + 1] = fast_exp2(s[mb][nt][2 * half + 1] - ref);
            sum += s[mb][nt][2 * half] + s[mb][nt][2 * half + 1];
          }
          row_sum[mb][half] = row_sum[mb][half] * alpha + sum;  // this thread's columns; quad-reduced at the end
#pragma unroll
          for (int nt = 0; nt < DV / 8; ++nt) {
            o[mb][nt][2 * half] *= alpha;
            o[mb][nt][2 * half + 1] *= alpha;
          }
        }

#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        // The score accumulators of keys 16kk..16kk+15 are exactly the A fragment of P.
        uint32_t a[MB][4];
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) {
          a[mb][0] = pack_bf16(s[mb][2 * kk][0], s[mb][2 * kk][1]);
          a[mb][1] = pack_bf16(s[mb][2 * kk][2], s[mb][2 * kk][3]);
          a[mb][2] = pack_bf16(s[mb][2 * kk + 1][0], s[mb][2 * kk + 1][1]);
          a[mb][3] = pack_bf16(s[mb][2 * kk + 1][2], s[mb][2 * kk + 1][3]);
        }
#pragma unroll
        for (int nj = 0; nj < DV / 16; ++nj) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, tv + (kk * 16 + (lane & 15)) * C::V_STRIDE + nj * 16 + (lane >> 4) * 8);
#pragma unroll
          for (int mb = 0; mb < MB; ++mb) {
            mma_bf16(o[mb][2 * nj], a[mb], b[0], b[1]);
            mma_bf16(o[mb][2 * nj + 1], a[mb], b[2], b[3]);
          }
        }
      }
      __syncthreads();  // the next load overwrites this stage
    }

    float old_lse[MB][2];
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        row_sum[mb][half] += __shfl_xor_sync(0xffffffffu, row_sum[mb][half], 1);
        row_sum[mb][half] += __shfl_xor_sync(0xffffffffu, row_sum[mb][half], 2);
        const int row = warp_row + mb * 16 + g + half * 8;
        old_lse[mb][half] = p.acc != nullptr && row < rows && row_sum[mb][half] > 0.f
                                ? p.acc_lse[static_cast<int64_t>(q_begin + r0 + row) * p.num_heads + head]
                                : -INFINITY;
      }
    __syncwarp();  // every lane of a quad has read the old lse before lane 0 replaces it
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = warp_row + mb * 16 + g + half * 8;
        const float rsum = row_sum[mb][half];
        // A row whose keys all lie outside this pass has nothing to add (several passes only).
        if (row >= rows || rsum == 0.f) continue;
        const int64_t token = q_begin + r0 + row;
        if (p.acc == nullptr) {
          const float inv = 1.f / rsum;
          bf16* dst = p.out + token * v_stride + head * DV + 2 * cq;
#pragma unroll
          for (int nt = 0; nt < DV / 8; ++nt)
            *reinterpret_cast<uint32_t*>(dst + nt * 8) =
                pack_bf16(o[mb][nt][2 * half] * inv, o[mb][nt][2 * half + 1] * inv);
          continue;
        }
        const float lse = row_max[mb][half] + log2f(rsum);
        const float top = fmaxf(lse, old_lse[mb][half]);
        const float w_old = fast_exp2(old_lse[mb][half] - top), w_new = fast_exp2(lse - top);
        const float total = w_old + w_new;
        const float keep = w_old / total, add = w_new / (total * rsum);
        float* dst = p.acc + (token * p.num_heads + head) * DV + 2 * cq;
        const bool first = old_lse[mb][half] == -INFINITY;  // accumulators not yet written
#pragma unroll
        for (int nt = 0; nt < DV / 8; ++nt) {
          float2 prev = first ? make_float2(0.f, 0.f) : *reinterpret_cast<const float2*>(dst + nt * 8);
          prev.x = prev.x * keep + o[mb][nt][2 * half] * add;
          prev.y = prev.y * keep + o[mb][nt][2 * half + 1] * add;
          *reinterpret_cast<float2*>(dst + nt * 8) = prev;
        }
        if (cq == 0) p.acc_lse[token * p.num_heads + head] = top + log2f(total);
      }
  }
}

}  // namespace k3::mla
