// C-ABI launchers of the K3 MLA ops (contract MLA_PREFILL / MLA_DECODE, spec §4.4, §6.1).
//
// Absorbed form (exact, spec §4.4.5; every decode, short prefill chunks): insert this
// step's latent rows at slot_mapping, q_lat = q_nope·W_UK per head, causal MQA over the
// paged latent cache (split-KV + combine), out = a_lat·W_UV^T per head. It serves any mix
// of new-token counts per sequence, chunked prefill included.
//
// Expanded form (prefill with >= kExpandedMinTokensPerSeq new tokens per sequence on
// average, spec §4.4.3): insert, then per pass of at most a fixed number of keys expand the
// cached latents into per-head K_nope / V (a GEMM reading the paged cache) and run causal
// flash attention (Dqk = DN+DR, k_pe shared by all heads) over them; several passes merge
// through an fp32 log-sum-exp accumulator. It does 2·(DN+DR+DV) FLOP per query-key-head
// instead of 2·(R+DR+R) (3.4x fewer at K3 dims) plus 2·R·(DN+DV) per key and head for the
// expansion, which a chunk of >= 384 new tokens per sequence amortises even over a long
// context (bench/NOTES_mla.md).
//
// Supported: bf16 tensors, (kv_lora_rank, qk_rope_head_dim) in {(512, 64), (64, 16)},
// qk_nope_head_dim % 32 == 0, v_head_dim % 8 == 0, any block_size >= 1; every tensor
// contiguous and 16-byte aligned. Other shapes return cudaErrorInvalidValue. The expanded
// form needs (DN, DR, DV) in {(128, 64, 128), (32, 16, 32)}; other prefills run absorbed.
//
// The fp8 latent cache (K3MlaPrefillFp8 / K3MlaDecodeFp8, K3MlaFp8Params; k3/mla/fp8_latent.cuh):
// the same launchers with the rows quantised on insert and dequantised on read (decode: into
// the attention kernels' shared-memory tiles; expanded prefill: one bf16 row per pass key
// before the expansion GEMM). Also needs scale_group % 16 == 0 dividing kv_lora_rank and rows
// of a multiple of 16 bytes (K3: 656; the tiny model's 100-byte rows are refused).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "k3/common/workspace_carver.h"
#include "k3/mla_api.h"
#include "k3/mla/flash_attention.cuh"
#include "k3/mla/flash_attention_wgmma.cuh"
#include "k3/mla/fp8_latent.cuh"
#include "k3/mla/head_gemm.cuh"
#include "k3/mla/insert.cuh"
#include "k3/mla/latent_attention.cuh"
#include "k3/mla/latent_attention_wgmma.cuh"
#include "k3/mla/prefill_expanded.cuh"

namespace {

using k3::mla::bf16;

constexpr int kTileTokens = 64;

// The mma.sync kernel's KV ring: 32-token tiles, 2 stages, so that a CTA needs ~103 KB of
// shared memory and 2 CTAs share an SM (one's barriers and softmax overlap the other's
// loads and MMAs); ahead of 64-token tiles x 2 stages and 32 x 5 stages at one CTA per SM
// at B=256, L=8192, H=16 (bench/NOTES_mla.md, session-11 runs).
constexpr int kSmallTile = 32, kSmallStages = 2, kSmallCtasPerSm = 2;

struct SplitPlan {
  int heads_per_cta;
  int head_groups;
  int num_splits;
  int split_tokens;
};

// Up to 16 heads: the mma.sync kernel, 16 heads per CTA (the wgmma kernel would pad them
// to 64 rows and is compute-bound there). More heads: warpgroup
// MMAs, 64 heads per CTA, for the K3 latent (R = 512); the mma.sync kernel with 32 heads
// per CTA for other latent widths.
int heads_per_cta(int rank, int num_heads) {
  if (num_heads <= 16) return 16;
  return rank == 512 ? 64 : 32;
}

int sm_count() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 132;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 132;
  return sms;
}

// Batch-invariant mode (k3_mla_set_batch_invariant): key splits of a fixed kInvariantSplitTokens
// keys, so a sequence's splits, and the merge of their partials, do not depend on the batch (the
// default sizes them by the batch's token count and block-table width). Splits past a sequence's
// end are empty (weight 0), which leaves the merged value's bits as they are; a single split
// writes bf16(o) directly, which is what the merge of one non-empty split gives too.
std::atomic<int> g_batch_invariant{0};
constexpr int64_t kInvariantSplitTokens = 4 * kTileTokens;

// The key range of a CTA is split so that the grid fills whole waves (wgmma kernel: one CTA
// per SM, ~226 KB of shared memory; mma.sync kernel: two per SM). The longest possible
// sequence is the block table's width; the cost model is waves x tokens per split, ties
// going to fewer splits (each split costs an extra fp32 partial output and a combine pass).
SplitPlan plan_splits(int num_tokens, int num_heads, int rank, int max_blocks, int block_size) {
  SplitPlan plan{};
  plan.heads_per_cta = heads_per_cta(rank, num_heads);
  plan.head_groups = (num_heads + plan.heads_per_cta - 1) / plan.heads_per_cta;
  const int64_t max_kv = std::max<int64_t>(1, static_cast<int64_t>(max_blocks) * block_size);
  if (g_batch_invariant.load(std::memory_order_relaxed) != 0) {
    int64_t chunk = kInvariantSplitTokens;  // doubled past kMaxCombineSplits splits (> 256 K keys)
    while ((max_kv + chunk - 1) / chunk > k3::mla::kMaxCombineSplits) chunk *= 2;
    plan.split_tokens = static_cast<int>(chunk);
    plan.num_splits = static_cast<int>((max_kv + chunk - 1) / chunk);
    return plan;
  }
  const int64_t base = std::max<int64_t>(1, static_cast<int64_t>(num_tokens) * plan.head_groups);
  const int64_t slots = sm_count() * (plan.heads_per_cta == 64 ? 1 : kSmallCtasPerSm);
  const int64_t max_splits =
      std::min<int64_t>(k3::mla::kMaxCombineSplits, (max_kv + 2 * kTileTokens - 1) / (2 * kTileTokens));
  double best_cost = 0.0;
  plan.num_splits = 1;
  plan.split_tokens = static_cast<int>((max_kv + kTileTokens - 1) / kTileTokens * kTileTokens);
  for (int64_t s = 1; s <= std::max<int64_t>(1, max_splits); ++s) {
    const int64_t chunk = ((max_kv + s - 1) / s + kTileTokens - 1) / kTileTokens * kTileTokens;
    const int64_t splits = (max_kv + chunk - 1) / chunk;
    const int64_t waves = (base * splits + slots - 1) / slots;
    const double cost = static_cast<double>(waves) * static_cast<double>(chunk + kTileTokens);
    if (s == 1 || cost < 0.97 * best_cost) {
      best_cost = cost;
      plan.num_splits = static_cast<int>(splits);
      plan.split_tokens = static_cast<int>(chunk);
    }
    if (base * splits >= 8 * slots) break;  // enough parallelism; more splits only add merges
  }
  return plan;
}

struct Workspace {
  bf16* q_lat;
  bf16* a_lat;
  float* o_part;
  float* lse_part;
  size_t bytes;
};

Workspace carve(void* base, int num_tokens, int num_heads, int rank, const SplitPlan& plan) {
  const size_t rows = static_cast<size_t>(num_tokens) * num_heads;
  const size_t split_rows = plan.num_splits > 1 ? plan.num_splits * rows : 0;  // partials only when split
  k3::WorkspaceCarver c(base);
  Workspace ws{};
  ws.q_lat = c.take<bf16>(rows * rank);
  ws.a_lat = c.take<bf16>(rows * rank);
  ws.o_part = c.take<float>(split_rows * rank);
  ws.lse_part = c.take<float>(split_rows);
  ws.bytes = c.used();
  return ws;
}

bool supported(int rank, int rope, int nope, int v_dim) {
  const bool dims = (rank == 512 && rope == 64) || (rank == 64 && rope == 16);
  return dims && nope > 0 && nope % 32 == 0 && v_dim > 0 && v_dim % 8 == 0;
}

// The fp8 cache's extra conditions (beyond supported()): scale groups of a multiple of 16
// channels dividing the rank, a power of two (the readers shift; every Q dividing 512 or 64
// is one), rows of a multiple of 16 bytes (bulk copies, 16-byte chunks).
bool fp8_supported(int rank, int rope, int scale_group) {
  return scale_group > 0 && scale_group % 16 == 0 && rank % scale_group == 0 &&
         (scale_group & (scale_group - 1)) == 0 &&
         k3::mla::fp8_row_bytes(rank, rope, scale_group) % 16 == 0;
}

// The fp8 cache's direct kernel (K3 latent, <= 16 heads, scale groups of 128 channels, K3's: the
// MMAs read the raw stage, no bf16 tile) holds 3 raw 32-row stages (63 KB; 97 KB per CTA, 2
// CTAs per SM) so that as many bytes are in flight as the bf16 ring's 2 x 37 KB (2 stages:
// 533.1 instead of 521.4 us at B 64 x 32k x 12 heads, session 16). Other fp8 shapes dequantise
// each stage into a bf16 tile first (at the direct kernel's shapes 818.3 us there,
// bench/NOTES_mla.md session 16).
constexpr int kSmallStagesFp8 = 3;

template <int R, int DR, int MT, int STAGES, bool FP8, bool DIRECT>
cudaError_t launch_attention_kernel(const k3::mla::LatentAttentionParams& p, cudaStream_t stream) {
  using C = k3::mla::LatentAttentionConfig<R, DR, MT, kSmallTile, STAGES, FP8, DIRECT>;
  auto kernel = k3::mla::latent_attention_kernel<R, DR, MT, kSmallTile, STAGES, kSmallCtasPerSm, FP8, DIRECT>;
  const size_t smem = C::smem_bytes(p.row_bytes);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  const int64_t ctas = static_cast<int64_t>(p.num_tokens) * p.num_splits * p.head_groups;
  kernel<<<static_cast<unsigned>(ctas), C::THREADS, smem, stream>>>(p);
  return cudaGetLastError();
}

template <int R, int DR, int MT, bool FP8>
cudaError_t launch_attention_mt(const k3::mla::LatentAttentionParams& p, cudaStream_t stream) {
  if constexpr (FP8 && R == 512 && DR == 64 && MT == 1)
    if (p.scale_group == 128) return launch_attention_kernel<R, DR, MT, kSmallStagesFp8, true, true>(p, stream);
  return launch_attention_kernel<R, DR, MT, kSmallStages, FP8, false>(p, stream);
}

template <bool FP8>
cudaError_t launch_attention_wgmma(const k3::mla::LatentAttentionParams& p, cudaStream_t stream) {
  using C = k3::mla::WgmmaAttentionConfig;
  const size_t smem = FP8 ? C::fp8_smem_bytes(p.row_bytes) : C::SMEM_BYTES;
  cudaError_t err = cudaFuncSetAttribute(k3::mla::latent_attention_wgmma_kernel<FP8>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  const int64_t ctas = static_cast<int64_t>(p.num_tokens) * p.num_splits * p.head_groups;
  k3::mla::latent_attention_wgmma_kernel<FP8><<<static_cast<unsigned>(ctas), C::THREADS, smem, stream>>>(p);
  return cudaGetLastError();
}

template <int R, int DR, bool FP8>
cudaError_t launch_attention(const k3::mla::LatentAttentionParams& p, int heads_per_cta,
                             cudaStream_t stream) {
  cudaError_t err;
  if constexpr (R == 512)  // heads_per_cta() gives 16 or 64 for the K3 latent
    err = heads_per_cta == 64 ? launch_attention_wgmma<FP8>(p, stream)
                              : launch_attention_mt<R, DR, 1, FP8>(p, stream);
  else
    err = heads_per_cta == 16 ? launch_attention_mt<R, DR, 1, FP8>(p, stream)
                              : launch_attention_mt<R, DR, 2, FP8>(p, stream);
  if (err != cudaSuccess || p.num_splits == 1) return err;
  const int64_t rows = static_cast<int64_t>(p.num_tokens) * p.num_heads;
  bool wide = false;  // the wgmma kernel's splits (up to kMaxCombineSplits) take the wide combine
  if constexpr (R == 512) {
    if (heads_per_cta == 64) {
      k3::mla::combine_splits_wgmma_kernel<R><<<static_cast<unsigned>(rows), R / 4, 0, stream>>>(
          p.o_part, p.lse_part, p.a_lat, rows, p.num_splits);
      wide = true;
    }
  }
  if (!wide)
    k3::mla::combine_splits_kernel<R><<<static_cast<unsigned>(rows), R / 4, 0, stream>>>(
        p.o_part, p.lse_part, p.a_lat, rows, p.num_splits);
  return cudaGetLastError();
}

// Absorbed attention in latent space: a_lat = softmax(scale·[q_lat|q_pe]·cacheᵀ)·c_kv; over
// the fp8 cache (rows of fp8_row_bytes) when scale_group > 0, else the bf16 one.
cudaError_t latent_attention(const bf16* q_lat, const bf16* q, const int* cu_seqlens,
                             const int* context_lens, const int* block_tables, const void* cache,
                             bf16* a_lat, const Workspace& ws, const SplitPlan& plan, int num_tokens,
                             int num_seqs, int max_blocks, int block_size, int num_heads, int nope,
                             int rope, int rank, float softmax_scale, int scale_group, cudaStream_t stream) {
  k3::mla::LatentAttentionParams p{};
  p.q_lat = q_lat;
  p.q = q;
  p.cache = static_cast<const bf16*>(cache);
  p.cache8 = static_cast<const uint8_t*>(cache);
  p.scale_group = scale_group;
  p.row_bytes = scale_group > 0 ? k3::mla::fp8_row_bytes(rank, rope, scale_group) : 0;
  p.cu_seqlens = cu_seqlens;
  p.context_lens = context_lens;
  p.block_tables = block_tables;
  p.a_lat = a_lat;
  p.o_part = ws.o_part;
  p.lse_part = ws.lse_part;
  p.num_tokens = num_tokens;
  p.num_seqs = num_seqs;
  p.num_heads = num_heads;
  p.q_head_stride = nope + rope;
  p.rope_offset = nope;
  p.max_blocks = max_blocks;
  p.block_size = block_size;
  p.head_groups = plan.head_groups;
  p.num_splits = plan.num_splits;
  p.split_tokens = plan.split_tokens;
  p.scale_log2 = softmax_scale * 1.4426950408889634f;
  if (scale_group > 0)
    return rank == 512 ? launch_attention<512, 64, true>(p, plan.heads_per_cta, stream)
                       : launch_attention<64, 16, true>(p, plan.heads_per_cta, stream);
  return rank == 512 ? launch_attention<512, 64, false>(p, plan.heads_per_cta, stream)
                     : launch_attention<64, 16, false>(p, plan.heads_per_cta, stream);
}

template <bool kBStoredNK>
cudaError_t head_gemm(const k3::mla::HeadGemmParams& p, int heads, cudaStream_t stream) {
  dim3 grid((p.n + k3::mla::kGemmBN - 1) / k3::mla::kGemmBN, (p.m + k3::mla::kGemmBM - 1) / k3::mla::kGemmBM,
            heads);
  k3::mla::head_gemm_kernel<kBStoredNK><<<grid, k3::mla::kGemmThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// This step's latent rows into the cache: copied (bf16 cache) or quantised (scale_group > 0).
cudaError_t insert_latents(const void* latent, const int* slot_mapping, void* cache, int num_tokens, int rank,
                           int rope, int scale_group, cudaStream_t stream) {
  if (scale_group > 0) {
    const size_t smem = (rank / 4 + rank / scale_group) * sizeof(float);
    k3::mla::insert_latents_fp8_kernel<<<num_tokens, rank / 4, smem, stream>>>(
        static_cast<const bf16*>(latent), slot_mapping, static_cast<uint8_t*>(cache), rank, rope, scale_group);
  } else {
    k3::mla::insert_latents_kernel<<<num_tokens, 64, 0, stream>>>(static_cast<const bf16*>(latent), slot_mapping,
                                                                   static_cast<bf16*>(cache), rank + rope);
  }
  return cudaGetLastError();
}

// The absorbed form of every launcher (k3/params.h K3MlaParams, the contract's names); the
// fp8 cache's when scale_group > 0 (the K3MlaFp8Params launchers, as_bf16_params).
cudaError_t mla_forward(const K3MlaParams& p, int scale_group, cudaStream_t stream) {
  const void *q = p.q, *latent = p.latent, *w_uk = p.w_uk, *w_uv = p.w_uv;
  const int *cu_seqlens = p.cu_seqlens, *context_lens = p.context_lens, *block_tables = p.block_tables;
  const int* slot_mapping = p.slot_mapping;
  void *latent_cache = p.latent_cache, *out = p.out, *workspace = p.workspace;
  const int num_tokens = p.num_tokens, num_seqs = p.num_seqs, max_blocks = p.max_blocks, block_size = p.block_size;
  const int num_heads = p.num_heads, nope = p.qk_nope_head_dim, rope = p.qk_rope_head_dim, rank = p.kv_lora_rank;
  const int v_dim = p.v_head_dim;
  const float softmax_scale = p.softmax_scale;
  const size_t workspace_bytes = p.workspace_bytes;
  if (!supported(rank, rope, nope, v_dim) || (scale_group != 0 && !fp8_supported(rank, rope, scale_group)) ||
      num_heads <= 0 || num_seqs <= 0 || block_size <= 0 || max_blocks <= 0 || num_tokens < 0)
    return cudaErrorInvalidValue;
  if (num_tokens == 0) return cudaSuccess;
  const SplitPlan plan = plan_splits(num_tokens, num_heads, rank, max_blocks, block_size);
  const Workspace ws = carve(workspace, num_tokens, num_heads, rank, plan);
  if (workspace == nullptr || workspace_bytes < ws.bytes) return cudaErrorInvalidValue;
  const bf16* qb = static_cast<const bf16*>(q);

  cudaError_t err = insert_latents(latent, slot_mapping, latent_cache, num_tokens, rank, rope, scale_group, stream);
  if (err != cudaSuccess) return err;

  k3::mla::HeadGemmParams absorb{};
  absorb.a = qb;
  absorb.lda = static_cast<int64_t>(num_heads) * (nope + rope);
  absorb.a_head = nope + rope;
  absorb.b = static_cast<const bf16*>(w_uk);
  absorb.ldb = rank;
  absorb.b_head = static_cast<int64_t>(nope) * rank;
  absorb.c = ws.q_lat;
  absorb.ldc = static_cast<int64_t>(num_heads) * rank;
  absorb.c_head = rank;
  absorb.m = num_tokens;
  absorb.n = rank;
  absorb.k = nope;
  if ((err = head_gemm<false>(absorb, num_heads, stream)) != cudaSuccess) return err;

  err = latent_attention(ws.q_lat, qb, cu_seqlens, context_lens, block_tables, latent_cache, ws.a_lat, ws, plan,
                         num_tokens, num_seqs, max_blocks, block_size, num_heads, nope, rope, rank,
                         softmax_scale, scale_group, stream);
  if (err != cudaSuccess) return err;

  k3::mla::HeadGemmParams up{};
  up.a = ws.a_lat;
  up.lda = static_cast<int64_t>(num_heads) * rank;
  up.a_head = rank;
  up.b = static_cast<const bf16*>(w_uv);
  up.ldb = rank;
  up.b_head = static_cast<int64_t>(v_dim) * rank;
  up.c = static_cast<bf16*>(out);
  up.ldc = static_cast<int64_t>(num_heads) * v_dim;
  up.c_head = v_dim;
  up.m = num_tokens;
  up.n = v_dim;
  up.k = rank;
  return head_gemm<true>(up, num_heads, stream);
}

// ---- Expanded prefill -------------------------------------------------------------------

// Dispatch rule (host side, no device data): the expanded form when the step has at least
// this many new tokens per sequence on average. For a chunk of n new tokens after a context
// of c >> n both forms cost ~ c: the absorbed one n·c·2176 FLOP per head, the expanded one
// the expansion of all c keys (2·R·(DN+DV) = 262144 FLOP per key and head) plus attention
// over them, which few query tiles cannot spread over the GPU. So the break-even n hardly
// depends on c: measured at c = 16384 it is ~370 at both 96 and 12 heads (n = 128: expanded
// 0.4x the absorbed speed, n = 512: 1.2-1.3x; bench/NOTES_mla.md). Fresh prefills gain
// earlier (T = 2048, no context: 2.2x), so the rule is conservative there.
constexpr int kExpandedMinTokensPerSeq = 384;
// Per-pass K/V buffers are capped at this many bytes, i.e. at 10880 keys for K3 at 96
// heads and 85504 at 12: longer key ranges (100k+ contexts) take several passes, unless one
// pass needs no more workspace than the capped ones with their accumulators (plan_expanded).
constexpr size_t kPassBufferBytes = size_t{512} << 20;
constexpr int kPassKeysAlign = k3::mla::kExpandBM;
// The mma.sync flash kernel's query tiles: 256 rows (two 16-row blocks per warp: half the K/V
// fragment loads per MMA; 1.25x the 128-row kernel at T = 16384 when it ran the K3 dims,
// bench/NOTES_mla.md) while they still give every SM >= 4 items to balance; 128 rows otherwise.
constexpr int kWideItemsPerSm = 4;

bool expanded_supported(int rank, int rope, int nope, int v_dim) {
  return supported(rank, rope, nope, v_dim) &&
         ((nope == 128 && rope == 64 && v_dim == 128) || (nope == 32 && rope == 16 && v_dim == 32));
}

// Batch-invariant mode: never (the choice follows the batch's tokens per sequence, and the
// expanded form's key passes run over the whole batch's keys): the absorbed form, whose splits
// are then fixed per sequence.
bool prefer_expanded(int num_tokens, int num_seqs) {
  return g_batch_invariant.load(std::memory_order_relaxed) == 0 &&
         static_cast<int64_t>(num_tokens) >= static_cast<int64_t>(kExpandedMinTokensPerSeq) * num_seqs;
}

struct ExpandedLayout {
  int* key_offsets;
  int* tile_offsets;
  bf16* k_nope;
  bf16* v;
  bf16* k_pe;
  float* acc;      // several passes only
  float* acc_lse;  // several passes only
  bf16* flat;      // fp8 cache only: the pass's keys dequantised, [pass_keys, R+DR]
  size_t bytes;
};

ExpandedLayout carve_expanded(void* base, int num_tokens, int num_seqs, int num_heads, int nope, int rope,
                              int v_dim, int64_t pass_keys, bool several_passes, int flat_width) {
  const size_t keys = static_cast<size_t>(pass_keys);
  const size_t acc_rows = several_passes ? static_cast<size_t>(num_tokens) * num_heads : 0;
  k3::WorkspaceCarver c(base);
  ExpandedLayout l{};
  l.key_offsets = c.take<int>(static_cast<size_t>(num_seqs) + 1);
  l.tile_offsets = c.take<int>(static_cast<size_t>(num_seqs) + 1);
  l.k_nope = c.take<bf16>(keys * num_heads * nope);
  l.v = c.take<bf16>(keys * num_heads * v_dim);
  l.k_pe = c.take<bf16>(keys * rope);
  l.acc = c.take<float>(acc_rows * v_dim);
  l.acc_lse = c.take<float>(acc_rows);
  l.flat = c.take<bf16>(keys * flat_width);
  l.bytes = c.used();
  return l;
}

struct ExpandedPlan {
  bool ok;
  bool several_passes;
  int pass_keys;
  int passes;
  size_t bytes;
};

// Keys per pass and pass count for an upper bound of the step's keys, Σ_b (context_b +
// new_b) <= B · max_blocks · block_size (the host cannot read the lengths; passes past the
// real end cost one early exit per CTA). One pass if the bound fits the cap (or takes no more
// bytes than the capped passes) and the workspace; else passes of the cap (or key_chunk, for
// tests), shrunk to fit `available` bytes. flat_width: R+DR for the fp8 cache, else 0.
ExpandedPlan plan_expanded(int num_tokens, int num_seqs, int num_heads, int nope, int rope, int v_dim,
                           int max_blocks, int block_size, size_t available, int key_chunk, int flat_width) {
  ExpandedPlan plan{};
  const int64_t key_bound = static_cast<int64_t>(num_seqs) * max_blocks * block_size;
  if (key_bound > INT_MAX / 2) return plan;
  const int64_t per_key = static_cast<int64_t>(num_heads) * (nope + v_dim) * 2 + rope * 2 + flat_width * 2;
  const int64_t cap = key_chunk > 0 ? (static_cast<int64_t>(key_chunk) + kPassKeysAlign - 1) / kPassKeysAlign * kPassKeysAlign
                                    : std::max<int64_t>(kPassKeysAlign, static_cast<int64_t>(kPassBufferBytes) / per_key /
                                                                            kPassKeysAlign * kPassKeysAlign);
  const int64_t whole = (key_bound + kPassKeysAlign - 1) / kPassKeysAlign * kPassKeysAlign;
  int64_t keys = whole;
  // Past the cap, still one pass where its K/V take no more bytes than the capped passes with
  // their fp32 accumulators (fresh prefills: a key's K/V, H·(DN+DV)·2 bytes, weigh less than a
  // token's accumulator, H·(DV+1)·4); key_chunk (tests) always splits.
  const auto bytes_for = [&](int64_t pass_keys, bool passes) {
    return carve_expanded(nullptr, num_tokens, num_seqs, num_heads, nope, rope, v_dim, pass_keys, passes, flat_width)
        .bytes;
  };
  const size_t one_pass = bytes_for(whole, false);
  bool several = whole > cap && (key_chunk > 0 || one_pass > bytes_for(cap, true));
  if (!several && one_pass > available) several = true;
  if (several) {
    const size_t fixed = bytes_for(0, true);
    if (available < fixed + 3 * 256) return plan;
    const int64_t fit = static_cast<int64_t>((available - fixed - 3 * 256) / per_key) / kPassKeysAlign * kPassKeysAlign;
    keys = std::min(cap, fit);
    if (keys < kPassKeysAlign) return plan;
  }
  plan.several_passes = several;
  plan.pass_keys = static_cast<int>(keys);
  plan.passes = static_cast<int>((key_bound + keys - 1) / keys);
  plan.bytes = bytes_for(keys, several);
  plan.ok = plan.bytes <= available;
  return plan;
}

// Both flash kernels are persistent: one CTA per SM, or one per item when there are fewer.
template <typename Config>
cudaError_t launch_persistent_flash(void (*kernel)(k3::mla::FlashParams), const k3::mla::FlashParams& p,
                                    cudaStream_t stream) {
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(Config::SMEM_BYTES));
  if (err != cudaSuccess) return err;
  const int64_t items = static_cast<int64_t>(p.tile_bound) * p.num_heads;
  kernel<<<static_cast<unsigned>(std::min<int64_t>(items, sm_count())), Config::THREADS, Config::SMEM_BYTES,
           stream>>>(p);
  return cudaGetLastError();
}

template <int DN, int DR, int DV, int MB>
cudaError_t launch_flash(const k3::mla::FlashParams& p, cudaStream_t stream) {
  return launch_persistent_flash<k3::mla::FlashConfig<DN, DR, DV, MB>>(k3::mla::flash_prefill_kernel<DN, DR, DV, MB>,
                                                                       p, stream);
}

// A 2-D bf16 tensor map of `rows` rows of `cols` elements, `row_bytes` apart, read in boxes
// of 64 columns x `box_rows` into 128B-swizzled shared memory (the wgmma kernel's Q, K and V
// tiles). The encoder comes from the driver through the runtime (no libcuda link).
bool make_tile_map(CUtensorMap* map, const void* base, uint64_t cols, uint64_t rows, uint64_t row_bytes,
                   uint32_t box_rows) {
  using Encode = PFN_cuTensorMapEncodeTiled_v12000;
  static const Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<Encode>(fn);
  }();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {row_bytes};
  const cuuint32_t box[2] = {64, box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

cudaError_t launch_flash_wgmma(const k3::mla::FlashParams& p, int num_tokens, cudaStream_t stream) {
  using C = k3::mla::FlashWgmmaConfig;
  if (num_tokens == 0) return cudaSuccess;  // no query tile (and no tensor map of 0 rows)
  CUtensorMap kn{}, kpe{}, v{}, q{};
  const uint64_t keys = static_cast<uint64_t>(p.pass_keys), heads = static_cast<uint64_t>(p.num_heads);
  if (!make_tile_map(&kn, p.k_nope, heads * C::DN, keys, heads * C::DN * sizeof(bf16), C::BN) ||
      !make_tile_map(&kpe, p.k_pe, C::DR, keys, C::DR * sizeof(bf16), C::BN) ||
      !make_tile_map(&v, p.v, heads * C::DV, keys, heads * C::DV * sizeof(bf16), C::BN) ||
      !make_tile_map(&q, p.q, heads * C::DQK, static_cast<uint64_t>(num_tokens), heads * C::DQK * sizeof(bf16), 64))
    return cudaErrorNotSupported;
  cudaError_t err = cudaFuncSetAttribute(k3::mla::flash_prefill_wgmma_kernel,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(C::SMEM_BYTES));
  if (err != cudaSuccess) return err;
  const int64_t items = static_cast<int64_t>(p.tile_bound) * p.num_heads;
  k3::mla::flash_prefill_wgmma_kernel<<<static_cast<unsigned>(std::min<int64_t>(items, sm_count())), C::THREADS,
                                        C::SMEM_BYTES, stream>>>(p, kn, kpe, v, q);
  return cudaGetLastError();
}

// The expanded prefill of `plan` (k3/params.h K3MlaParams, the contract's names); over the
// fp8 cache when scale_group > 0 (plan made with flat_width R+DR).
cudaError_t expanded_forward(const K3MlaParams& p, int scale_group, const ExpandedPlan& plan, cudaStream_t stream) {
  const bf16 *q = static_cast<const bf16*>(p.q), *latent = static_cast<const bf16*>(p.latent);
  const bf16 *w_uk = static_cast<const bf16*>(p.w_uk), *w_uv = static_cast<const bf16*>(p.w_uv);
  const int *cu_seqlens = p.cu_seqlens, *context_lens = p.context_lens, *block_tables = p.block_tables;
  const int* slot_mapping = p.slot_mapping;
  bf16* out = static_cast<bf16*>(p.out);
  const int num_tokens = p.num_tokens, num_seqs = p.num_seqs, max_blocks = p.max_blocks, block_size = p.block_size;
  const int num_heads = p.num_heads, nope = p.qk_nope_head_dim, rope = p.qk_rope_head_dim, rank = p.kv_lora_rank;
  const int v_dim = p.v_head_dim;
  const float softmax_scale = p.softmax_scale;
  void* workspace = p.workspace;
  const bool fp8 = scale_group > 0;
  const ExpandedLayout l = carve_expanded(workspace, num_tokens, num_seqs, num_heads, nope, rope, v_dim,
                                          plan.pass_keys, plan.several_passes, fp8 ? rank + rope : 0);
  const int wide_rows = k3::mla::FlashConfig<32, 16, 32, 2>::BM;
  const bool wide = static_cast<int64_t>((num_tokens + wide_rows - 1) / wide_rows + num_seqs) * num_heads >=
                    static_cast<int64_t>(kWideItemsPerSm) * sm_count();
  // The wgmma kernel for the K3 dims (whole expanded prefill 1.2-1.5x faster than with the
  // mma.sync kernel, bench/NOTES_mla.md session 13); the mma.sync kernel for the tiny dims
  // (32, 16, 32), the only others expanded_supported() lets in.
  const bool wgmma = nope == k3::mla::FlashWgmmaConfig::DN;
  const int tile_rows = wgmma ? k3::mla::FlashWgmmaConfig::BM
                              : wide ? wide_rows : k3::mla::FlashConfig<32, 16, 32, 1>::BM;
  cudaError_t err = insert_latents(latent, slot_mapping, p.latent_cache, num_tokens, rank, rope, scale_group, stream);
  if (err != cudaSuccess) return err;
  k3::mla::prefill_offsets_kernel<<<1, 256, 0, stream>>>(cu_seqlens, context_lens, num_seqs, tile_rows,
                                                         l.key_offsets, l.tile_offsets);
  const int64_t rows = static_cast<int64_t>(num_tokens) * num_heads;
  if (plan.several_passes)
    k3::mla::fill_neg_inf_kernel<<<static_cast<unsigned>(std::min<int64_t>((rows + 255) / 256, 4096)), 256, 0,
                                   stream>>>(l.acc_lse, rows);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  err = cudaFuncSetAttribute(k3::mla::expand_latents_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(k3::mla::kExpandSmemBytes));
  if (err != cudaSuccess) return err;

  k3::mla::ExpandParams e{};
  e.cache = fp8 ? nullptr : static_cast<const bf16*>(p.latent_cache);
  e.flat = fp8 ? l.flat : nullptr;
  e.block_tables = block_tables;
  e.key_offsets = l.key_offsets;
  e.w_uk = w_uk;
  e.w_uv = w_uv;
  e.k_nope = l.k_nope;
  e.v = l.v;
  e.k_pe = l.k_pe;
  e.num_seqs = num_seqs;
  e.max_blocks = max_blocks;
  e.block_size = block_size;
  e.n_k = num_heads * nope;
  e.n_v = num_heads * v_dim;
  e.rank = rank;
  e.rope = rope;
  e.pass_keys = plan.pass_keys;
  const int64_t expand_items = static_cast<int64_t>(plan.pass_keys / k3::mla::kExpandBM) *
                               ((e.n_k + k3::mla::kExpandBN - 1) / k3::mla::kExpandBN +
                                (e.n_v + k3::mla::kExpandBN - 1) / k3::mla::kExpandBN);
  const unsigned expand_grid = static_cast<unsigned>(std::min<int64_t>(expand_items, 2 * sm_count()));

  k3::mla::FlashParams f{};
  f.q = q;
  f.k_nope = l.k_nope;
  f.k_pe = l.k_pe;
  f.v = l.v;
  f.cu_seqlens = cu_seqlens;
  f.context_lens = context_lens;
  f.key_offsets = l.key_offsets;
  f.tile_offsets = l.tile_offsets;
  f.out = out;
  f.acc = plan.several_passes ? l.acc : nullptr;
  f.acc_lse = plan.several_passes ? l.acc_lse : nullptr;
  f.num_seqs = num_seqs;
  f.num_heads = num_heads;
  f.tile_bound = (num_tokens + tile_rows - 1) / tile_rows + num_seqs;
  f.pass_keys = plan.pass_keys;
  f.scale_log2 = softmax_scale * 1.4426950408889634f;

  k3::mla::DequantPassParams d{};
  d.cache = static_cast<const uint8_t*>(p.latent_cache);
  d.block_tables = block_tables;
  d.key_offsets = l.key_offsets;
  d.flat = l.flat;
  d.num_seqs = num_seqs;
  d.max_blocks = max_blocks;
  d.block_size = block_size;
  d.rank = rank;
  d.rope = rope;
  d.scale_group = scale_group;
  d.pass_keys = plan.pass_keys;
  for (int pass = 0; pass < plan.passes; ++pass) {
    e.pass_begin = f.pass_begin = d.pass_begin = pass * plan.pass_keys;
    if (fp8) {  // 8 keys (warps) per block
      const int64_t blocks = std::min<int64_t>((plan.pass_keys + 7) / 8, 8 * sm_count());
      k3::mla::dequantize_pass_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(d);
      if ((err = cudaGetLastError()) != cudaSuccess) return err;
    }
    k3::mla::expand_latents_kernel<<<expand_grid, k3::mla::kExpandThreads, k3::mla::kExpandSmemBytes, stream>>>(e);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
    if (wgmma)
      err = launch_flash_wgmma(f, num_tokens, stream);
    else
      err = wide ? launch_flash<32, 16, 32, 2>(f, stream) : launch_flash<32, 16, 32, 1>(f, stream);
    if (err != cudaSuccess) return err;
  }
  if (plan.several_passes)
    k3::mla::finalize_passes_kernel<<<static_cast<unsigned>(std::min<int64_t>((rows * v_dim / 2 + 255) / 256, 8192)),
                                      256, 0, stream>>>(l.acc, out, rows * v_dim);
  return cudaGetLastError();
}

bool valid_sizes(int num_tokens, int num_seqs, int max_blocks, int block_size, int num_heads) {
  return num_heads > 0 && num_seqs > 0 && block_size > 0 && max_blocks > 0 && num_tokens >= 0;
}

// A K3MlaFp8Params call as the K3MlaParams the launchers share (the same fields in the same
// order, less scale_group, which the launchers take beside it).
K3MlaParams as_bf16_params(const K3MlaFp8Params& f) {
  K3MlaParams p{};
  p.q = f.q;
  p.latent = f.latent;
  p.w_uk = f.w_uk;
  p.w_uv = f.w_uv;
  p.cu_seqlens = f.cu_seqlens;
  p.context_lens = f.context_lens;
  p.block_tables = f.block_tables;
  p.slot_mapping = f.slot_mapping;
  p.latent_cache = f.latent_cache;
  p.out = f.out;
  p.workspace = f.workspace;
  p.workspace_bytes = f.workspace_bytes;
  p.num_tokens = f.num_tokens;
  p.num_seqs = f.num_seqs;
  p.max_blocks = f.max_blocks;
  p.block_size = f.block_size;
  p.num_heads = f.num_heads;
  p.qk_nope_head_dim = f.qk_nope_head_dim;
  p.qk_rope_head_dim = f.qk_rope_head_dim;
  p.kv_lora_rank = f.kv_lora_rank;
  p.v_head_dim = f.v_head_dim;
  p.softmax_scale = f.softmax_scale;
  p.key_chunk = f.key_chunk;
  return p;
}

// flat_width: R+DR for the fp8 cache (the expanded form's dequantised pass rows), else 0.
int uses_expanded(int num_tokens, int num_seqs, int num_heads, int nope, int rope, int rank, int v_dim,
                  int max_blocks, int block_size, size_t workspace_bytes, int flat_width) {
  if (!valid_sizes(num_tokens, num_seqs, max_blocks, block_size, num_heads) || num_tokens == 0 ||
      !expanded_supported(rank, rope, nope, v_dim) || !prefer_expanded(num_tokens, num_seqs))
    return 0;
  return plan_expanded(num_tokens, num_seqs, num_heads, nope, rope, v_dim, max_blocks, block_size, workspace_bytes, 0,
                       flat_width)
      .ok;
}

size_t decode_workspace_size(int num_tokens, int num_heads, int rank, int max_blocks, int block_size) {
  if (num_tokens <= 0 || num_heads <= 0 || max_blocks <= 0 || block_size <= 0) return 0;
  const SplitPlan plan = plan_splits(num_tokens, num_heads, rank, max_blocks, block_size);
  return carve(nullptr, num_tokens, num_heads, rank, plan).bytes;
}

size_t prefill_workspace_size(int num_tokens, int num_seqs, int num_heads, int nope, int rope, int rank, int v_dim,
                              int max_blocks, int block_size, int flat_width) {
  if (uses_expanded(num_tokens, num_seqs, num_heads, nope, rope, rank, v_dim, max_blocks, block_size, SIZE_MAX,
                    flat_width))
    return plan_expanded(num_tokens, num_seqs, num_heads, nope, rope, v_dim, max_blocks, block_size, SIZE_MAX, 0,
                         flat_width)
        .bytes;
  return decode_workspace_size(num_tokens, num_heads, rank, max_blocks, block_size);
}

size_t expanded_workspace_size(int num_tokens, int num_seqs, int num_heads, int nope, int rope, int rank, int v_dim,
                               int max_blocks, int block_size, int key_chunk, int flat_width) {
  if (!valid_sizes(num_tokens, num_seqs, max_blocks, block_size, num_heads) ||
      !expanded_supported(rank, rope, nope, v_dim))
    return 0;
  const ExpandedPlan plan = plan_expanded(num_tokens, num_seqs, num_heads, nope, rope, v_dim, max_blocks, block_size,
                                          SIZE_MAX, key_chunk, flat_width);
  return plan.ok ? plan.bytes : 0;
}

// The expanded form where uses_expanded says so, else the absorbed one.
int prefill(const K3MlaParams& p, int scale_group, cudaStream_t stream) {
  const int flat_width = scale_group > 0 ? p.kv_lora_rank + p.qk_rope_head_dim : 0;
  if (scale_group != 0 && !fp8_supported(p.kv_lora_rank, p.qk_rope_head_dim, scale_group))
    return cudaErrorInvalidValue;
  if (p.workspace != nullptr && p.num_tokens > 0 &&
      uses_expanded(p.num_tokens, p.num_seqs, p.num_heads, p.qk_nope_head_dim, p.qk_rope_head_dim, p.kv_lora_rank,
                    p.v_head_dim, p.max_blocks, p.block_size, p.workspace_bytes, flat_width)) {
    const ExpandedPlan plan = plan_expanded(p.num_tokens, p.num_seqs, p.num_heads, p.qk_nope_head_dim,
                                            p.qk_rope_head_dim, p.v_head_dim, p.max_blocks, p.block_size,
                                            p.workspace_bytes, 0, flat_width);
    return expanded_forward(p, scale_group, plan, stream);
  }
  return mla_forward(p, scale_group, stream);
}

int prefill_expanded(const K3MlaParams& p, int scale_group, cudaStream_t stream) {
  if (!valid_sizes(p.num_tokens, p.num_seqs, p.max_blocks, p.block_size, p.num_heads) ||
      !expanded_supported(p.kv_lora_rank, p.qk_rope_head_dim, p.qk_nope_head_dim, p.v_head_dim) ||
      (scale_group != 0 && !fp8_supported(p.kv_lora_rank, p.qk_rope_head_dim, scale_group)))
    return cudaErrorInvalidValue;
  if (p.num_tokens == 0) return cudaSuccess;
  const ExpandedPlan plan = plan_expanded(p.num_tokens, p.num_seqs, p.num_heads, p.qk_nope_head_dim,
                                          p.qk_rope_head_dim, p.v_head_dim, p.max_blocks, p.block_size,
                                          p.workspace_bytes, p.key_chunk,
                                          scale_group > 0 ? p.kv_lora_rank + p.qk_rope_head_dim : 0);
  if (p.workspace == nullptr || !plan.ok) return cudaErrorInvalidValue;
  return expanded_forward(p, scale_group, plan, stream);
}

int latent_attention_entry(const void* q_lat, const void* q, const int* cu_seqlens, const int* context_lens,
                           const int* block_tables, const void* latent_cache, void* a_lat, int num_tokens,
                           int num_seqs, int max_blocks, int block_size, int num_heads, int nope, int rope, int rank,
                           float softmax_scale, int scale_group, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream) {
  if (!supported(rank, rope, nope, 8) || (scale_group != 0 && !fp8_supported(rank, rope, scale_group)) ||
      num_heads <= 0 || num_seqs <= 0 || block_size <= 0 || max_blocks <= 0 || num_tokens < 0)
    return cudaErrorInvalidValue;
  if (num_tokens == 0) return cudaSuccess;
  const SplitPlan plan = plan_splits(num_tokens, num_heads, rank, max_blocks, block_size);
  const Workspace ws = carve(workspace, num_tokens, num_heads, rank, plan);
  if (workspace == nullptr || workspace_bytes < ws.bytes) return cudaErrorInvalidValue;
  return latent_attention(static_cast<const bf16*>(q_lat), static_cast<const bf16*>(q), cu_seqlens, context_lens,
                          block_tables, latent_cache, static_cast<bf16*>(a_lat), ws, plan, num_tokens, num_seqs,
                          max_blocks, block_size, num_heads, nope, rope, rank, softmax_scale, scale_group, stream);
}

// The fp8 launchers need a positive scale_group: 0 would read the byte cache as bf16.
bool fp8_call_ok(const K3MlaFp8Params* p) { return p != nullptr && p->scale_group > 0; }

}  // namespace

extern "C" {

void k3_mla_set_batch_invariant(int enabled) { g_batch_invariant.store(enabled != 0, std::memory_order_relaxed); }

// Workspace bytes of k3_mla_decode[_fp8], and enough for k3_mla_prefill[_fp8] too (the
// expanded form fits its key passes into whatever it is given).
size_t k3_mla_workspace_size(int num_tokens, int num_heads, int kv_lora_rank, int max_blocks, int block_size) {
  return decode_workspace_size(num_tokens, num_heads, kv_lora_rank, max_blocks, block_size);
}

// The absorbed form.
int k3_mla_decode(const K3MlaParams* p, cudaStream_t stream) {
  return p == nullptr ? cudaErrorInvalidValue : mla_forward(*p, 0, stream);
}

int k3_mla_decode_fp8(const K3MlaFp8Params* p, cudaStream_t stream) {
  return fp8_call_ok(p) ? mla_forward(as_bf16_params(*p), p->scale_group, stream) : cudaErrorInvalidValue;
}

int k3_mla_prefill(const K3MlaParams* p, cudaStream_t stream) {
  return p == nullptr ? cudaErrorInvalidValue : prefill(*p, 0, stream);
}

int k3_mla_prefill_fp8(const K3MlaFp8Params* p, cudaStream_t stream) {
  return fp8_call_ok(p) ? prefill(as_bf16_params(*p), p->scale_group, stream) : cudaErrorInvalidValue;
}

int k3_mla_prefill_uses_expanded(int num_tokens, int num_seqs, int num_heads, int qk_nope_head_dim,
                                 int qk_rope_head_dim, int kv_lora_rank, int v_head_dim, int max_blocks,
                                 int block_size, size_t workspace_bytes) {
  return uses_expanded(num_tokens, num_seqs, num_heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank, v_head_dim,
                       max_blocks, block_size, workspace_bytes, 0);
}

int k3_mla_prefill_fp8_uses_expanded(int num_tokens, int num_seqs, int num_heads, int qk_nope_head_dim,
                                     int qk_rope_head_dim, int kv_lora_rank, int v_head_dim, int max_blocks,
                                     int block_size, size_t workspace_bytes) {
  return uses_expanded(num_tokens, num_seqs, num_heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank, v_head_dim,
                       max_blocks, block_size, workspace_bytes, kv_lora_rank + qk_rope_head_dim);
}

size_t k3_mla_prefill_workspace_size(int num_tokens, int num_seqs, int num_heads, int qk_nope_head_dim,
                                     int qk_rope_head_dim, int kv_lora_rank, int v_head_dim, int max_blocks,
                                     int block_size) {
  return prefill_workspace_size(num_tokens, num_seqs, num_heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank,
                                v_head_dim, max_blocks, block_size, 0);
}

size_t k3_mla_prefill_fp8_workspace_size(int num_tokens, int num_seqs, int num_heads, int qk_nope_head_dim,
                                         int qk_rope_head_dim, int kv_lora_rank, int v_head_dim, int max_blocks,
                                         int block_size) {
  return prefill_workspace_size(num_tokens, num_seqs, num_heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank,
                                v_head_dim, max_blocks, block_size, kv_lora_rank + qk_rope_head_dim);
}

size_t k3_mla_prefill_expanded_workspace_size(int num_tokens, int num_seqs, int num_heads, int qk_nope_head_dim,
                                              int qk_rope_head_dim, int kv_lora_rank, int v_head_dim,
                                              int max_blocks, int block_size, int key_chunk) {
  return expanded_workspace_size(num_tokens, num_seqs, num_heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank,
                                 v_head_dim, max_blocks, block_size, key_chunk, 0);
}

size_t k3_mla_prefill_expanded_fp8_workspace_size(int num_tokens, int num_seqs, int num_heads, int qk_nope_head_dim,
                                                  int qk_rope_head_dim, int kv_lora_rank, int v_head_dim,
                                                  int max_blocks, int block_size, int key_chunk) {
  return expanded_workspace_size(num_tokens, num_seqs, num_heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank,
                                 v_head_dim, max_blocks, block_size, key_chunk, kv_lora_rank + qk_rope_head_dim);
}

int k3_mla_prefill_expanded(const K3MlaParams* p, cudaStream_t stream) {
  return p == nullptr ? cudaErrorInvalidValue : prefill_expanded(*p, 0, stream);
}

int k3_mla_prefill_expanded_fp8(const K3MlaFp8Params* p, cudaStream_t stream) {
  return fp8_call_ok(p) ? prefill_expanded(as_bf16_params(*p), p->scale_group, stream) : cudaErrorInvalidValue;
}

// The attention part alone (FlashMLA's scope), for benchmarks and callers that do the W_UK /
// W_UV products themselves: a_lat [T,H,R] from q_lat [T,H,R] and q_pe = q[:, :, nope:].
int k3_mla_latent_attention(const void* q_lat, const void* q, const int* cu_seqlens, const int* context_lens,
                            const int* block_tables, const void* latent_cache, void* a_lat, int num_tokens,
                            int num_seqs, int max_blocks, int block_size, int num_heads, int qk_nope_head_dim,
                            int qk_rope_head_dim, int kv_lora_rank, float softmax_scale, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream) {
  return latent_attention_entry(q_lat, q, cu_seqlens, context_lens, block_tables, latent_cache, a_lat, num_tokens,
                                num_seqs, max_blocks, block_size, num_heads, qk_nope_head_dim, qk_rope_head_dim,
                                kv_lora_rank, softmax_scale, 0, workspace, workspace_bytes, stream);
}

int k3_mla_latent_attention_fp8(const void* q_lat, const void* q, const int* cu_seqlens, const int* context_lens,
                                const int* block_tables, const void* latent_cache, void* a_lat, int num_tokens,
                                int num_seqs, int max_blocks, int block_size, int num_heads, int qk_nope_head_dim,
                                int qk_rope_head_dim, int kv_lora_rank, float softmax_scale, int scale_group,
                                void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (scale_group <= 0) return cudaErrorInvalidValue;
  return latent_attention_entry(q_lat, q, cu_seqlens, context_lens, block_tables, latent_cache, a_lat, num_tokens,
                                num_seqs, max_blocks, block_size, num_heads, qk_nope_head_dim, qk_rope_head_dim,
                                kv_lora_rank, softmax_scale, scale_group, workspace, workspace_bytes, stream);
}

}  // extern "C"
