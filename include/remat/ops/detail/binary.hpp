#pragma once
// The shared shape of broadcast binary ops: z = f(a, b) under numpy broadcasting, one node whose
// backward applies each operand's partial derivative to dz and sums the result down to that
// operand's shape (the reverse of its broadcast).

#include <array>
#include <cstddef>
#include <type_traits>
#include <utility>
#include <vector>

#include "remat/core/produce.hpp"
#include "remat/core/tensor.hpp"
#include "remat/ops/broadcast_to.hpp"
#include "remat/ops/detail/broadcast.hpp"
#include "remat/ops/neg.hpp"

namespace remat::detail {

/// Which of a, b and z a partial derivative reads (a mask): the forward saves only what the
/// partials of the operands that need a gradient read.
inline constexpr unsigned reads_a = 1, reads_b = 2, reads_z = 4;

/// What a partial derivative sees in backward: the tensors it reads; the others are undefined.
template <class T>
struct BinaryOperands {
  BasicTensor<T> a, b, z;
};

/// ∂z/∂x = Sign (±1), so dx is dz summed to x's shape. The sign goes on after the sum: there it
/// touches x's elements rather than z's, and zeros keep their bits (negated first, +0 and -0 would
/// sum to +0, where the negated sum is -0).
template <int Sign>
struct UnitPartial {
  static constexpr unsigned reads = 0;
};
inline constexpr UnitPartial<1> partial_one{};
inline constexpr UnitPartial<-1> partial_minus_one{};

/// ∂z/∂x as a rule: rule(dz, BinaryOperands) gives x's gradient at z's shape, which is then summed
/// to x's shape. `Reads` names what the rule reads. `graph`, when given, is the same rule written
/// in recorded tensor ops (the same operations in the same order), for a backward that records
/// its ops (create_graph); without it the op refuses create_graph.
template <unsigned Reads, class Rule, class GraphRule = std::nullptr_t>
struct RulePartial {
  static constexpr unsigned reads = Reads;
  Rule rule;
  GraphRule graph;
};

template <unsigned Reads, class Rule>
RulePartial<Reads, Rule> partial(Rule rule) {
  return {std::move(rule), nullptr};
}
template <unsigned Reads, class Rule, class GraphRule>
RulePartial<Reads, Rule, GraphRule> partial(Rule rule, GraphRule graph) {
  return {std::move(rule), std::move(graph)};
}

/// Whether a partial can be recorded (create_graph): the unit ones always, a rule when it has a graph form.
template <class P>
struct HasGraphForm : std::true_type {};
template <unsigned Reads, class Rule>
struct HasGraphForm<RulePartial<Reads, Rule, std::nullptr_t>> : std::false_type {};

template <class T, int Sign>
void accumulate_partial(BackwardContext<T>& ctx, std::size_t i, UnitPartial<Sign>, const BasicTensor<T>& dz,
                        const BinaryOperands<T>&, const Shape& shape) {
  if constexpr (Sign > 0) {
    ctx.accumulate(i, sum_to(dz, shape));
  } else {
    BasicTensor<T> g = copy_of(sum_to(dz, shape));  // sum_to may hand back dz itself
    flat(g) = -flat(g);
    ctx.accumulate(i, std::move(g));
  }
}

template <class T, unsigned Reads, class Rule, class GraphRule>
void accumulate_partial(BackwardContext<T>& ctx, std::size_t i, const RulePartial<Reads, Rule, GraphRule>& p,
                        const BasicTensor<T>& dz, const BinaryOperands<T>& v, const Shape& shape) {
  // One expression, so the rule's result outlives the call: when sum_to hands it back unchanged,
  // accumulate copies it instead of adopting it, and the memory books see what they always saw.
  ctx.accumulate(i, sum_to(p.rule(dz, v), shape));
}

/// The same, recorded (create_graph): operands carry their identities, the sum is sum_to_size.
template <class T, int Sign>
void accumulate_graph_partial(BackwardContext<T>& ctx, std::size_t i, UnitPartial<Sign>, const BasicTensor<T>& dz,
                              const BinaryOperands<T>&, const Shape& shape) {
  if constexpr (Sign > 0) ctx.accumulate(i, sum_to_size(dz, shape));
  else ctx.accumulate(i, neg(sum_to_size(dz, shape)));
}

template <class T, unsigned Reads, class Rule, class GraphRule>
void accumulate_graph_partial(BackwardContext<T>& ctx, std::size_t i, const RulePartial<Reads, Rule, GraphRule>& p,
                              const BasicTensor<T>& dz, const BinaryOperands<T>& v, const Shape& shape) {
  ctx.accumulate(i, sum_to_size(p.graph(dz, v), shape));
}

/// An operand's term of z's tangent: its partial applied to its tangent broadcast to z's shape.
template <class T, int Sign>
BasicTensor<T> tangent_term(UnitPartial<Sign>, const BasicTensor<T>& t, const BinaryOperands<T>&) {
  if constexpr (Sign > 0) return t;
  else return neg(t);
}
template <class T, unsigned Reads, class Rule, class GraphRule>
BasicTensor<T> tangent_term(const RulePartial<Reads, Rule, GraphRule>& p, const BasicTensor<T>& t,
                            const BinaryOperands<T>& v) {
  return p.graph(t, v);
}

/// binary_op's node: saves what the partials of the operands that need a gradient read.
template <class T, class GradA, class GradB>
void record_binary(OpId op, const BasicTensor<T>& a, const BasicTensor<T>& b, BasicTensor<T>& z, const GradA& grad_a,
                   const GradB& grad_b) {
  const std::array<const BasicTensor<T>*, 3> operands{&a, &b, &z};
  std::array<std::size_t, 3> slot{};  // where each saved one of a, b, z sits in `saved`
  std::vector<SavedTensor> saved;
  unsigned held = 0;
  const auto save = [&](unsigned reads) {
    for (std::size_t k = 0; k < operands.size(); ++k)
      if (((reads & ~held) >> k) & 1u) {
        slot[k] = saved.size();
        saved.emplace_back(*operands[k]);
        held |= 1u << k;
      }
  };
  if (a.requires_grad()) save(GradA::reads);
  if (b.requires_grad()) save(GradB::reads);
  record<T>(op, {a, b}, {&z}, std::move(saved),
            [slot, sa = a.shape(), sb = b.shape(), grad_a, grad_b](BackwardContext<T>& ctx) {
              const BasicTensor<T>& dz = ctx.grad_output();
              BinaryOperands<T> v;
              const std::array<BasicTensor<T>*, 3> operand{&v.a, &v.b, &v.z};
              constexpr bool recordable = HasGraphForm<GradA>::value && HasGraphForm<GradB>::value;
              const bool graph = recordable && ctx.create_graph();
              // Each saved tensor is checked (in-place writes) as it is first read, not before.
              // Recorded, each carries its identity: a, b as inputs 0, 1; z as the output.
              const auto load = [&](unsigned reads) {
                for (std::size_t k = 0; k < operand.size(); ++k)
                  if (((reads >> k) & 1u) && !operand[k]->defined()) {
                    *operand[k] = ctx.saved(slot[k]);
                    if (graph) *operand[k] = k < 2 ? ctx.as_input(k, *operand[k]) : ctx.as_output(0, *operand[k]);
                  }
              };
              const auto partial = [&](std::size_t i, unsigned reads, const auto& rule, const Shape& shape) {
                if (!ctx.needs_grad(i)) return;
                load(reads);
                if constexpr (recordable) {
                  if (graph) return accumulate_graph_partial(ctx, i, rule, dz, v, shape);
                }
                accumulate_partial(ctx, i, rule, dz, v, shape);
              };
              partial(0, GradA::reads, grad_a, sa);
              partial(1, GradB::reads, grad_b, sb);
            });
}

/// z = forward(a, b) with broadcasting; da and db through the partials `grad_a` and `grad_b`
/// (partial_one, partial_minus_one, or partial<reads>(rule)). Saves what those partials read, each
/// tensor once, in the order they first read it. Broadcast errors name the op.
template <class T, class Forward, class GradA, class GradB>
BasicTensor<T> binary_op(OpId op, const BasicTensor<T>& a, const BasicTensor<T>& b, Forward forward, GradA grad_a,
                         GradB grad_b) {
  const Shape shape = broadcast_shape(a.shape(), b.shape(), op.name());
  BasicTensor<T> z = produce<T>(op, shape, static_cast<double>(shape.numel()), {a, b},
                                [=] { return broadcast_apply(a, b, op.name(), forward); });
  if (grad_needed(a, b)) record_binary(op, a, b, z, grad_a, grad_b);
  // The tangent (forward mode): each operand's partial (in its recorded form) applied to its
  // tangent, broadcast to z's shape; the two terms summed.
  if constexpr (HasGraphForm<GradA>::value && HasGraphForm<GradB>::value) {
    push_tangent(z, [&](const BasicTensor<T>& ta, const BasicTensor<T>& tb) {
      const BinaryOperands<T> v{a, b, z};
      const auto term = [&](const auto& partial, const BasicTensor<T>& t) {
        return t.defined() ? tangent_term(partial, broadcast_to(t, shape), v) : BasicTensor<T>();
      };
      return tangent_sum(term(grad_a, ta), term(grad_b, tb));
    }, a, b);
  }
  return z;
}

}  // namespace remat::detail
