// Host-side layout of a kernel library's device workspace, shared by the MLA and MoE
// launchers: consecutive pieces, each rounded up to 256 bytes (every piece starts aligned for
// vector and bulk copies).
#pragma once

#include <cstddef>

namespace k3 {

// Hands out the pieces in order. With a null base it only counts bytes, so a library's size
// query and its launches share one layout.
class WorkspaceCarver {
 public:
  static constexpr size_t kAlign = 256;

  explicit WorkspaceCarver(void* base) : base_(static_cast<char*>(base)) {}

  template <typename T>
  T* take(size_t count) {
    T* piece = base_ != nullptr ? reinterpret_cast<T*>(base_ + used_) : nullptr;
    used_ += (count * sizeof(T) + kAlign - 1) / kAlign * kAlign;
    return piece;
  }
  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

}  // namespace k3
