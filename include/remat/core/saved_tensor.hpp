#pragma once
// SavedTensor: what a node keeps for its backward. Type-erased (one node can keep float data and
// int64 indices), counted in the allocator's saved-for-backward books while held, and versioned
// so an in-place write between forward and backward is an error instead of a wrong gradient.
// Under saved-tensor hooks (core/saved_tensor_hooks.hpp) a node keeps what the hooks' pack made of
// the tensor instead, and backward reads what their unpack gives back: the one seam every other way
// of keeping an activation (16-bit formats, offload, compression) goes through.

#include <any>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "remat/core/bfloat16.hpp"
#include "remat/core/error.hpp"
#include "remat/core/memory.hpp"
#include "remat/core/tensor.hpp"

namespace remat {

/// A tensor of any element type — what nodes save: float activations, int64 indices — as a
/// saved-tensor hook packs and unpacks it.
class AnyTensor {
 public:
  /// No tensor (defined() is false).
  AnyTensor() = default;
  /// `t` itself (its storage, not a copy); implicit, so a hook returns a tensor as it is.
  template <class T>
  AnyTensor(const BasicTensor<T>& t) : ref_(t.ref()) {}  // NOLINT
  /// From a type-erased reference (what op-output events carry).
  explicit AnyTensor(detail::TensorRef r) : ref_(std::move(r)) {}

  /// Whether it holds a tensor.
  bool defined() const { return ref_.defined(); }
  /// Its shape.
  const Shape& shape() const { return ref_.shape; }
  /// The element type's name ("float32", "int64", ...).
  const char* dtype() const { return ref_.dtype; }
  /// Whether the elements are T.
  template <class T>
  bool is() const {
    return ref_.dtype != nullptr && std::strcmp(ref_.dtype, detail::dtype_name<T>()) == 0;
  }
  /// The tensor as a BasicTensor<T> (the same storage); a remat::Error if the elements are not T.
  template <class T>
  BasicTensor<T> as(const char* who = "AnyTensor::as") const {
    return BasicTensor<T>::from_ref(ref_, who);
  }
  /// The bytes of its storage.
  std::size_t nbytes() const { return ref_.storage ? ref_.storage->bytes() : 0; }
  /// The type-erased reference it wraps.
  const detail::TensorRef& ref() const { return ref_; }

 private:
  detail::TensorRef ref_;
};

namespace detail {

/// The one message for a tensor saved for backward and written in place since (nodes, checkpoint
/// boundaries, a segment's outside reads, a chain's held records): `who` found it, `tensor` says
/// which, `hint` (if any) how it comes about.
inline std::string modified_in_place(std::string_view who, std::string_view tensor, std::uint64_t version_now,
                                     std::uint64_t version_saved, std::string_view hint = {}) {
  return fmt::format("{}: {} saved for backward was modified in place after it was saved (version {} now, {} when "
                     "saved); its gradient would be wrong{}{}", who, tensor, version_now, version_saved,
                     hint.empty() ? "" : " ", hint);
}

/// What a store says of a tensor it packed (print_saved_tensors, the saved-tensor report).
struct PackedState {
  std::string where;          ///< in words: "on disk at …", "in RAM", …
  std::size_t ram_bytes = 0;  ///< of its bytes, those in RAM and in remat's books now
  bool discarded = false;     ///< its bytes are freed and recomputed when backward reads it
  double rebuild_flops = 0;   ///< what that recomputation costs, when discarded
  /// The storage it keeps in RAM, for a store that keeps tensors there (a memory budget): such a
  /// tensor is listed as held for backward, its storage counted once however many save it.
  const Storage* storage = nullptr;
};

/// What a node keeps of a tensor that saved-tensor hooks packed: the hooks' object, and how to get
/// the tensor back (the unpack hook, wrapped so that it runs outside any graph). A store may also
/// prepare a tensor for the backward about to read it (pin: the returned handle holds it ready until
/// it goes) and say where it is (state); either may be empty.
struct PackedTensor {
  std::any value;
  std::function<AnyTensor(const std::any&)> unpack;
  std::function<std::string(const std::any&)> describe;     // may be empty
  std::function<std::shared_ptr<void>(const std::any&)> pin;  // may be empty
  std::function<PackedState(const std::any&)> state;         // may be empty
};

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
  /// The tensor as a type-erased reference, with the same checks; a packed tensor is unpacked, and
  /// one kept in 16 bits (narrow_exact) widened back to its float32 values.
  TensorRef ref(const char* op) const {
    REMAT_CHECK(storage_ != nullptr || packed_ != nullptr, "{}: a saved tensor was already freed; backward through "
                "this part of the graph ran before (use retain_graph=true to run it twice)", op);
    TensorRef kept;
    if (packed_) {
      kept = unpacked(op);
    } else {
      if (widen_) {
        if (const auto original = original_.lock()) check_version(op, *original);
      } else {
        check_version(op, *storage_);
      }
      kept = {storage_, shape_, dtype_};
    }
    return widen_ ? widened(kept) : kept;
  }
  /// Keeps a float32 tensor whose values are bfloat16 values (Storage::bfloat16_exact: a product's
  /// output under autocast) as its 16-bit copy, read back widened: half the bytes, no loss. `copy`
  /// is that copy when the caller made it already (another saved tensor of the same storage). Before
  /// pack() and retain().
  void narrow_exact(std::shared_ptr<detail::Storage> copy) {
    original_ = storage_;
    storage_ = std::move(copy);
    dtype_ = dtype_name<Eigen::bfloat16>();
    widen_ = true;
  }
  /// Whether it would be kept in 16 bits at no loss (a float32 tensor holding bfloat16 values).
  bool narrows_exactly() const {
    return !widen_ && !packed_ && storage_ && std::strcmp(dtype_, dtype_name<float>()) == 0 &&
           storage_->bfloat16_exact() && storage_->version() == version_;
  }
  /// Whether it is kept in 16 bits, read back as float32.
  bool widened_on_read() const { return widen_; }
  /// Dates the save back to version `v` of the storage, for a record made after the save itself (a
  /// chain's compactly held step): a write in between is then the in-place error. Before pack().
  void set_saved_version(std::uint64_t v) { version_ = v; }
  const Shape& shape() const { return shape_; }
  const char* dtype() const { return dtype_; }
  /// The storage the node holds: null once released, and for a tensor saved-tensor hooks packed.
  const detail::Storage* storage() const { return storage_.get(); }
  const std::shared_ptr<detail::Storage>& shared_storage() const { return storage_; }
  std::uint64_t version() const { return version_; }
  /// The bytes the node holds in RAM for it (none once released, none when packed).
  std::size_t bytes() const { return storage_ ? storage_->bytes() : 0; }
  /// Whether saved-tensor hooks hold it (packed_bytes: its storage's size when it was packed).
  bool packed() const { return packed_ != nullptr; }
  std::size_t packed_bytes() const { return packed_bytes_; }
  /// Whether the node still holds it, in RAM or packed.
  bool held() const { return storage_ != nullptr || packed_ != nullptr; }
  /// Whether it is a save of `s` (kept as is, or handed to a store, or kept as a 16-bit copy of it).
  bool saves(const Storage* s) const { return s != nullptr && (storage_.get() == s || original_.lock().get() == s); }

  void retain() {
    if (storage_) storage_->retain_saved();
  }
  void release() {
    packed_.reset();
    if (!storage_) return;
    storage_->release_saved();
    storage_.reset();
  }

  /// What the store that packed it says of it ("" when it says nothing or nothing is packed).
  std::string packed_description() const {
    if (!packed_) return std::string();
    if (packed_->describe) return packed_->describe(packed_->value);
    return packed_->state ? packed_->state(packed_->value).where : std::string();
  }
  /// Where the store that packed it keeps it (a default state when it does not say).
  PackedState packed_state() const {
    return packed_ && packed_->state ? packed_->state(packed_->value) : PackedState{packed_description()};
  }
  /// Readies it for the backward about to read it: a store that recomputes or reads back brings
  /// the bytes here now, and keeps them until the returned handle goes. Null when there is nothing
  /// to do (kept in RAM by the node, or a store that does not pin).
  std::shared_ptr<void> pin() const {
    return packed_ && packed_->pin ? packed_->pin(packed_->value) : nullptr;
  }

  /// Hands the tensor to a store: from now on the node keeps `packed` (its value and the store's
  /// functions) and a weak eye on the storage, for the in-place check while it lives. Before retain().
  void pack(PackedTensor packed) {
    if (!widen_) original_ = storage_;  // a 16-bit copy's original stays the float32 tensor
    packed_bytes_ = storage_->bytes();
    packed_ = std::make_shared<PackedTensor>(std::move(packed));
    storage_.reset();
  }

 private:
  void check_version(const char* op, const Storage& s) const {
    if (s.version() != version_)
      throw Error(modified_in_place(op, fmt::format("a tensor of shape {}", shape_), s.version(), version_));
  }
  TensorRef unpacked(const char* op) const {
    const AnyTensor t = packed_->unpack(packed_->value);
    REMAT_CHECK(t.defined() && t.shape() == shape_ && t.dtype() != nullptr && std::strcmp(t.dtype(), dtype_) == 0,
                "{}: the saved-tensor hooks' unpack gave back {} for a tensor saved as shape {} ({}); unpack must "
                "return what pack was given, of the same shape and element type", op,
                t.defined() ? fmt::format("shape {} ({})", t.shape(), t.dtype() ? t.dtype() : "?") : std::string("nothing"),
                shape_, dtype_);
    // The tensor pack was given, while it lives, must not have been written in place since, as
    // without hooks: a store that copies later (offload's background writes) would otherwise keep
    // the new values, and one that copied at once would hide a write that is an error in RAM.
    if (const auto original = original_.lock()) check_version(op, *original);
    return t.ref();
  }

  /// The float32 tensor of `k`, the 16-bit copy this keeps: widened afresh (and marked exact, so a
  /// node saving it again keeps it in 16 bits too).
  static TensorRef widened(const TensorRef& k) {
    auto wide = std::make_shared<Storage>(k.storage->bytes() * 2);
    const auto* src = static_cast<const Eigen::bfloat16*>(k.storage->data());
    auto* dst = static_cast<float*>(wide->data());
    convert_elements(src, dst, static_cast<std::int64_t>(k.storage->bytes() / 2), widen_from_bfloat16);
    wide->mark_bfloat16_exact();
    return {std::move(wide), k.shape, dtype_name<float>()};
  }

  std::shared_ptr<detail::Storage> storage_;
  Shape shape_;
  std::uint64_t version_;
  const char* dtype_;
  std::shared_ptr<const PackedTensor> packed_;
  std::weak_ptr<detail::Storage> original_;
  std::size_t packed_bytes_ = 0;
  bool widen_ = false;  // kept as the 16-bit copy of a float32 tensor holding bfloat16 values
};

}  // namespace detail
}  // namespace remat
