// A MemoryBudget caps its own thread's saved bytes: two threads under two budgets, their graphs
// alive at the same time, each make the decisions they make alone.

#include "checkpoint/support_checkpoint.hpp"

#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

using namespace remat;

namespace {

/// Two threads meet here: each waits until both have arrived.
class Meeting {
 public:
  void arrive() {
    std::unique_lock<std::mutex> lock(mutex_);
    if (++arrived_ >= 2) {
      all_.notify_all();
      return;
    }
    all_.wait(lock, [&] { return arrived_ >= 2; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable all_;
  int arrived_ = 0;
};

/// What a budgeted step did: its log's figures and events, and the gradient's bits.
struct Decisions {
  std::size_t discards = 0, recomputes = 0, peak_saved = 0;
  std::string events;
  std::vector<float> grad;
  bool operator==(const Decisions& o) const {
    return discards == o.discards && recomputes == o.recomputes && peak_saved == o.peak_saved && events == o.events &&
           grad == o.grad;
  }
};

/// A tanh-matmul stack of `layers` under a budget of `budget` bytes; `between` runs after the
/// forward, before the backward (where the other thread's graph is alive too).
Decisions budgeted_step(std::uint64_t seed, int layers, std::size_t budget, const std::function<void()>& between) {
  test::FreshTape fresh;
  Generator g(seed);
  Tensor w = randn({32, 32}, g) * 0.3f;
  w.requires_grad_();
  Tensor h = randn({16, 32}, g);
  Decisions d;
  {
    MemoryBudget guard(budget);
    for (int i = 0; i < layers; ++i) h = tanh(matmul(h, w));
    Tensor loss = sum(h);
    between();
    loss.backward();
    const BudgetLog& log = guard.last_log();
    d.discards = log.discards;
    d.recomputes = log.recomputes;
    d.peak_saved = log.peak_saved_bytes;
    for (const BudgetEvent& e : log.events) d.events += e.str() + "\n";
  }
  d.grad = w.grad().to_vector();
  return d;
}

}  // namespace

TEST_CASE("memory budget: two threads under two budgets each decide as when alone", "[checkpoint][memory_budget][threads]") {
  const std::size_t row = 16 * 32 * sizeof(float);
  const Decisions alone_a = budgeted_step(1, 8, 6 * row, [] {});
  const Decisions alone_b = budgeted_step(2, 12, 9 * row, [] {});
  REQUIRE(alone_a.discards > 0);  // both budgets bind
  REQUIRE(alone_b.discards > 0);

  Meeting after_forward, before_backward;
  Decisions a, b;
  std::exception_ptr ea, eb;
  // Both forwards done before either backward: each thread's graph holds its saved bytes while the
  // other's budget decides, so books shared between the threads would change the decisions.
  auto run = [&](std::uint64_t seed, int layers, std::size_t budget, Decisions& out, std::exception_ptr& error) {
    try {
      out = budgeted_step(seed, layers, budget, [&] {
        after_forward.arrive();
        before_backward.arrive();
      });
    } catch (...) {
      error = std::current_exception();
      after_forward.arrive();
      before_backward.arrive();
    }
  };
  std::thread ta(run, 1, 8, 6 * row, std::ref(a), std::ref(ea));
  std::thread tb(run, 2, 12, 9 * row, std::ref(b), std::ref(eb));
  ta.join();
  tb.join();
  if (ea) std::rethrow_exception(ea);
  if (eb) std::rethrow_exception(eb);
  INFO("alone:\n" << alone_a.events << "together:\n" << a.events);
  REQUIRE(a == alone_a);
  INFO("alone:\n" << alone_b.events << "together:\n" << b.events);
  REQUIRE(b == alone_b);
  REQUIRE(a.peak_saved <= 6 * row);
  REQUIRE(b.peak_saved <= 9 * row);
}
