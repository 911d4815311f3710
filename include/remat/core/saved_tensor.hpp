#pragma once
// SavedTensor: what a node keeps for its backward. Type-erased (one node can keep float data and
// int64 indices), counted in the allocator's saved-for-backward books while held, and versioned
// so an in-place write between forward and backward is an error instead of a wrong gradient.

#include <cstdint>
#include <memory>

#include "remat/core/error.hpp"
#include "remat/core/memory.hpp"
#include "remat/core/tensor.hpp"

namespace remat::detail {

/// A tensor a node keeps for its backward, type-erased so one node can keep float data and int64
/// indices. The version taken at save time catches in-place writes made before backward.
class SavedTensor {
 public:
  template <class U>
  SavedTensor(const BasicTensor<U>& t)  // NOLINT: implicit, so ops write {y, indices}
      : storage_(t.storage()), shape_(t.shape()), version_(t.storage()->version()),
        dtype_(detail::dtype_name<U>()) {}
  explicit SavedTensor(const TensorRef& r)
      : storage_(r.storage), shape_(r.shape), version_(r.storage->version()), dtype_(r.dtype) {}

  /// The tensor, checked: not freed, not written in place since it was saved, of element type U.
  template <class U>
  BasicTensor<U> get(const char* op) const {
    return BasicTensor<U>::from_ref(ref(op), op);
  }
  /// The tensor as a type-erased reference, with the same checks.
  TensorRef ref(const char* op) const {
    REMAT_CHECK(storage_ != nullptr, "{}: a saved tensor was already freed; backward through this "
                "part of the graph ran before (use retain_graph=true to run it twice)", op);
    REMAT_CHECK(storage_->version() == version_,
                "{}: a tensor of shape {} saved for backward was modified in place after it was "
                "saved (version {} now, {} when saved); its gradient would be wrong",
                op, shape_, storage_->version(), version_);
    return {storage_, shape_, dtype_};
  }
  const Shape& shape() const { return shape_; }
  const char* dtype() const { return dtype_; }
  const detail::Storage* storage() const { return storage_.get(); }
  const std::shared_ptr<detail::Storage>& shared_storage() const { return storage_; }
  std::uint64_t version() const { return version_; }
  std::size_t bytes() const { return storage_ ? storage_->bytes() : 0; }

  void retain() { storage_->retain_saved(); }
  void release() {
    if (!storage_) return;
    storage_->release_saved();
    storage_.reset();
  }

 private:
  std::shared_ptr<detail::Storage> storage_;
  Shape shape_;
  std::uint64_t version_;
  const char* dtype_;
};

}  // namespace remat::detail
