// enqueue of K3SituMoe / K3SituMoeMxfp4: the C-ABI launchers of plugins/c_api/moe.cu.
#include <cuda_runtime.h>

#include "k3_plugin.h"

#include "k3/moe_api.h"

namespace k3trt {

namespace {

template <class Params>
size_t moe_workspace(const Fields& f, const Dims* in, int) {
  Params p{};
  set_sizes(p, in, f);
  return k3_moe_workspace_size(p.num_tokens, p.num_experts, p.top_k, p.num_local_experts, p.latent, p.inter);
}

int launch_moe(const LaunchArgs& a) {
  const K3SituMoeParams p = launch_params<K3SituMoeParams>(a);
  return k3_situ_moe(&p, a.stream);
}

int launch_moe_mxfp4(const LaunchArgs& a) {
  const K3SituMoeMxfp4Params p = launch_params<K3SituMoeMxfp4Params>(a);
  return k3_situ_moe_mxfp4(&p, a.stream);
}

}  // namespace

const OpKernels kSituMoeKernels{moe_workspace<K3SituMoeParams>, launch_moe};
const OpKernels kSituMoeMxfp4Kernels{moe_workspace<K3SituMoeMxfp4Params>, launch_moe_mxfp4};

}  // namespace k3trt
