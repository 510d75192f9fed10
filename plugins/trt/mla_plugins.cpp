// enqueue of K3MlaPrefill / K3MlaDecode: the C-ABI launchers of plugins/kernels/mla.cu.
#include <cuda_runtime.h>

#include "k3_plugin.h"

#include "k3/mla_api.h"

namespace k3trt {

namespace {

// Contract order: q latent w_uk w_uv cu_seqlens context_lens block_tables slot_mapping latent_cache
// -> out latent_cache_out; fields num_heads qk_nope_head_dim qk_rope_head_dim kv_lora_rank v_head_dim softmax_scale.
enum { kQ, kLatent, kWuk, kWuv, kCuSeqlens, kContextLens, kBlockTables, kSlotMapping, kLatentCache };
enum { kOut, kLatentCacheOut };
enum { kHeads, kNope, kRope, kRank, kVDim, kScale };

size_t mla_workspace(const Fields& f, const Dims* in, int) {
  return k3_mla_workspace_size(static_cast<int>(in[kQ].d[0]), f.ints[kHeads], f.ints[kRank],
                               static_cast<int>(in[kBlockTables].d[1]), static_cast<int>(in[kLatentCache].d[1]));
}

template <bool kPrefill>
int launch_mla(const LaunchArgs& a) {
  const Dims& q = a.in_desc[kQ].dims;
  const Dims& tables = a.in_desc[kBlockTables].dims;
  const int block_size = static_cast<int>(a.in_desc[kLatentCache].dims.d[1]);
  const void* const* in = a.inputs;
  const Fields& f = a.fields;
  auto launcher = kPrefill ? k3_mla_prefill : k3_mla_decode;
  return launcher(in[kQ], in[kLatent], in[kWuk], in[kWuv], static_cast<const int*>(in[kCuSeqlens]),
                  static_cast<const int*>(in[kContextLens]), static_cast<const int*>(in[kBlockTables]),
                  static_cast<const int*>(in[kSlotMapping]), a.outputs[kLatentCacheOut], a.outputs[kOut],
                  static_cast<int>(q.d[0]), static_cast<int>(tables.d[0]), static_cast<int>(tables.d[1]), block_size,
                  f.ints[kHeads], f.ints[kNope], f.ints[kRope], f.ints[kRank], f.ints[kVDim], f.floats[kScale],
                  a.workspace, a.workspace_bytes, a.stream);
}

}  // namespace

const OpKernels kMlaPrefillKernels{mla_workspace, launch_mla<true>};
const OpKernels kMlaDecodeKernels{mla_workspace, launch_mla<false>};

}  // namespace k3trt
