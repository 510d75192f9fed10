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

// `snapshot_verdict`: the chunk table's snapshot word for a prefill, null for a decode (no snapshots).
template <int D, int W>
cudaError_t launch_recurrent(const Params& p, const int* snapshot_verdict, cudaStream_t stream) {
  dim3 grid(p.num_seqs, p.num_heads);
  k3::kda::recurrent_kernel<D, W><<<grid, k3::kda::kRecThreads, 0, stream>>>(p, snapshot_verdict);
  return cudaGetLastError();
}

// The chunk table and the snapshot verdict (chunk.cuh), then the snapshots' conv rows: they may
// reach into the old conv state, so this runs before the kernel that overwrites it. Returns the
// verdict word's device address through `verdict`.
template <int W>
cudaError_t launch_table_and_conv_snapshots(const Params& p, int head_dim, int* table, const int** verdict,
                                            cudaStream_t stream) {
  k3::kda::chunk_table_kernel<<<1, k3::kda::kTableThreads, 0, stream>>>(p, table);
  cudaError_t err = cudaGetLastError();
  *verdict = table + p.num_seqs + 1;
  if (err != cudaSuccess || p.snapshot_width <= 0) return err;
  const int P3 = 3 * p.num_heads * head_dim;
  dim3 sgrid((P3 + 255) / 256, p.num_seqs, p.snapshot_width);
  k3::kda::conv_snapshot_kernel<W><<<sgrid, 256, 0, stream>>>(p, P3, *verdict);
  return cudaGetLastError();
}

// Softplus-gate prefill: the exact token recurrence, with the snapshots (the workspace holds
// only the chunk table).
template <int D, int W>
cudaError_t launch_recurrent_prefill(const Params& p, void* workspace, cudaStream_t stream) {
  const int* verdict = nullptr;
  cudaError_t err = launch_table_and_conv_snapshots<W>(p, D, static_cast<int*>(workspace), &verdict, stream);
  return err != cudaSuccess ? err : launch_recurrent<D, W>(p, verdict, stream);
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
  if (bases % 16 != 0) return launch_recurrent<D, W>(p, nullptr, stream);
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
// heads stays with two, 1.197 vs 1.212). G: groups of 4 warps per CTA, each on BV columns.
template <int D, int BV, int NS, int G = 1>
cudaError_t launch_walk(const Params& p, const __nv_bfloat16* work, const int* starts,
                        cudaStream_t stream) {
  auto walk = k3::kda::chunk_walk_kernel<D, BV, NS, G>;
  constexpr size_t kSmem = k3::kda::WalkLayout<D, G * BV, NS>::BYTES;
  cudaError_t err = cudaFuncSetAttribute(walk, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kSmem);
  if (err != cudaSuccess) return err;
  dim3 grid(p.num_heads * (D / (G * BV)), p.num_seqs);
  walk<<<grid, k3::kda::kWalkThreads * G, kSmem, stream>>>(p, work, starts);
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
  // the conv snapshots read the old conv state before the conv-state update below overwrites it
  const int* verdict = nullptr;
  if ((err = launch_table_and_conv_snapshots<W>(p, D, starts, &verdict, stream)) != cudaSuccess) return err;
  dim3 pgrid(k3::kda::max_chunks(num_tokens, p.num_seqs), p.num_heads);
  // Prep::BYTES lets 2 CTAs share an SM; padded to one CTA per SM the whole prefill took
  // 1.581 instead of 1.197 ms at T4096 x 96 heads (session 13, bench/NOTES_kda.md).
  prepare<<<pgrid, k3::kda::kPrepThreads, Prep::BYTES, stream>>>(p, work, starts);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  // the prepare kernel has read the old conv state; the walk does not need it
  if ((err = launch_conv_state<W>(p, D, stream)) != cudaSuccess) return err;
  const bool narrow = 2 * p.num_seqs * p.num_heads * (D / 32) <= sms;
  // one stage at every length cost 0.47 -> 0.65 ms of walk at 1 x 16384 x 12 heads (session
  // 13: one CTA per SM there, nothing overlaps its copies), hence the 1024-token bound
  const bool short_seqs = num_tokens <= 1024 * p.num_seqs;
  if (narrow) return short_seqs ? launch_walk<D, 16, 1>(p, work, starts, stream)
                                : launch_walk<D, 16, 2>(p, work, starts, stream);
  // Long sequences: 32-column CTAs as two groups of 16 columns, 8 warps on one operand copy
  // (session 17, bench/NOTES_kda.md: T16384 x 96 heads walk 1.911 ms as one 32-column group ->
  // 1.683 ms, bit-identical; the same for short sequences, one stage at 2 CTAs/SM, gained nothing).
  if (short_seqs) return launch_walk<D, 32, 1>(p, work, starts, stream);
  return launch_walk<D, 16, 2, 2>(p, work, starts, stream);
}

struct Launch {
  bool chunked;
  void* work;  // prefill only
  int num_tokens;
  bool decode = false;  // token recurrence through the pipelined decode kernel
};

template <int D, int W>
cudaError_t dispatch_width(const Params& p, const Launch& l, cudaStream_t stream) {
  if (l.chunked) return launch_chunked<D, W>(p, l.work, l.num_tokens, stream);
  return l.decode ? launch_decode<D, W>(p, stream) : launch_recurrent_prefill<D, W>(p, l.work, stream);
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

// Bytes of device workspace k3_kda_prefill needs: the chunk table (with the snapshot verdict),
// then, for the chunked form, the chunk workspaces.
size_t k3_kda_prefill_workspace_bytes(int num_tokens, int num_seqs, int num_heads, int head_dim,
                                      float lower_bound) {
  if (!chunked_gate(lower_bound)) return k3::kda::chunk_table_bytes(num_seqs);
  return k3::kda::chunk_table_bytes(num_seqs) +
         (size_t)k3::kda::max_chunks(num_tokens, num_seqs) * num_heads * chunk_work_bytes(head_dim);
}

// Byte offset in k3_kda_prefill's workspace of the snapshot verdict word: after the call
// (stream order) it holds 0, or 1 when an entry of snapshot_offsets / snapshot_rows broke the
// contract's rules, in which case the call wrote no snapshot (everything else as usual).
size_t k3_kda_prefill_snapshot_verdict_offset(int num_seqs) {
  return k3::kda::snapshot_verdict_offset(num_seqs);
}

// Prefill, with the snapshots at the checked snapshot points. The factorised intra-chunk decay
// of the chunked form needs |lower_bound| <= 10; the softplus gate (lower_bound == 0, unbounded
// decay) runs the exact token recurrence. `a->workspace`: k3_kda_prefill_workspace_bytes(...)
// bytes, 16-byte aligned.
int k3_kda_prefill(const K3KdaParams* a, cudaStream_t stream) {
  if (a == nullptr || a->workspace == nullptr) return cudaErrorInvalidValue;
  const Launch l{chunked_gate(a->lower_bound), a->workspace, a->num_tokens};
  return dispatch(make_params(*a), a->head_dim, a->conv_width, l, stream);
}

// Decode / speculative verify: token recurrence, any number of tokens per sequence.
// Same params as k3_kda_prefill; the workspace is not used (may be null); takes no snapshots
// (the snapshot fields are not read).
int k3_kda_decode(const K3KdaParams* a, cudaStream_t stream) {
  if (a == nullptr) return cudaErrorInvalidValue;
  const Launch l{false, nullptr, a->num_tokens, true};
  Params p = make_params(*a);
  p.snapshot_width = 0;
  return dispatch(p, a->head_dim, a->conv_width, l, stream);
}

}  // extern "C"
