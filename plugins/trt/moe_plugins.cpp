// enqueue of K3SituMoe / K3SituMoeMxfp4: the C-ABI launchers of plugins/kernels/moe.cu.
#include <cuda_runtime.h>

#include "k3_plugin.h"

#include "k3/moe_api.h"

namespace k3trt {

namespace {

// Contract order: x z router_weight correction_bias, then w13 w2 (bf16) or
// w13_packed w13_scale w2_packed w2_scale (MXFP4) -> out; fields num_experts top_k
// num_expert_group topk_group expert_offset scoring renormalize routed_scaling_factor
// activation situ_beta situ_linear_beta.
enum { kX, kZ, kRouterWeight, kBias, kW13, kW2 };
enum { kW13Packed = 4, kW13Scale, kW2Packed, kW2Scale };
enum { kOut };
enum { kExperts, kTopK, kGroups, kTopkGroup, kOffset, kScoring, kRenorm, kScale, kActivation, kBeta, kLinearBeta };

struct Sizes {
  int tokens, hidden, latent, inter, local_experts;
};

template <bool kMxfp4>
Sizes sizes(const Dims* in) {
  const int inter = kMxfp4 ? 2 * static_cast<int>(in[kW2Packed].d[2]) : static_cast<int>(in[kW2].d[2]);
  return Sizes{static_cast<int>(in[kX].d[0]), static_cast<int>(in[kX].d[1]), static_cast<int>(in[kZ].d[1]), inter,
               static_cast<int>(in[kW13].d[0])};
}

template <bool kMxfp4>
size_t moe_workspace(const Fields& f, const Dims* in, int) {
  const Sizes s = sizes<kMxfp4>(in);
  return k3_moe_workspace_size(s.tokens, f.ints[kExperts], f.ints[kTopK], s.local_experts, s.latent, s.inter);
}

template <bool kMxfp4>
int launch_moe(const LaunchArgs& a) {
  Dims dims[kMaxInputs];
  for (int i = 0; i < (kMxfp4 ? 8 : 6); ++i) dims[i] = a.in_desc[i].dims;
  const Sizes s = sizes<kMxfp4>(dims);
  const void* const* in = a.inputs;
  const Fields& f = a.fields;
  const auto* rw = static_cast<const float*>(in[kRouterWeight]);
  const auto* bias = static_cast<const float*>(in[kBias]);
  if (kMxfp4) {
    return k3_situ_moe_mxfp4(in[kX], in[kZ], rw, bias, static_cast<const uint8_t*>(in[kW13Packed]),
                             static_cast<const uint8_t*>(in[kW13Scale]), static_cast<const uint8_t*>(in[kW2Packed]),
                             static_cast<const uint8_t*>(in[kW2Scale]), a.outputs[kOut], s.tokens, s.hidden,
                             s.latent, s.inter, s.local_experts, f.ints[kExperts], f.ints[kTopK], f.ints[kGroups],
                             f.ints[kTopkGroup], f.ints[kOffset], f.ints[kScoring], f.ints[kRenorm],
                             f.floats[kScale], f.ints[kActivation], f.floats[kBeta], f.floats[kLinearBeta],
                             a.workspace, a.workspace_bytes, a.stream);
  }
  return k3_situ_moe(in[kX], in[kZ], rw, bias, in[kW13], in[kW2], a.outputs[kOut], s.tokens, s.hidden, s.latent,
                     s.inter, s.local_experts, f.ints[kExperts], f.ints[kTopK], f.ints[kGroups], f.ints[kTopkGroup],
                     f.ints[kOffset], f.ints[kScoring], f.ints[kRenorm], f.floats[kScale], f.ints[kActivation],
                     f.floats[kBeta], f.floats[kLinearBeta], a.workspace, a.workspace_bytes, a.stream);
}

}  // namespace

const OpKernels kSituMoeKernels{moe_workspace<false>, launch_moe<false>};
const OpKernels kSituMoeMxfp4Kernels{moe_workspace<true>, launch_moe<true>};

}  // namespace k3trt
