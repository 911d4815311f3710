#include <future>
#include <thread>

#include "support.hpp"

using namespace remat;

TEST_CASE("backward: gradients accumulate across uses of a tensor and across calls", "[core][tape]") {
  Tensor x = tensor({1.f, 2.f, 3.f}).requires_grad_();
  Tensor y = sum(x * x + x);  // dy/dx = 2x + 1
  y.backward();
  CHECK(test::values(x.grad()) == std::vector<float>{3, 5, 7});
  sum(x * 2.0f).backward();
  CHECK(test::values(x.grad()) == std::vector<float>{5, 7, 9});
  x.zero_grad();
  CHECK_FALSE(x.grad().defined());
}

TEST_CASE("backward: a non-scalar output needs a gradient of its shape", "[core][tape]") {
  Tensor x = ones({2, 2}).requires_grad_();
  Tensor y = x * 3.0f;
  REQUIRE_ERROR(y.backward(), "backward", "one-element", "(2, 2)");
  REQUIRE_ERROR(y.backward(ones({3})), "backward", "(3,)", "(2, 2)");
  y.backward(full({2, 2}, 2.0f));
  CHECK(test::values(x.grad()) == std::vector<float>{6, 6, 6, 6});
}

TEST_CASE("backward: a tensor that does not require grad cannot be backpropagated", "[core][tape]") {
  const Tensor x = ones({1});
  REQUIRE_ERROR(x.backward(), "does not require grad");
}

TEST_CASE("backward: a graph recorded on another thread is refused, saying so", "[core][tape]") {
  Tensor x = ones({2}).requires_grad_();
  Tensor loss;
  std::promise<void> recorded, tried;
  // The recording thread lives on (its tape too) while this thread tries the backward.
  std::thread recorder([&] {
    loss = sum(exp(x));
    recorded.set_value();
    tried.get_future().wait();
  });
  recorded.get_future().wait();
  CHECK_THROWS_WITH(loss.backward(), Catch::Contains("not on this thread's tapes") && Catch::Contains("another thread"));
  tried.set_value();
  recorder.join();
  CHECK_FALSE(x.grad().defined());
}

TEST_CASE("backward: a second backward through a freed graph throws, retain_graph allows it", "[core][tape]") {
  Tensor x = ones({2}).requires_grad_();
  Tensor loss = sum(exp(x));
  loss.backward();
  REQUIRE_ERROR(loss.backward(), "already been freed", "retain_graph");

  Tensor kept = sum(exp(x));
  x.zero_grad();
  kept.backward(/*retain_graph=*/true);
  kept.backward();
  CHECK(x.grad().at({0}) == Approx(2 * std::exp(1.0f)));
}

TEST_CASE("backward: reaching a shared subgraph that an earlier backward freed throws", "[core][tape]") {
  Tensor x = ones({2}).requires_grad_();
  Tensor h = exp(x);
  sum(h * 2.0f).backward();
  Tensor second = sum(h * 3.0f);
  REQUIRE_ERROR(second.backward(), "already freed", "retain_graph");
}

TEST_CASE("no_grad: nothing is recorded and outputs do not require grad", "[core][tape]") {
  Tensor x = ones({2}).requires_grad_();
  const std::size_t before = current_tape().size();
  {
    no_grad guard;
    CHECK_FALSE(is_grad_enabled());
    Tensor y = exp(x) * 2.0f;
    CHECK_FALSE(y.requires_grad());
    CHECK(current_tape().size() == before);
    {
      enable_grad on;
      CHECK(exp(x).requires_grad());
    }
  }
  CHECK(is_grad_enabled());
}

TEST_CASE("tape: saved tensors are released as soon as their node has run", "[core][tape]") {
  test::FreshTape fresh;
  Tensor x = randn({64}).requires_grad_();
  const std::size_t saved_before = memory_stats().saved_bytes;
  Tensor loss = sum(exp(x));  // exp saves its output: 64 floats
  CHECK(memory_stats().saved_bytes - saved_before == 64 * sizeof(float));
  CHECK(saved_tensors().total_bytes == 64 * sizeof(float));
  loss.backward();
  CHECK(memory_stats().saved_bytes == saved_before);
}

TEST_CASE("tape: a graph whose outputs are all dropped is freed without a backward", "[core][tape]") {
  test::FreshTape fresh;
  Tensor x = randn({32}).requires_grad_();
  const std::size_t saved_before = memory_stats().saved_bytes;
  const std::size_t nodes_before = current_tape().size();
  {
    Tensor y = exp(tanh(x));
    CHECK(current_tape().size() == nodes_before + 2);
  }
  Tensor z = x * 2.0f;  // the next record prunes the dead tail
  CHECK(current_tape().size() == nodes_before + 1);
  CHECK(memory_stats().saved_bytes == saved_before);
}

TEST_CASE("tape: positions support mark, backward between positions and reset", "[core][tape]") {
  Tape tape;
  TapeGuard use(tape);
  Tensor x = tensor({1.f, 2.f}).requires_grad_();
  Tensor h = x * 3.0f;
  const TapePosition mark = tape.position();
  CHECK(mark == 1);
  Tensor y = h * h;  // dy/dh = 2h
  CHECK(tape.position() == 2);
  h.retain_grad();
  y.meta()->grad = ones({2});  // seed dy by hand, as checkpoint replay does
  tape.backward(tape.position(), mark);
  CHECK(test::values(h.grad()) == std::vector<float>{6, 12});
  CHECK_FALSE(x.grad().defined());  // the node before the mark did not run
  tape.backward(mark, 0);
  CHECK(test::values(x.grad()) == std::vector<float>{18, 36});
  Tensor z = x * 5.0f;
  tape.reset(0);
  CHECK(tape.size() == 0);
  REQUIRE_ERROR(sum(z).backward(), "freed");
}

TEST_CASE("tape: a tensor modified in place after it was saved makes backward throw", "[core][tape]") {
  Tensor x = ones({3}).requires_grad_();
  Tensor y = exp(x);  // saves y
  Tensor loss = sum(y);
  y.at({0}) = 5.f;
  REQUIRE_ERROR(loss.backward(), "exp", "modified in place", "(3,)");
}

TEST_CASE("tape: inputs that do not require grad receive no gradient work", "[core][tape]") {
  test::FreshTape fresh;
  Tensor w = randn({3, 4}).requires_grad_();
  const Tensor data = randn({2, 3});
  const std::size_t saved_before = memory_stats().saved_bytes;
  Tensor out = matmul(data, w);  // only dW = dataᵀ dC is needed: saves data, not w
  CHECK(memory_stats().saved_bytes - saved_before == data.nbytes());
  sum(out).backward();
  CHECK(w.grad().shape() == Shape{3, 4});
  CHECK_FALSE(data.grad().defined());
}

namespace {

/// Records what an observer hears of gradients, as data parallelism uses it.
struct GradRecorder : Observer {
  void leaf_grad(const void* leaf) override { events.push_back(leaf); }
  void backward_end(bool completed, bool outermost) override {
    if (outermost) ends.push_back(completed);
  }
  std::vector<const void*> events;
  std::vector<bool> ends;
};

}  // namespace

TEST_CASE("backward: the grad observer hears each leaf contribution, and the outermost end once", "[core][tape]") {
  Tensor a = tensor({1.f, 2.f}).requires_grad_(), b = tensor({3.f, 4.f}).requires_grad_();
  GradRecorder rec;
  sum(a * b + a).backward();  // a takes two contributions, b one
  CHECK(std::count(rec.events.begin(), rec.events.end(), a.meta().get()) == 2);
  CHECK(std::count(rec.events.begin(), rec.events.end(), b.meta().get()) == 1);
  CHECK(rec.ends == std::vector<bool>{true});
  // Through a checkpointed segment: the replay's contributions are heard too, and one end.
  rec.events.clear();
  rec.ends.clear();
  Tensor y = checkpoint([&](const Tensor& x) { return x * b; }, a);
  sum(y).backward();
  CHECK(std::count(rec.events.begin(), rec.events.end(), a.meta().get()) == 1);
  CHECK(std::count(rec.events.begin(), rec.events.end(), b.meta().get()) == 1);
  CHECK(rec.ends == std::vector<bool>{true});
  // A backward that throws part way ends with completed = false; a check before it starts, not at all.
  rec.ends.clear();
  Tensor s = a * 1.0f;
  Tensor y2 = sum(s * s);
  s.data()[0] = 5.0f;  // modifies a tensor saved for backward
  REQUIRE_ERROR(y2.backward(), "modified");
  CHECK(rec.ends == std::vector<bool>{false});
  Tensor w = a * 3.0f;
  REQUIRE_ERROR(w.backward(ones({3})), "(3,)");
  CHECK(rec.ends.size() == 1);
}
