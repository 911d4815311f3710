#include "checkpoint/support_checkpoint.hpp"

#include <exception>
#include <thread>

using namespace remat;

namespace {

/// Three AdamW steps of a small GPT with dropout under `how`, from seed `seed`; every parameter's
/// final values and the losses, as bits.
std::vector<float> train(std::uint64_t seed, const char* how) {
  Generator init(seed);
  nn::GPT gpt(test::small_gpt(3, 0.1), init);
  apply_checkpointing(gpt, policy::parse(how));
  optim::AdamW opt(gpt.parameters(), {1e-2});
  manual_seed(seed);  // this thread's generator: dropout draws from it
  std::vector<float> out;
  for (int step = 0; step < 3; ++step) {
    const LongTensor idx = randint(0, 23, {2, 12}, init), targets = randint(0, 23, {2, 12}, init);
    Tensor loss = gpt.loss(idx, targets);
    loss.backward();
    opt.step();
    opt.zero_grad();
    out.push_back(loss.item());
  }
  for (Tensor* p : gpt.parameters()) {
    const std::vector<float> v = p->to_vector();
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

}  // namespace

TEST_CASE("threads: independent models trained on two threads at once equal the same runs one after the other",
          "[checkpoint][threads]") {
  const std::vector<float> a = train(1, "blocks"), b = train(2, "binomial:2");
  std::vector<float> ta, tb;
  std::exception_ptr ea, eb;
  std::thread t1([&] {
    try {
      ta = train(1, "blocks");
    } catch (...) {
      ea = std::current_exception();
    }
  });
  std::thread t2([&] {
    try {
      tb = train(2, "binomial:2");
    } catch (...) {
      eb = std::current_exception();
    }
  });
  t1.join();
  t2.join();
  if (ea) std::rethrow_exception(ea);
  if (eb) std::rethrow_exception(eb);
  CHECK(ta == a);
  CHECK(tb == b);
  CHECK(a != b);
}
