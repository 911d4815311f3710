#pragma once
// BasicTensor<T>: a cheap handle to shared, contiguous, row-major storage, with optional autograd
// metadata. Copies share data (as in PyTorch); ops always return new tensors.

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "remat/core/error.hpp"
#include "remat/core/memory.hpp"
#include "remat/core/shape.hpp"

/// remat: tensors with reverse-mode autodiff, the ops and factories on them, and activation
/// checkpointing (checkpoint, checkpoint_sequential, apply_checkpointing, plan).
namespace remat {

/// bfloat16: float32's sign and 8-bit exponent with a 7-bit fraction, 2 bytes; Eigen's type, so
/// Eigen arrays and maps of it work as of any scalar. Converting from float32 rounds to nearest
/// even (core/bfloat16.hpp); widening to float32 is exact.
using bfloat16 = Eigen::bfloat16;

template <class T>
class BasicTensor;

namespace detail {

template <class T>
constexpr const char* dtype_name() {
  if constexpr (std::is_same_v<T, float>) return "float32";
  else if constexpr (std::is_same_v<T, double>) return "float64";
  else if constexpr (std::is_same_v<T, std::int64_t>) return "int64";
  else if constexpr (std::is_same_v<T, bool>) return "bool";
  else if constexpr (std::is_same_v<T, bfloat16>) return "bfloat16";
  else return "unknown";
}

/// Whether tensors of element type T compute and carry gradients: float32, float64 and bfloat16
/// (integer and bool tensors are indices and masks).
template <class T>
inline constexpr bool is_floating_dtype = std::is_floating_point_v<T> || std::is_same_v<T, bfloat16>;

/// A tensor with its element type erased: what the op-output hook and saved-tensor lists hold.
struct TensorRef {
  std::shared_ptr<Storage> storage;
  Shape shape;
  const char* dtype = nullptr;
  bool defined() const { return storage != nullptr; }
};

/// Autograd state of one tensor. Nodes hold it strongly for their inputs and weakly for their
/// outputs, so the tape never keeps an activation's data alive unless it saved it.
template <class T>
struct AutogradMeta : std::enable_shared_from_this<AutogradMeta<T>> {
  bool requires_grad = false;
  bool retains_grad = false;  ///< keep .grad on a non-leaf (leaves always keep it)
  std::uint64_t node_id = 0;  ///< the node that produced this tensor; 0 for a leaf
  bool history_freed = false; ///< its node ran without retain_graph, or its tape was reset
  /// A leaf's .grad; on a non-leaf, the gradient flowing to its node in the backward under way.
  BasicTensor<T> grad;
  /// A non-leaf's .grad under retain_grad(): what its node received, summed over backwards. Apart
  /// from `grad`, so that a second backward does not send the first one's gradient on again.
  BasicTensor<T> retained;
  BasicTensor<T> tangent;  ///< forward mode: the direction it moves in, inside a dual level
  /// What lives exactly as long as the tensor can still receive a gradient (a user handle or a
  /// node's input edge holds this metadata): its node's state beyond what it saved, such as a
  /// chain's snapshots, which may be files on disk.
  std::shared_ptr<const void> keeps;
  /// Forward mode's books, kept by nodes recorded inside a dual level (core/tangent.hpp): the nodes
  /// holding it as an input, and those (holders, or its producer) whose backward may read its
  /// tangent. A tangent with holders only and no reader is dropped (marked here) before backward.
  int tangent_holders = 0;
  int tangent_readers = 0;
  bool tangent_dropped = false;
  bool is_leaf() const { return node_id == 0; }
};

}  // namespace detail

/// A tensor of element type T (float for Tensor, std::int64_t for LongTensor): a cheap handle to
/// shared, contiguous, row-major storage with optional autograd metadata. Copies share data, as in
/// PyTorch; ops return new tensors.
template <class T>
class BasicTensor {
 public:
  /// The element type.
  using Scalar = T;

  BasicTensor() = default;  ///< an undefined tensor (no storage), like a default at::Tensor
  /// Uninitialised storage of the given shape; factories (zeros, ones, ...) are what users call.
  explicit BasicTensor(const Shape& shape)
      : storage_(std::make_shared<detail::Storage>(static_cast<std::size_t>(shape.numel()) * sizeof(T))),
        shape_(shape) {}
  /// A tensor over existing storage (views, restored saved tensors).
  BasicTensor(std::shared_ptr<detail::Storage> storage, const Shape& shape)
      : storage_(std::move(storage)), shape_(shape) {
    REMAT_ASSERT(!storage_ || storage_->bytes() >= static_cast<std::size_t>(shape.numel()) * sizeof(T));
  }

  /// Whether it refers to storage (a default-constructed tensor does not).
  bool defined() const { return storage_ != nullptr; }
  /// The sizes, rank 0 to 4.
  const Shape& shape() const { return shape_; }
  /// The rank (number of dims).
  int dim() const { return shape_.rank(); }
  /// The size of dim d; negative d counts from the end.
  std::int64_t size(std::int64_t d) const { return shape_[shape_.dim(d, "size")]; }
  /// The number of elements.
  std::int64_t numel() const { return shape_.numel(); }
  /// The bytes its elements take: numel() * sizeof(T).
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * sizeof(T); }
  /// The element type's name ("float32", ...), as in safetensors.
  static constexpr const char* dtype() { return detail::dtype_name<T>(); }

  /// Read-only access to the elements (row-major); throws if undefined.
  const T* data() const { return static_cast<const T*>(checked_storage().data()); }
  /// Mutable access counts as an in-place write: a tensor saved for backward and then written
  /// through here makes that backward throw instead of returning a wrong gradient.
  T* data() {
    checked_storage().bump_version();
    return static_cast<T*>(storage_->data());
  }
  /// The const data() on a non-const tensor: a read that does not count as a write.
  const T* cdata() const { return data(); }

  /// Element access by full index, bounds-checked.
  const T& at(std::initializer_list<std::int64_t> index) const { return data()[offset(index)]; }
  /// Mutable element access by full index, bounds-checked (counts as a write, like data()).
  T& at(std::initializer_list<std::int64_t> index) { return data()[offset(index)]; }
  /// The value of a one-element tensor.
  T item() const {
    REMAT_CHECK(numel() == 1, "item: needs a tensor with one element, got shape {}", shape_);
    return data()[0];
  }
  /// A copy of the elements, row-major.
  std::vector<T> to_vector() const { return std::vector<T>(data(), data() + numel()); }

  // --- autograd -------------------------------------------------------------------------------
  /// Whether backward computes a gradient for it (set on leaves, inherited by op outputs).
  bool requires_grad() const { return meta_ && meta_->requires_grad; }
  /// Marks a leaf as a parameter-like tensor whose .grad backward fills.
  BasicTensor& requires_grad_(bool on = true) {
    static_assert(detail::is_floating_dtype<T>,
                  "requires_grad_: only floating-point tensors (float32, float64, bfloat16) have gradients");
    REMAT_CHECK(defined(), "requires_grad_: the tensor is undefined");
    REMAT_CHECK(is_leaf(), "requires_grad_: only leaf tensors can change requires_grad; this one was "
                "produced by an op (use detach() first)");
    if (!meta_) meta_ = std::make_shared<detail::AutogradMeta<T>>();
    meta_->requires_grad = on;
    return *this;
  }
  /// Whether it was made by the user rather than by a recorded op.
  bool is_leaf() const { return !meta_ || meta_->is_leaf(); }
  /// The accumulated gradient; undefined until a backward reaches this tensor (a non-leaf keeps
  /// one only under retain_grad()).
  BasicTensor grad() const;
  /// Drops the gradient (PyTorch's set_to_none=True): the next backward starts from nothing.
  void zero_grad() {
    if (meta_) meta_->grad = meta_->retained = BasicTensor();
  }
  /// Keeps .grad on a non-leaf after backward, for inspection.
  BasicTensor& retain_grad() {
    REMAT_CHECK(requires_grad(), "retain_grad: tensor of shape {} does not require grad", shape_);
    meta_->retains_grad = true;
    return *this;
  }
  /// Same data, cut from the graph.
  BasicTensor detach() const { return BasicTensor(storage_, shape_); }

  /// Backpropagates from this tensor. Without `gradient` the tensor must hold one element (a loss);
  /// the graph is freed as it is walked unless `retain_graph`. With `create_graph` the backward is
  /// itself recorded, so every .grad it writes can be differentiated again (the graph is then kept:
  /// create_graph implies retain_graph). Defined in core/autograd.hpp (which every op and factory
  /// header includes), so that the tensor does not include the tape.
  void backward(const BasicTensor& gradient = BasicTensor(), bool retain_graph = false, bool create_graph = false) const;
  /// backward() without a gradient (a one-element loss), keeping the graph when retain_graph.
  void backward(bool retain_graph) const { backward(BasicTensor(), retain_graph); }

  // --- internals used by ops and the tape -------------------------------------------------------
  /// The storage shared by its copies (null when undefined); for ops and the tape.
  const std::shared_ptr<detail::Storage>& storage() const { return storage_; }
  /// Its autograd metadata (null when it needs no gradient); for ops and the tape.
  const std::shared_ptr<detail::AutogradMeta<T>>& meta() const { return meta_; }
  /// Replaces its autograd metadata; for ops attaching a node to an output.
  void set_meta(std::shared_ptr<detail::AutogradMeta<T>> m) { meta_ = std::move(m); }
  /// Whether both refer to the same storage (copies, views by reshape).
  bool same_storage(const BasicTensor& o) const { return storage_ == o.storage_; }
  /// The same data as a type-erased reference (no autograd metadata).
  detail::TensorRef ref() const { return {storage_, shape_, dtype()}; }
  /// Back from a type-erased reference; `who` names the caller if the element type differs.
  static BasicTensor from_ref(const detail::TensorRef& r, const char* who) {
    REMAT_CHECK(r.dtype == nullptr || std::strcmp(r.dtype, dtype()) == 0,
                "{}: a tensor of shape {} holds {} elements, but {} was expected", who, r.shape, r.dtype, dtype());
    return BasicTensor(r.storage, r.shape);
  }

 private:
  detail::Storage& checked_storage() const {
    REMAT_CHECK(storage_ != nullptr, "tensor access: the tensor is undefined (default-constructed)");
    return *storage_;
  }
  std::int64_t offset(std::initializer_list<std::int64_t> index) const {
    REMAT_CHECK(static_cast<int>(index.size()) == dim(), "at: got {} indices for a tensor of shape {}",
                index.size(), shape_);
    std::int64_t off = 0;
    int d = 0;
    for (std::int64_t i : index) {
      REMAT_CHECK(i >= 0 && i < shape_[d], "at: index {} is out of range for dim {} of shape {}", i, d,
                  shape_);
      off = off * shape_[d] + i;
      ++d;
    }
    return off;
  }

  std::shared_ptr<detail::Storage> storage_;
  Shape shape_;
  std::shared_ptr<detail::AutogradMeta<T>> meta_;
};

using Tensor = BasicTensor<float>;          ///< what models train in
using DoubleTensor = BasicTensor<double>;   ///< what gradient checks run in
using LongTensor = BasicTensor<std::int64_t>;  ///< token ids, targets, indices
using BoolTensor = BasicTensor<bool>;       ///< masks
/// 16-bit tensors: made by to<bfloat16>(t) (differentiable, as every cast) and read back exactly by
/// to<float>(t). Ops compute on them in float32 and round their results to bfloat16 (PyTorch's CPU
/// rule: ops/detail/dtype.hpp); their gradients are bfloat16 too.
using BFloat16Tensor = BasicTensor<bfloat16>;

namespace detail {

template <class T>
using ArrayMap = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;
template <class T>
using ConstArrayMap = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;
template <class T>
using MatrixMap = Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
template <class T>
using ConstMatrixMap = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
template <class T>
using RowArrayMap = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
template <class T>
using ConstRowArrayMap = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;

/// All elements as a flat Eigen array. Maps are declared unaligned because ops also map
/// sub-ranges (rows, batches) at arbitrary offsets; whole storages are 64-byte aligned anyway.
template <class T>
ArrayMap<T> flat(BasicTensor<T>& t) { return ArrayMap<T>(t.data(), t.numel()); }
template <class T>
ConstArrayMap<T> flat(const BasicTensor<T>& t) { return ConstArrayMap<T>(t.data(), t.numel()); }

/// The tensor as a (numel/cols, cols) row-major matrix: rows are the last dim when cols = size(-1).
template <class T>
MatrixMap<T> matrix(BasicTensor<T>& t, std::int64_t cols) {
  return MatrixMap<T>(t.data(), cols ? t.numel() / cols : 0, cols);
}
template <class T>
ConstMatrixMap<T> matrix(const BasicTensor<T>& t, std::int64_t cols) {
  return ConstMatrixMap<T>(t.data(), cols ? t.numel() / cols : 0, cols);
}
template <class T>
RowArrayMap<T> rows(BasicTensor<T>& t, std::int64_t cols) {
  return RowArrayMap<T>(t.data(), cols ? t.numel() / cols : 0, cols);
}
template <class T>
ConstRowArrayMap<T> rows(const BasicTensor<T>& t, std::int64_t cols) {
  return ConstRowArrayMap<T>(t.data(), cols ? t.numel() / cols : 0, cols);
}

/// A new tensor holding a copy of `t`'s data, with no autograd history.
template <class T>
BasicTensor<T> copy_of(const BasicTensor<T>& t) {
  BasicTensor<T> out(t.shape());
  if (t.numel()) std::memcpy(out.data(), t.data(), t.nbytes());
  return out;
}

}  // namespace detail

template <class T>
BasicTensor<T> BasicTensor<T>::grad() const {
  if (!meta_) return BasicTensor();
  const detail::AutogradMeta<T>& m = *meta_;
  if (m.is_leaf()) return m.grad;
  // A non-leaf: what its node received (retain_grad), and what is on its way to the node now (a
  // backward that stopped before it, as a replay's between two tape positions does).
  if (!m.grad.defined()) return m.retained;
  if (!m.retained.defined()) return m.grad;
  BasicTensor sum = detail::copy_of(m.retained);
  detail::flat(sum) += detail::flat(m.grad);
  return sum;
}
}  // namespace remat

