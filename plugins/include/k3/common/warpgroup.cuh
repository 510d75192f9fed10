// Hopper (sm_90a) warpgroup synchronisation shared by the wgmma kernels of KDA, MLA and MoE:
// the wgmma fence / commit / wait protocol, the proxy fence that makes generic shared-memory
// writes visible to wgmma, and the register re-allocation between producer and consumer
// warpgroups. PTX ISA: "Asynchronous Warpgroup Level Matrix Multiply-Accumulate" and
// "setmaxnreg".
#pragma once

namespace k3 {

// Orders this warpgroup's register accesses before the wgmmas that follow.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most kPending committed wgmma groups are in flight; the memory clobber keeps
// the compiler from moving accumulator reads or writes across it.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Makes this thread's generic-proxy shared-memory writes (cp.async, st.shared) visible to
// the async proxy that wgmma reads through; call before the barrier that publishes them.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// A warpgroup gives up registers (producers) or takes them (consumers); every warp of the
// warpgroup must execute the same call.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

}  // namespace k3
