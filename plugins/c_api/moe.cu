// SiTU latent-MoE routed part (contracts K3SituMoe / K3SituMoeMxfp4): router, permutation,
// grouped gate/up GEMM with the GLU epilogue, grouped down GEMM writing one weighted fp32
// partial row per (token, slot), the combine summing each token's slots in slot order with
// one rounding to bf16. No floating-point atomics anywhere: the same inputs give the same
// output bits on every run (the integer atomics of the permutation only reorder rows inside
// an expert, which no output bit depends on: permute.cuh). C ABI in k3/moe_api.h.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <type_traits>

#include "k3/common/workspace_carver.h"
#include "k3/moe/decode_gemm.cuh"
#include "k3/moe/decode_route.cuh"
#include "k3/moe/grouped_gemm.cuh"
#include "k3/moe/grouped_gemm_wgmma.cuh"
#include "k3/moe/router_wgmma.cuh"
#include "k3/moe/permute.cuh"
#include "k3/moe/router.cuh"
#include "k3/moe/router_mma.cuh"
#include "k3/moe_api.h"

namespace {

using namespace k3::moe;

struct Workspace {
  float* logits;
  int* topk_ids;
  float* topk_weights;
  Schedule schedule;
  __nv_bfloat16* h;
  float* part;  // [T*k, L] weighted down-GEMM rows, in sorted-row order
  size_t bytes;
};

// Carves the workspace (base == nullptr: sizes only).
Workspace carve(char* base, int T, int E, int k, int El, int L, int I) {
  k3::WorkspaceCarver c(base);
  Workspace w{};
  const size_t assignments = (size_t)T * k;
  const size_t tiles = (size_t)max_m_tiles((int)assignments, El, 8);  // the smallest tiles (decode, T <= 8)
  w.logits = c.take<float>((size_t)T * E);
  w.topk_ids = c.take<int>(assignments);
  w.topk_weights = c.take<float>(assignments);
  w.schedule.counts = c.take<int>(El);
  w.schedule.fill = c.take<int>(El);
  w.schedule.offsets = c.take<int>((size_t)El + 1);
  w.schedule.tile_expert = c.take<int>(tiles);
  w.schedule.tile_row = c.take<int>(tiles);
  w.schedule.num_tiles = c.take<int>(1);
  w.schedule.sorted_token = c.take<int>(assignments);
  w.schedule.sorted_weight = c.take<float>(assignments);
  w.schedule.slot_row = c.take<int>(assignments);
  // The decode GEMVs' split-K partials and counters (8 MiB), for every T: a workspace sized
  // for a larger T (the TensorRT plugin's maximum shape) must hold every smaller T's layout.
  w.schedule.split_count = c.take<int>(kSplitCounters + kDecodeWorkCounters);
  w.schedule.split_part = c.take<float>((size_t)kSplitItemsMax * kDecodeThreads * kSplitAccMax);
  w.h = c.take<__nv_bfloat16>(assignments * I);
  w.part = c.take<float>(assignments * L);
  w.bytes = c.used();
  return w;
}

bool routing_supported(int E, int k, int G) {
  if (E < 1 || E > kMaxExperts || k < 1 || k > E || k > kSelectThreads) return false;
  return !grouping_applies(E, G) || G <= kMaxGroups;
}

// Calls f(std::integral_constant<int, n>) with the experts per lane of the warp select.
template <typename F>
void with_experts_per_lane(int E, F f) {
  if (E <= 128) {
    f(std::integral_constant<int, 4>{});
  } else if (E <= 256) {
    f(std::integral_constant<int, 8>{});
  } else if (E <= 512) {
    f(std::integral_constant<int, 16>{});
  } else {
    f(std::integral_constant<int, 32>{});
  }
}

// Batch-invariant mode (k3_moe_set_batch_invariant): the kernels are chosen by the sizes alone,
// never by the token count, so a token's output bits do not depend on the rest of the batch.
// Read on the host at every launch (graph capture records the choice made then).
std::atomic<int> g_batch_invariant{0};
bool batch_invariant() { return g_batch_invariant.load(std::memory_order_relaxed) != 0; }

// The router GEMV for small batches (its rounding differs from the tensor-core logits' kernel).
bool gemv_logits_apply(int T, int D) { return !batch_invariant() && T <= kGemvMaxTokens && D % 4 == 0; }

// From this many tokens the small-batch logits are the tensor cores' with D split over clusters
// (router_mma.cuh), not the GEMV: H200, E = 896, D = 7168, L2 flushed (H3, session 17; us,
// split / GEMV): T = 8: 22.9 / 21.1, 16: 23.1 / 31.8, 32: 23.1 / 50.9, 64: 23.7 / 89.0.
constexpr int kGemvMmaFromTokens = 9;

cudaError_t launch_logits_gemv(const __nv_bfloat16* x, const float* w, float* logits, int T, int D, int E,
                               cudaStream_t stream) {
  const unsigned experts = (E + kGemvExperts - 1) / kGemvExperts;
  if (T >= kGemvMmaFromTokens && D % 8 == 0)
    return launch_router_logits_split<1, 4, 4, 8>(x, w, logits, T, D, E, nullptr, 0, stream);
  if (T == 1) {
    router_logits_gemv_kernel<1><<<experts, 32 * kGemvWarps, 0, stream>>>(x, w, logits, T, D, E);
  } else if (T <= 4) {
    router_logits_gemv_kernel<4><<<experts, 32 * kGemvWarps, 0, stream>>>(x, w, logits, T, D, E);
  } else {
    router_logits_gemv_kernel<8><<<dim3(experts, (T + 7) / 8), 32 * kGemvWarps, 0, stream>>>(x, w, logits, T, D, E);
  }
  return cudaSuccess;
}

// Prefill batches that take the tensor-core logits and the warp select, which then also zero
// and fill the per-expert counts (SelectExtras).
bool route_folds(int T, int D, int E, int k, int G) {
  return !gemv_logits_apply(T, D) && D % 8 == 0 && warp_select_applies(E, k, G);
}

// Router logits up to this many tokens split D over clusters of 8 CTAs (router_mma.cuh), whose
// 64 x 64 tiles then fill the GPU; above, whole-D tiles. H200, E = 896, D = 7168, L2 flushed
// (H3, session 17; us, split / whole-D): T = 128: 31 / 97, 256: 58 / 98, 512: 105 / 98,
// 1000: 216 / 176. Batch-invariant mode: whole-D tiles for every T (a token's bits must not
// depend on its batch).
constexpr int kRouterSplitMaxTokens = 384;
constexpr int kRouterWgmmaMinTokens = 2048;

// From kRouterWgmmaMinTokens tokens, E a multiple of 128 and D of 64 (K3: 896, 7168) take the
// wgmma kernel (router_wgmma.cuh), else router_mma.cuh's whole-D tiles. H200, session 20, E = 896,
// D = 7168, us, wgmma / whole-D mma.sync (bench/router_bench.py): T = 1024 179 / 153, 2048
// 183 / 302, 4096 366 / 520, 8192 726 / 1018 (up to 1024 tokens the wgmma grid is 56 CTAs or
// fewer, one per SM, each ~180 µs for its 112 k-steps).
// zero_counts / zero_n: zeroed by the tensor-core kernel (only where route_folds).
int launch_logits(const __nv_bfloat16* x, const float* w, float* logits, int T, int D, int E, int* zero_counts,
                  int zero_n, cudaStream_t stream) {
  if (gemv_logits_apply(T, D)) {
    const cudaError_t err = launch_logits_gemv(x, w, logits, T, D, E, stream);
    if (err != cudaSuccess) return err;
  } else if (D % 8 == 0 && !batch_invariant() && T <= kRouterSplitMaxTokens) {
    const cudaError_t err = launch_router_logits_split<1, 4, 4, 8>(x, w, logits, T, D, E, zero_counts, zero_n, stream);
    if (err != cudaSuccess) return err;
  } else if (!batch_invariant() && T >= kRouterWgmmaMinTokens && router_wgmma_applies(D, E)) {
    const cudaError_t err = launch_router_logits_wgmma(x, w, logits, T, D, E, zero_counts, zero_n, stream);
    if (err != cudaSuccess) return err;
  } else if (D % 8 == 0) {
    const cudaError_t err = cudaFuncSetAttribute(router_logits_mma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 kRtSmemBytes);
    if (err != cudaSuccess) return err;
    const dim3 grid((E + kRtBN - 1) / kRtBN, (T + kRtBM - 1) / kRtBM);
    router_logits_mma_kernel<<<grid, kRtThreads, kRtSmemBytes, stream>>>(x, w, logits, T, D, E, zero_counts, zero_n);
  } else {
    const dim3 grid((E + kLogitTile - 1) / kLogitTile, (T + kLogitTile - 1) / kLogitTile);
    router_logits_kernel<<<grid, 256, 0, stream>>>(x, w, logits, T, D, E);
  }
  return cudaSuccess;
}

// Sigmoid scores up to this many tokens: kSelectGroupWarps warps per token (decode_route.cuh, the
// same ids and weight bits as one warp's k serial rounds, so the choice by T changes no bit).
// H200, session 19 (moe_bench, CUDA graph, us; group / one warp per token): E = 896 T = 128:
// 7.6 / 19.4; T = 4096: 45.9 / 43.4 (E = 112: 31.1 / 21.0): past a few thousand tokens the warps
// per token already fill the GPU and the group's merge is extra work.
constexpr int kGroupSelectMaxRows = 1024;

void launch_select(const float* logits, const float* bias, int* topk_ids, float* topk_weights, int T,
                   const RouteParams& p, const SelectExtras& extras, cudaStream_t stream) {
  if (warp_select_applies(p.num_experts, p.top_k, p.num_expert_group)) {
    if (p.scoring == 0 && T <= kGroupSelectMaxRows) {
      route_select_group_kernel<<<T, kSelectGroupWarps * 32, 0, stream>>>(logits, bias, p, topk_ids, topk_weights,
                                                                         extras);
      return;
    }
    const unsigned blocks = (T + kWarpSelectWarps - 1) / kWarpSelectWarps;
    with_experts_per_lane(p.num_experts, [&](auto per_lane) {
      router_select_warp_kernel<decltype(per_lane)::value>
          <<<blocks, 32 * kWarpSelectWarps, 0, stream>>>(logits, bias, topk_ids, topk_weights, p, T, extras);
    });
  } else {
    router_select_kernel<<<T, kSelectThreads, 0, stream>>>(logits, bias, topk_ids, topk_weights, p);
  }
}

// fold: the counts / combine buffer to zero and fill on the way (only where route_folds).
int launch_route(const void* x, const float* router_weight, const float* bias, float* logits, int* topk_ids,
                 float* topk_weights, int T, int D, int E, int k, int G, int topk_group, int scoring,
                 int renormalize, float scale, cudaStream_t stream, const SelectExtras* fold = nullptr) {
  if (T <= 0) return cudaSuccess;
  if (!routing_supported(E, k, G) || D < 1 || (scoring != 0 && scoring != 1)) return cudaErrorInvalidValue;
  const int err = launch_logits(static_cast<const __nv_bfloat16*>(x), router_weight, logits, T, D, E,
                                fold != nullptr ? fold->counts : nullptr, fold != nullptr ? fold->num_local_experts : 0,
                                stream);
  if (err != cudaSuccess) return err;
  launch_select(logits, bias, topk_ids, topk_weights, T, RouteParams{E, k, G, topk_group, scoring, renormalize, scale},
                fold != nullptr ? *fold : SelectExtras{nullptr, 0, 0}, stream);
  return cudaGetLastError();
}

struct MoeArgs {
  const void *x, *z;
  const float *router_weight, *bias;
  ExpertWeights w13, w2;
  void* out;
  int T, D, L, I, El, E, k, G, topk_group, offset, scoring, renormalize;
  float scale;
  GluParams act;
  void* workspace;
  size_t workspace_bytes;
  cudaStream_t stream;
};

// The forward's view of a launcher's params (K3SituMoeParams / K3SituMoeMxfp4Params, which
// differ in the experts only).
template <class Params>
MoeArgs moe_args(const Params& p, ExpertWeights w13, ExpertWeights w2, cudaStream_t stream) {
  return MoeArgs{p.x, p.z, p.router_weight, p.correction_bias, w13, w2, p.out, p.num_tokens, p.hidden, p.latent,
                 p.inter, p.num_local_experts, p.num_experts, p.top_k, p.num_expert_group, p.topk_group,
                 p.expert_offset, p.scoring, p.renormalize, p.routed_scaling_factor,
                 GluParams{p.activation, p.situ_beta, p.situ_linear_beta}, p.workspace, p.workspace_bytes, stream};
}

// The decode chain's later kernels (select + schedule, the two GEMVs, the combine): launched
// as programmatic dependents of the kernel before them (pdl.cuh), so their CTAs are resident
// when it completes instead of being launched then (bf16 T = 1: ~3 µs of 316).
template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream, Args... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...);
}

// MXFP4: the wide slab (32 elements, 16 bytes per lane and row) for the 8-row tiles (T <= 8) of
// each GEMV whose K allows it and whose codes and scales start 16-byte aligned (its 16-byte
// loads; torch allocations are). The 16-row tiles (two n tiles) keep the narrow slab: wide
// measured 4-6% slower there at K3 sizes (bench/NOTES_moe.md, session 16).
bool decode_wide(int K, const ExpertWeights& ew) {
  const auto misaligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 != 0; };
  return decode_wide_applies(K) && !misaligned(ew.packed) && !misaligned(ew.scale);
}

// Launches decode GEMV kKernel as a programmatic dependent on one wave of CTAs (SMs x resident
// CTAs per SM on the current device), which loop over the work (decode_gemm.cuh); the wave is
// also the kernel's last argument. Cached per device: the occupancy query costs host time.
constexpr int kWaveDevices = 64;

template <auto kKernel, typename... Args>
void launch_decode_gemv(cudaStream_t stream, Args... args) {
  static std::atomic<int> waves[kWaveDevices];  // zero-initialised: not yet queried
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0) dev = 0;
  int wave = dev < kWaveDevices ? waves[dev].load(std::memory_order_relaxed) : 0;
  if (wave == 0) {
    int sms = 0, per_sm = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms < 1) sms = 1;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kDecodeThreads, 0) != cudaSuccess || per_sm < 1)
      per_sm = 1;
    wave = sms * per_sm;
    if (dev < kWaveDevices) waves[dev].store(wave, std::memory_order_relaxed);
  }
  launch_dependent(kKernel, dim3(wave), dim3(kDecodeThreads), stream, args..., wave);
}

template <bool kMxfp4, int kTiles>
void launch_decode(const MoeArgs& a, const Workspace& w) {
  constexpr int kNarrow = kMxfp4 ? 16 : 8, kWide = kMxfp4 && kTiles == 1 ? kDecodeWideElems : kNarrow;
  const auto* z = static_cast<const __nv_bfloat16*>(a.z);
  const auto* h = static_cast<const __nv_bfloat16*>(w.h);
  if (decode_wide(a.L, a.w13)) {
    launch_decode_gemv<gate_up_decode_kernel<kMxfp4, kTiles, kWide>>(a.stream, z, a.w13, w.h, w.schedule, a.L, a.I,
                                                                     a.act);
  } else {
    launch_decode_gemv<gate_up_decode_kernel<kMxfp4, kTiles, kNarrow>>(a.stream, z, a.w13, w.h, w.schedule, a.L,
                                                                       a.I, a.act);
  }
  // MXFP4 16-row tiles (T > 8): two 16-row groups per down warp where L allows (decode_gemm.cuh's
  // kRowGroups: each activation load serves twice the MMAs). H200, session 20 (moe_bench, CUDA
  // graph, us, HEAD -> groups): all-local T = 64 1138 -> 1069 (down 425 -> 365 profiled), one
  // EP8 rank's T = 32 335 -> 336, T = 128 461 -> 457.
  if constexpr (kMxfp4 && kTiles == 2) {
    if (a.L % (2 * kDecodeFeatures) == 0) {
      launch_decode_gemv<down_decode_kernel<kMxfp4, kTiles, kNarrow, 2>>(a.stream, h, a.w2, w.part, w.schedule, a.L,
                                                                         a.I);
      return;
    }
  }
  if (decode_wide(a.I, a.w2)) {
    launch_decode_gemv<down_decode_kernel<kMxfp4, kTiles, kWide>>(a.stream, h, a.w2, w.part, w.schedule, a.L, a.I);
  } else {
    launch_decode_gemv<down_decode_kernel<kMxfp4, kTiles, kNarrow>>(a.stream, h, a.w2, w.part, w.schedule, a.L, a.I);
  }
}

template <bool kMxfp4>
int moe_forward(const MoeArgs& a) {
  if (a.T < 0 || a.El < 1 || a.offset < 0 || a.offset + a.El > a.E) return cudaErrorInvalidValue;
  if (!k3_moe_supported(a.E, a.El, a.k, a.G, a.L, a.I)) return cudaErrorInvalidValue;
  if (a.D < 1 || (a.scoring != 0 && a.scoring != 1)) return cudaErrorInvalidValue;
  if (a.T == 0) return cudaSuccess;
  const Workspace w = carve(static_cast<char*>(a.workspace), a.T, a.E, a.k, a.El, a.L, a.I);
  if (a.workspace == nullptr || a.workspace_bytes < w.bytes) return cudaErrorInvalidValue;
  cudaStream_t st = a.stream;
  const int assignments = a.T * a.k;
  const Schedule& s = w.schedule;
  // Few rows per expert (at most kDecodeMaxRows on average): the weight-streaming decode GEMMs,
  // 8-row tiles when T <= 8 (no expert can get more), else 16; otherwise the tiled GEMMs, whose
  // 128-row (wgmma) or 64-row (mma.sync, sizes the wgmma tiles do not divide) tiles reuse each
  // weight tile across tokens. The average is over all E experts: an EP rank's El get about
  // T·k·El/E of the T·k assignments (2.3 rows each at K3's EP8 with T = 128, where counting
  // all assignments against El experts took the tiled GEMMs). Batch-invariant mode: the tiled
  // GEMMs for every T (their k order and epilogue differ from the decode GEMMs').
  const bool decode = !batch_invariant() && assignments <= kDecodeMaxRows * a.E;
  const bool wgmma = !decode && wgmma_tiles_fit(a.L, a.I);
  const int bm = wgmma ? kWgBM : !decode ? BM : a.T <= 8 ? 8 : 16;
  int err = cudaSuccess;
  if (gemv_logits_apply(a.T, a.D) && decode_route_applies(a.T, a.E, a.k, a.G)) {
    // Decode: the router GEMV, then one CTA selects, counts, scans and scatters: two launches
    // where the prefill path has five and a memset (three past kGroupSelectMaxTokens tokens,
    // where T CTAs select first: decode_route.cuh).
    const RouteParams p{a.E, a.k, a.G, a.topk_group, a.scoring, a.renormalize, a.scale};
    err = launch_logits_gemv(static_cast<const __nv_bfloat16*>(a.x), a.router_weight, w.logits, a.T, a.D, a.E, st);
    if (err != cudaSuccess) return err;
    const bool preselect = select_kernel_applies(a.T, a.scoring);
    if (preselect)
      launch_dependent(route_select_group_kernel, dim3(a.T), dim3(kSelectGroupWarps * 32), st,
                       static_cast<const float*>(w.logits), a.bias, p, w.topk_ids, w.topk_weights,
                       SelectExtras{nullptr, 0, 0});
    with_experts_per_lane(a.E, [&](auto per_lane) {
      launch_dependent(route_schedule_kernel<decltype(per_lane)::value>, dim3(1), dim3(kScanThreads), st,
                       static_cast<const float*>(w.logits), a.bias, p, a.T, a.offset, a.El, bm, s,
                       static_cast<const int*>(preselect ? w.topk_ids : nullptr),
                       static_cast<const float*>(preselect ? w.topk_weights : nullptr));
    });
  } else {
    const bool fold = route_folds(a.T, a.D, a.E, a.k, a.G);
    const SelectExtras extras{s.counts, a.offset, a.El};
    err = launch_route(a.x, a.router_weight, a.bias, w.logits, w.topk_ids, w.topk_weights, a.T, a.D, a.E, a.k, a.G,
                       a.topk_group, a.scoring, a.renormalize, a.scale, st, fold ? &extras : nullptr);
    if (err != cudaSuccess) return err;
    const int blocks = (assignments + 255) / 256;
    if (!fold) {
      cudaMemsetAsync(s.counts, 0, a.El * sizeof(int), st);
      count_kernel<<<blocks, 256, 0, st>>>(w.topk_ids, assignments, a.offset, a.El, s.counts);
    }
    schedule_kernel<<<1, kScanThreads, 0, st>>>(s, a.El, bm);
    scatter_kernel<<<blocks, 256, 0, st>>>(w.topk_ids, w.topk_weights, assignments, a.k, a.offset, a.El, s);
  }

  // The tiled GEMMs' grids cover the worst-case M tiles of this many assignments, not El
  // experts' worth; spare ones exit at once. The decode GEMVs run one wave that loops over the tiles.
  const int tiles = max_m_tiles(assignments, a.El, bm);
  const auto* z = static_cast<const __nv_bfloat16*>(a.z);
  if (decode) {
    if (bm == 8) {
      launch_decode<kMxfp4, 1>(a, w);
    } else {
      launch_decode<kMxfp4, 2>(a, w);
    }
  } else if (wgmma) {
    const WgParams gate_up{z, a.w13, s, a.L, a.I / (kWgBN / 2), 2 * (int64_t)a.I, a.I - kWgBN / 2, a.I, w.h, nullptr,
                           a.act};
    const WgParams down{w.h, a.w2, s, a.I, a.L / kWgBN, a.L, 0, a.L, nullptr, w.part, a.act};
    // MXFP4: the weights as the register operand, tokens on N (grouped_gemm_wgmma.cuh, RS form)
    err = kMxfp4 ? launch_routed_gemm_rs<true>(gate_up, tiles, st) : launch_routed_gemm_wgmma<true>(gate_up, tiles, st);
    if (err != cudaSuccess) return err;
    err = kMxfp4 ? launch_routed_gemm_rs<false>(down, tiles, st) : launch_routed_gemm_wgmma<false>(down, tiles, st);
    if (err != cudaSuccess) return err;
  } else {
    gate_up_kernel<kMxfp4><<<dim3(tiles, a.I / BN), kGemmThreads, 0, st>>>(z, a.w13, w.h, s, a.L, a.I, a.act);
    down_kernel<kMxfp4><<<dim3(tiles, a.L / BN), kGemmThreads, 0, st>>>(w.h, a.w2, w.part, s, a.L, a.I);
  }
  const dim3 combine_grid((unsigned)((int64_t)a.T * ((a.L / 4 + kCombineThreads - 1) / kCombineThreads)));
  auto* out = static_cast<__nv_bfloat16*>(a.out);
  if (decode) {
    launch_dependent(combine_kernel, combine_grid, dim3(kCombineThreads), st, static_cast<const float*>(w.part),
                     static_cast<const int*>(s.slot_row), out, a.L, a.k);
  } else {
    combine_kernel<<<combine_grid, kCombineThreads, 0, st>>>(w.part, s.slot_row, out, a.L, a.k);
  }
  return cudaGetLastError();
}

}  // namespace

extern "C" {

void k3_moe_set_batch_invariant(int enabled) { g_batch_invariant.store(enabled != 0, std::memory_order_relaxed); }

int k3_moe_batch_invariant(void) { return batch_invariant() ? 1 : 0; }

int k3_moe_supported(int num_experts, int num_local_experts, int top_k, int num_expert_group, int latent,
                     int inter) {
  return routing_supported(num_experts, top_k, num_expert_group) && num_local_experts >= 1 &&
         num_local_experts <= kScanThreads && latent >= BN && latent % BN == 0 && inter >= BN && inter % BN == 0;
}

size_t k3_moe_workspace_size(int num_tokens, int num_experts, int top_k, int num_local_experts, int latent,
                             int inter) {
  if (num_tokens <= 0) return 0;
  return carve(nullptr, num_tokens, num_experts, top_k, num_local_experts, latent, inter).bytes;
}

int k3_moe_route(const void* x, const float* router_weight, const float* correction_bias, float* logits,
                 int* topk_ids, float* topk_weights, int num_tokens, int hidden, int num_experts, int top_k,
                 int num_expert_group, int topk_group, int scoring, int renormalize,
                 float routed_scaling_factor, cudaStream_t stream) {
  return launch_route(x, router_weight, correction_bias, logits, topk_ids, topk_weights, num_tokens, hidden,
                      num_experts, top_k, num_expert_group, topk_group, scoring, renormalize,
                      routed_scaling_factor, stream);
}

int k3_situ_moe(const K3SituMoeParams* p, cudaStream_t stream) {
  if (p == nullptr) return cudaErrorInvalidValue;
  return moe_forward<false>(moe_args(*p, ExpertWeights{static_cast<const __nv_bfloat16*>(p->w13), nullptr, nullptr},
                                     ExpertWeights{static_cast<const __nv_bfloat16*>(p->w2), nullptr, nullptr},
                                     stream));
}

int k3_situ_moe_mxfp4(const K3SituMoeMxfp4Params* p, cudaStream_t stream) {
  if (p == nullptr) return cudaErrorInvalidValue;
  return moe_forward<true>(moe_args(*p, ExpertWeights{nullptr, p->w13_packed, p->w13_scale},
                                    ExpertWeights{nullptr, p->w2_packed, p->w2_scale}, stream));
}

}  // extern "C"
