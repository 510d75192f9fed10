// Programmatic dependent launch (sm_90) for the decode chain, whose kernels are a few µs each
// at T = 1: a kernel launched as a programmatic dependent of the one before it gets its CTAs
// resident while that one finishes; they wait in pdl_wait() until it has completed and its
// writes are visible. Both calls are no-ops in a kernel launched the ordinary way.
#pragma once

namespace k3 {
namespace moe {

// Lets the next kernel in the stream launch now; it still waits for this grid's completion.
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
// Blocks until the grids this one depends on have completed and their memory is visible.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

}  // namespace moe
}  // namespace k3
