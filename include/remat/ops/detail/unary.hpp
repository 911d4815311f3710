#pragma once
// The shared shape of element-wise unary ops: forward on Eigen arrays, one node whose backward is
// an element-wise formula of the output gradient and either the saved output or the saved input.

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "remat/core/produce.hpp"
#include "remat/core/tensor.hpp"
#include "remat/core/threads.hpp"

namespace remat::detail {

/// out = f(in...) element-wise over flat arrays, split across threads for large tensors.
///
/// Every element goes through Eigen's vectorised path, wherever it sits. Eigen computes the head
/// of a destination up to its first aligned packet, and the tail after its last whole packet, on
/// the scalar path, and its vectorised sqrt, exp, log, tanh and pow are not the scalar functions:
/// other bits. A split that moved with the thread count (pieces of n·t/threads elements) or with
/// the output's address therefore changed results. Here pieces are whole 64-byte blocks of a
/// 64-byte-aligned output (every storage of 256 bytes or more is), and the ragged end, or an output
/// that is not so aligned, is computed in a zero-padded aligned block: an element's bits depend on
/// its inputs alone, on any thread count and at any offset.
template <class T, class F, class... In>
void map_elements(BasicTensor<T>& out, F f, const In&... in) {
  constexpr std::int64_t lanes = 64 / sizeof(T);  // a multiple of every vector width up to AVX-512
  using AlignedBlock = Eigen::Map<Eigen::Array<T, lanes, 1>, Eigen::Aligned64>;
  using ConstAlignedBlock = Eigen::Map<const Eigen::Array<T, lanes, 1>, Eigen::Aligned64>;
  struct alignas(64) Padded {
    T v[lanes] = {};
  };
  T* po = out.data();
  const std::int64_t n = out.numel();
  const bool aligned = reinterpret_cast<std::uintptr_t>(po) % 64 == 0;
  const std::int64_t body = aligned ? n / lanes * lanes : 0;
  parallel_for(body / lanes, kElementGrain / lanes, [&](std::int64_t b, std::int64_t e) {
    b *= lanes;
    e *= lanes;
    Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>, Eigen::Aligned64>(po + b, e - b) =
        f(ConstArrayMap<T>(in.data() + b, e - b)...);
  });
  for (std::int64_t b = body; b < n; b += lanes) {
    const std::int64_t k = std::min(lanes, n - b);
    const auto pad = [&](const auto& t) {
      Padded block;
      std::copy_n(t.data() + b, k, block.v);
      return block;
    };
    Padded result;
    AlignedBlock(result.v) = f(ConstAlignedBlock(pad(in).v)...);
    std::copy_n(result.v, k, po + b);
  }
}

/// What an element-wise unary op keeps for its backward.
enum class UnarySaves { nothing, input, output };

/// Whether an element-wise op's backward formula also serves a backward that records its ops
/// (create_graph): `same_formula` when it is written so that it computes on tensors as well as on
/// Eigen arrays (one formula, the same operations in the same order, so the same bits); an op
/// without it refuses create_graph (its formula uses array functions no tensor op has yet).
enum class GraphFormula { none, same };
inline constexpr auto same_formula = std::integral_constant<GraphFormula, GraphFormula::same>{};

/// y = forward(x); dx = backward(dy) or backward(dy, saved), with saved = x or y as `Saves` says.
template <UnarySaves Saves, class T, class Forward, class Backward, GraphFormula Graph = GraphFormula::none>
BasicTensor<T> unary_op(OpId op, const BasicTensor<T>& x, Forward forward, Backward backward,
                        std::integral_constant<GraphFormula, Graph> = {}) {
  BasicTensor<T> y = produce<T>(op, x.shape(), static_cast<double>(x.numel()), {x}, [=] {
    BasicTensor<T> out(x.shape());
    map_elements(out, forward, x);
    return out;
  });
  if (grad_needed(x)) {
    std::vector<SavedTensor> saved;
    if constexpr (Saves == UnarySaves::input) saved.emplace_back(x);
    if constexpr (Saves == UnarySaves::output) saved.emplace_back(y);
    record<T>(op, {x}, {&y}, std::move(saved), [backward](BackwardContext<T>& ctx) {
      const BasicTensor<T>& dy = ctx.grad_output();
      if constexpr (Graph == GraphFormula::same) {
        if (ctx.create_graph()) {  // the formula on tensors, the saved one with its identity
          if constexpr (Saves == UnarySaves::nothing) ctx.accumulate(0, backward(dy));
          if constexpr (Saves == UnarySaves::input) ctx.accumulate(0, backward(dy, ctx.as_input(0, ctx.saved(0))));
          if constexpr (Saves == UnarySaves::output) ctx.accumulate(0, backward(dy, ctx.as_output(0, ctx.saved(0))));
          return;
        }
      }
      BasicTensor<T> dx(dy.shape());
      if constexpr (Saves == UnarySaves::nothing) map_elements(dx, backward, dy);
      else map_elements(dx, backward, dy, ctx.template saved<T>(0));
      ctx.accumulate(0, std::move(dx));
    });
  }
  // The tangent (forward mode): element-wise, the Jacobian is diagonal, so the derivative formula
  // applied to the tangent is its Jacobian-vector product; ops written in one formula have it on
  // tensors.
  if constexpr (Graph == GraphFormula::same) {
    push_tangent(y, [&](const BasicTensor<T>& t) {
      if constexpr (Saves == UnarySaves::nothing) return BasicTensor<T>(backward(t));
      else if constexpr (Saves == UnarySaves::input) return BasicTensor<T>(backward(t, x));
      else return BasicTensor<T>(backward(t, y));
    }, x);
  }
  return y;
}

/// y = forward(x); dx = backward(dy, y). Saves: y (for ops whose derivative is a function of y).
template <class T, class Forward, class Backward, GraphFormula Graph = GraphFormula::none>
BasicTensor<T> unary_saving_output(OpId op, const BasicTensor<T>& x, Forward forward, Backward backward,
                                   std::integral_constant<GraphFormula, Graph> graph = {}) {
  return unary_op<UnarySaves::output>(op, x, forward, backward, graph);
}

/// y = forward(x); dx = backward(dy, x). Saves: x.
template <class T, class Forward, class Backward, GraphFormula Graph = GraphFormula::none>
BasicTensor<T> unary_saving_input(OpId op, const BasicTensor<T>& x, Forward forward, Backward backward,
                                  std::integral_constant<GraphFormula, Graph> graph = {}) {
  return unary_op<UnarySaves::input>(op, x, forward, backward, graph);
}

/// y = forward(x); dx = backward(dy). Saves nothing (linear ops: negation, scalar add and scale).
template <class T, class Forward, class Backward, GraphFormula Graph = GraphFormula::none>
BasicTensor<T> unary_saving_nothing(OpId op, const BasicTensor<T>& x, Forward forward, Backward backward,
                                    std::integral_constant<GraphFormula, Graph> graph = {}) {
  return unary_op<UnarySaves::nothing>(op, x, forward, backward, graph);
}

}  // namespace remat::detail
