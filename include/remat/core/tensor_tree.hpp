#pragma once
// for_each_tensor(value, f): calls f on every tensor inside a value a user might pass to or return
// from a checkpointed function — a tensor of any element type, or tuples, pairs, vectors, arrays,
// optionals, std::maps (ordered, so the order is fixed) and plain aggregates (structs with public fields and no constructors) of those,
// nested to any depth — in a fixed order. Anything else (numbers, strings, enums) holds no tensor.
// A class that is not an aggregate and holds tensors says so with a member
// `template <class F> void for_each_tensor(F&& f)` (and a const one), or checkpoint() cannot see
// them: it rejects such a type at compile time rather than silently missing its tensors.

#include <array>
#include <cstddef>
#include <functional>
#include <map>
#include <string>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "remat/core/tensor.hpp"

namespace remat::detail {

template <class T>
struct is_basic_tensor : std::false_type {};
template <class U>
struct is_basic_tensor<BasicTensor<U>> : std::true_type {};

template <class T, class = void>
struct has_member_for_each_tensor : std::false_type {};
template <class T>
struct has_member_for_each_tensor<T, std::void_t<decltype(std::declval<T&>().for_each_tensor(
                                         std::declval<void (*)(const Tensor&)>()))>> : std::true_type {};

// Aggregate field count: the largest N for which T{x1, ..., xN} compiles with xi convertible to
// anything (a field that is itself an aggregate takes one xi whole, no brace elision).
struct AnyField {
  template <class T>
  operator T() const;  // NOLINT: only ever used in unevaluated context
};
template <class T, class... A>
decltype(void(T{std::declval<A>()...}), std::true_type{}) brace_constructible(int);
template <class T, class...>
std::false_type brace_constructible(...);
template <class T, std::size_t... I>
constexpr bool constructible_with_fields(std::index_sequence<I...>) {
  return decltype(brace_constructible<T, decltype((void)I, AnyField{})...>(0))::value;
}
template <class T, std::size_t N = 12>
constexpr std::size_t aggregate_fields() {
  if constexpr (N == 0) return 0;
  else if constexpr (constructible_with_fields<T>(std::make_index_sequence<N>{})) return N;
  else return aggregate_fields<T, N - 1>();
}

template <class T>
struct is_std_container : std::false_type {};
template <class U, class A>
struct is_std_container<std::vector<U, A>> : std::true_type {};
template <class U, std::size_t N>
struct is_std_container<std::array<U, N>> : std::true_type {};

template <class T>
struct is_std_map : std::false_type {};
template <class K, class V, class C, class A>
struct is_std_map<std::map<K, V, C, A>> : std::true_type {};

template <class T>
struct is_std_tuple : std::false_type {};
template <class... U>
struct is_std_tuple<std::tuple<U...>> : std::true_type {};
template <class A, class B>
struct is_std_tuple<std::pair<A, B>> : std::true_type {};

template <class T>
struct is_std_optional : std::false_type {};
template <class U>
struct is_std_optional<std::optional<U>> : std::true_type {};

/// Types known to hold no tensor: everything that is not a class, empty and trivially copyable
/// classes, strings, callables and references (a module passed by reference: its parameters are
/// read inside the segment, where checkpoint() sees them op by op).
template <class T>
struct holds_no_tensor
    : std::bool_constant<!std::is_class_v<T> || std::is_empty_v<T> || std::is_trivially_copyable_v<T>> {};
template <class C, class Tr, class A>
struct holds_no_tensor<std::basic_string<C, Tr, A>> : std::true_type {};
template <class Sig>
struct holds_no_tensor<std::function<Sig>> : std::true_type {};
template <class U>
struct holds_no_tensor<std::reference_wrapper<U>> : std::true_type {};

/// Whether values of type T are traversed field by field (and so may hold tensors).
template <class T>
constexpr bool is_traversable_aggregate_v =
    std::is_class_v<T> && std::is_aggregate_v<T> && !is_std_container<T>::value && !is_std_tuple<T>::value;

template <class V, class F>
void for_each_tensor(V& value, F&& f);

template <class S, class F>
void for_each_field(S& s, F& f) {
  using T = std::remove_const_t<S>;
  constexpr std::size_t n = aggregate_fields<T>();
  static_assert(n <= 12, "for_each_tensor: aggregates with more than 12 fields are not supported");
  // Fields of an aggregate may differ in type, so each is visited by name (no loop over a list).
  if constexpr (n == 1) { auto& [a] = s; for_each_tensor(a, f); }
  else if constexpr (n == 2) { auto& [a, b] = s; for_each_tensor(a, f); for_each_tensor(b, f); }
  else if constexpr (n == 3) { auto& [a, b, c] = s; for_each_tensor(a, f); for_each_tensor(b, f); for_each_tensor(c, f); }
  else if constexpr (n == 4) {
    auto& [a, b, c, d] = s;
    for_each_tensor(a, f); for_each_tensor(b, f); for_each_tensor(c, f); for_each_tensor(d, f);
  } else if constexpr (n == 5) {
    auto& [a, b, c, d, e] = s;
    for_each_tensor(a, f); for_each_tensor(b, f); for_each_tensor(c, f); for_each_tensor(d, f); for_each_tensor(e, f);
  } else if constexpr (n == 6) {
    auto& [a, b, c, d, e, g] = s;
    for_each_tensor(a, f); for_each_tensor(b, f); for_each_tensor(c, f); for_each_tensor(d, f); for_each_tensor(e, f);
    for_each_tensor(g, f);
  } else if constexpr (n == 7) {
    auto& [a, b, c, d, e, g, h] = s;
    for_each_tensor(a, f); for_each_tensor(b, f); for_each_tensor(c, f); for_each_tensor(d, f); for_each_tensor(e, f);
    for_each_tensor(g, f); for_each_tensor(h, f);
  } else if constexpr (n == 8) {
    auto& [a, b, c, d, e, g, h, i] = s;
    for_each_tensor(a, f); for_each_tensor(b, f); for_each_tensor(c, f); for_each_tensor(d, f); for_each_tensor(e, f);
    for_each_tensor(g, f); for_each_tensor(h, f); for_each_tensor(i, f);
  } else {
    static_assert(n <= 8, "for_each_tensor: aggregates with more than 8 fields: give the type a for_each_tensor member");
  }
}

/// Calls f(t) for every BasicTensor<U> t inside value, in a fixed order (tuple and struct fields in
/// declaration order, containers front to back, maps by key). Const-ness follows value's.
template <class V, class F>
void for_each_tensor(V& value, F&& f) {
  using T = std::remove_const_t<V>;
  if constexpr (is_basic_tensor<T>::value) {
    f(value);
  } else if constexpr (has_member_for_each_tensor<T>::value) {
    value.for_each_tensor(f);
  } else if constexpr (is_std_tuple<T>::value) {
    std::apply([&](auto&... x) { (for_each_tensor(x, f), ...); }, value);
  } else if constexpr (is_std_container<T>::value) {
    for (auto& x : value) for_each_tensor(x, f);
  } else if constexpr (is_std_map<T>::value) {
    for (auto& kv : value) for_each_tensor(kv.second, f);
  } else if constexpr (is_std_optional<T>::value) {
    if (value) for_each_tensor(*value, f);
  } else if constexpr (is_traversable_aggregate_v<T>) {
    for_each_field(value, f);
  } else {
    // Scalars, strings, enums, pointers, functions: no tensors. A class that might hide tensors
    // is refused rather than silently skipped.
    static_assert(holds_no_tensor<T>::value,
                  "for_each_tensor: this class is neither an aggregate nor a standard container; if it holds "
                  "tensors give it a `for_each_tensor(F&&)` member, else pass what it holds");
  }
}

}  // namespace remat::detail
