// enqueue of K3MlaPrefill / K3MlaDecode: the C-ABI launchers of plugins/c_api/mla.cu.
#include <cuda_runtime.h>

#include "k3_plugin.h"

#include "k3/mla_api.h"

namespace k3trt {

namespace {

size_t mla_workspace(const Fields& f, const Dims* in, int) {
  K3MlaParams p{};
  set_sizes(p, in, f);
  return k3_mla_workspace_size(p.num_tokens, p.num_heads, p.kv_lora_rank, p.max_blocks, p.block_size);
}

template <bool kPrefill>
int launch_mla(const LaunchArgs& a) {
  const K3MlaParams p = launch_params<K3MlaParams>(a);
  return kPrefill ? k3_mla_prefill(&p, a.stream) : k3_mla_decode(&p, a.stream);
}

}  // namespace

const OpKernels kMlaPrefillKernels{mla_workspace, launch_mla<true>};
const OpKernels kMlaDecodeKernels{mla_workspace, launch_mla<false>};

}  // namespace k3trt
