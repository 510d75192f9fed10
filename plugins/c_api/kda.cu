// C-ABI launchers of the KDA kernels (contract KDA_PREFILL / KDA_DECODE): a K3KdaParams
// (k3/params.h, generated from the contract) and the stream. They are called by the torch
// bindings (ctypes) and by the TensorRT plugins' enqueue.
// Return a cudaError_t (0 = success); cudaErrorInvalidValue for unsupported shapes.
#include <cuda_runtime.h>

#include "k3/kda_api.h"
#include "k3/kda/chunk_prepare.cuh"
#include "k3/kda/chunk_walk.cuh"
#include "k3/kda/conv_state.cuh"
#include "k3/kda/recurrent.cuh"

namespace {

using k3::kda::Params;

// The kernels' params (k3/kda/params.cuh) from the launcher's (k3/params.h).
Params make_params(const K3KdaParams& a) {
  Params p;
  p.qkv = static_cast<const __nv_bfloat16*>(a.qkv);
  p.gate = static_cast<const __nv_bfloat16*>(a.gate);
  p.beta = static_cast<const __nv_bfloat16*>(a.beta);
  p.conv_weight = a.conv_weight;
  p.A_log = a.A_log;
  p.dt_bias = a.dt_bias;
  p.cu_seqlens = a.cu_seqlens;
  p.state_slots = a.state_slots;
  p.has_initial_state = a.has_initial_state;
  p.conv_state = static_cast<__nv_bfloat16*>(a.conv_state);
  p.recurrent_state = a.recurrent_state;
  p.snapshot_offsets = a.snapshot_offsets;
  p.snapshot_rows = a.snapshot_rows;
  p.snapshot_conv = static_cast<__nv_bfloat16*>(a.snapshot_conv);
  p.snapshot_recurrent = a.snapshot_recurrent;
  p.snapshot_width = a.snapshot_width;
  p.snapshot_slots = a.snapshot_slots;
  p.out = static_cast<__nv_bfloat16*>(a.out);
  p.num_seqs = a.num_seqs;
  p.num_heads = a.num_heads;
  p.lower_bound = a.lower_bound;
  return p;
}

template <int W>
cudaError_t launch_conv_state(const Params& p, int head_dim, cudaStream_t stream) {
  const int P3 = 3 * p.num_heads * head_dim;
  dim3 grid((P3 + 255) / 256, p.num_seqs);
  k3::kda::conv_state_kernel<W><<<grid, 256, 0, stream>>>(p, P3);
  return cudaGetLastError();
}

template <int D, int W>
cudaError_t launch_recurrent(const Params& p, cudaStream_t stream) {
  dim3 grid(p.num_seqs, p.num_heads);
  k3::kda::recurrent_kernel<D, W><<<grid, k3::kda::kRecThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// Decode: the persistent pipelined kernel, one CTA per SM (fewer when there are fewer
// items). Its bulk copies need 16-byte aligned rows (and its output stores 8-byte ones);
// other base pointers (never seen from torch) take the per-item kernel.
template <int D, int W>
cudaError_t launch_decode(const Params& p, cudaStream_t stream) {
  const uintptr_t bases = reinterpret_cast<uintptr_t>(p.qkv) | reinterpret_cast<uintptr_t>(p.gate) |
                          reinterpret_cast<uintptr_t>(p.conv_state) |
                          reinterpret_cast<uintptr_t>(p.recurrent_state) |
                          reinterpret_cast<uintptr_t>(p.out);
  if (bases % 16 != 0) return launch_recurrent<D, W>(p, stream);
  auto kernel = k3::kda::decode_kernel<D, W>;
  constexpr int kSmem = k3::kda::DecodeStage<D, W>::SMEM;
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  const int items = p.num_seqs * p.num_heads;
  kernel<<<items < sms ? items : sms, k3::kda::kDecodeBlock, kSmem, stream>>>(p);
  return cudaGetLastError();
}

// Walk value tiles: 32 columns, or 16 when 32-column CTAs would fill at most half the SMs
// (few heads, long sequences: twice the CTAs on the serial chain of chunks). Operand stages:
// two (prefetch, 1 CTA/SM), or one (2 CTAs/SM) when sequences average <= 1024 tokens
// (session 13: one stage took 16 x 1024 x 12 heads from 0.645 to 0.595 ms; 1 x 4096 x 96
// heads stays with two, 1.197 vs 1.212).
template <int D, int BV, int NS>
cudaError_t launch_walk(const Params& p, const __nv_bfloat16* work, const int* starts,
                        cudaStream_t stream) {
  auto walk = k3::kda::chunk_walk_kernel<D, BV, NS>;
  constexpr size_t kSmem = k3::kda::WalkLayout<D, BV, NS>::BYTES;
  cudaError_t err = cudaFuncSetAttribute(walk, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kSmem);
  if (err != cudaSuccess) return err;
  dim3 grid(p.num_heads * (D / BV), p.num_seqs);
  walk<<<grid, k3::kda::kWalkThreads, kSmem, stream>>>(p, work, starts);
  return cudaGetLastError();
}

template <int D, int W>
cudaError_t launch_chunked(const Params& p, void* workspace, int num_tokens, cudaStream_t stream) {
  using Prep = k3::kda::PrepareLayout<D, W>;
  auto prepare = k3::kda::chunk_prepare_kernel<D, W>;
  int* starts = static_cast<int*>(workspace);
  auto* work = reinterpret_cast<__nv_bfloat16*>(static_cast<char*>(workspace) +
                                                k3::kda::chunk_table_bytes(p.num_seqs));
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(prepare, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)Prep::BYTES);
  if (err != cudaSuccess) return err;
  k3::kda::chunk_table_kernel<<<1, k3::kda::kTableThreads, 0, stream>>>(p.cu_seqlens, p.num_seqs, starts);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  dim3 pgrid(k3::kda::max_chunks(num_tokens, p.num_seqs), p.num_heads);
#ifdef K3_KDA_PREP_ONE_CTA  // measurement build: pad the shared memory to one CTA per SM
  constexpr int kPrepSmem = 200 * 1024;
  if ((err = cudaFuncSetAttribute(prepare, cudaFuncAttributeMaxDynamicSharedMemorySize, kPrepSmem)) != cudaSuccess)
    return err;
#else
  constexpr int kPrepSmem = (int)Prep::BYTES;
#endif
  prepare<<<pgrid, k3::kda::kPrepThreads, kPrepSmem, stream>>>(p, work, starts);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  // the prepare kernel has read the old conv state; the walk does not need it. The snapshots'
  // conv states may reach into it, so they go first.
  if (p.snapshot_width > 0) {
    const int P3 = 3 * p.num_heads * D;
    dim3 sgrid((P3 + 255) / 256, p.num_seqs, p.snapshot_width);
    k3::kda::conv_snapshot_kernel<W><<<sgrid, 256, 0, stream>>>(p, P3);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if ((err = launch_conv_state<W>(p, D, stream)) != cudaSuccess) return err;
  const bool narrow = 2 * p.num_seqs * p.num_heads * (D / 32) <= sms;
#ifdef K3_KDA_WALK_ONE_STAGE  // measurement build: one stage, 2 CTAs/SM at every length
  const bool short_seqs = true;
#else
  const bool short_seqs = num_tokens <= 1024 * p.num_seqs;
#endif
  if (narrow) return short_seqs ? launch_walk<D, 16, 1>(p, work, starts, stream)
                                : launch_walk<D, 16, 2>(p, work, starts, stream);
  return short_seqs ? launch_walk<D, 32, 1>(p, work, starts, stream)
                    : launch_walk<D, 32, 2>(p, work, starts, stream);
}

struct Launch {
  bool chunked;
  void* work;  // chunked prefill only
  int num_tokens;
  bool decode = false;  // token recurrence through the pipelined decode kernel
};

template <int D, int W>
cudaError_t dispatch_width(const Params& p, const Launch& l, cudaStream_t stream) {
  if (l.chunked) return launch_chunked<D, W>(p, l.work, l.num_tokens, stream);
  return l.decode ? launch_decode<D, W>(p, stream) : launch_recurrent<D, W>(p, stream);
}

template <int D>
cudaError_t dispatch_head_dim(const Params& p, int conv_width, const Launch& l, cudaStream_t stream) {
  switch (conv_width) {
    case 2: return dispatch_width<D, 2>(p, l, stream);
    case 3: return dispatch_width<D, 3>(p, l, stream);
    case 4: return dispatch_width<D, 4>(p, l, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t dispatch(const Params& p, int head_dim, int conv_width, const Launch& l,
                     cudaStream_t stream) {
  if (p.num_seqs <= 0 || p.num_heads <= 0) return cudaSuccess;
  switch (head_dim) {
    case 32: return dispatch_head_dim<32>(p, conv_width, l, stream);
    case 64: return dispatch_head_dim<64>(p, conv_width, l, stream);
    case 128: return dispatch_head_dim<128>(p, conv_width, l, stream);
    default: return cudaErrorInvalidValue;
  }
}

bool chunked_gate(float lower_bound) { return lower_bound < 0.f && lower_bound >= -10.f; }

size_t chunk_work_bytes(int head_dim) {
  switch (head_dim) {
    case 32: return k3::kda::ChunkWork<32>::BYTES;
    case 64: return k3::kda::ChunkWork<64>::BYTES;
    default: return k3::kda::ChunkWork<128>::BYTES;
  }
}

}  // namespace

extern "C" {

// Which head_dim / conv widths the kernels are built for (the bindings fall back otherwise).
int k3_kda_supported(int head_dim, int conv_width) {
  return (head_dim == 32 || head_dim == 64 || head_dim == 128) && conv_width >= 2 &&
         conv_width <= 4;
}

// Bytes of device workspace k3_kda_prefill needs (0 when it runs the token recurrence).
size_t k3_kda_prefill_workspace_bytes(int num_tokens, int num_seqs, int num_heads, int head_dim,
                                      float lower_bound) {
  if (!chunked_gate(lower_bound)) return 0;
  return k3::kda::chunk_table_bytes(num_seqs) +
         (size_t)k3::kda::max_chunks(num_tokens, num_seqs) * num_heads * chunk_work_bytes(head_dim);
}

// Chunked prefill. The factorised intra-chunk decay needs |lower_bound| <= 10; the
// softplus gate (lower_bound == 0, unbounded decay) runs the exact token recurrence.
// `a->workspace`: k3_kda_prefill_workspace_bytes(...) bytes, 16-byte aligned.
int k3_kda_prefill(const K3KdaParams* a, cudaStream_t stream) {
  if (a == nullptr) return cudaErrorInvalidValue;
  const Launch l{chunked_gate(a->lower_bound), a->workspace, a->num_tokens};
  return dispatch(make_params(*a), a->head_dim, a->conv_width, l, stream);
}

// Decode / speculative verify: token recurrence, any number of tokens per sequence.
// Same params as k3_kda_prefill; the workspace is not used (may be null); takes no snapshots
// (the snapshot fields are not read). Neither does k3_kda_prefill with the softplus gate.
int k3_kda_decode(const K3KdaParams* a, cudaStream_t stream) {
  if (a == nullptr) return cudaErrorInvalidValue;
  const Launch l{false, nullptr, a->num_tokens, true};
  return dispatch(make_params(*a), a->head_dim, a->conv_width, l, stream);
}

}  // extern "C"
