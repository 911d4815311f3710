// Training state on disk: save and load of everything a run needs, atomically, all or nothing.
#include <csignal>
#include <filesystem>
#include <cstdio>
#include <fstream>
#include <random>

#include <sys/wait.h>
#include <unistd.h>

#include "support.hpp"

using namespace remat;

namespace {

/// Files named state_*, apart from the other io tests' (CTest runs cases in parallel, one folder).
struct TempPath : test::TempFile {
  explicit TempPath(const std::string& name) : test::TempFile("state_" + name) {}
};

/// A small model and one of the optimizers, trained a few steps so every buffer exists.
struct Run {
  Generator init;
  nn::Sequential model;
  std::unique_ptr<optim::Optimizer> opt;

  Run(std::uint64_t seed, bool adamw, std::int64_t width = 8) : init(seed) {
    model.push_back(std::make_unique<nn::Linear>(6, width, true, init));
    model.push_back(std::make_unique<nn::Linear>(width, 3, true, init));
    if (adamw) opt = std::make_unique<optim::AdamW>(model.parameters(), optim::AdamWOptions{2e-2});
    else opt = std::make_unique<optim::SGD>(model.parameters(), optim::SGDOptions{5e-2, 0.9});
  }
  void step(std::int64_t t) {
    Generator data(100 + static_cast<std::uint64_t>(t));
    const Tensor x = randn({4, 6}, data);
    opt->zero_grad();
    Tensor loss = mean(pow(model(x), 2));
    loss.backward();
    opt->step();
  }
  std::vector<std::vector<float>> weights() {
    std::vector<std::vector<float>> out;
    for (Tensor* p : model.parameters()) out.push_back(p->to_vector());
    return out;
  }
  std::map<std::string, std::vector<float>> buffers() const {
    std::map<std::string, std::vector<float>> out;
    for (const auto& [k, t] : opt->state().tensors) out[k] = t.to_vector();
    return out;
  }
};

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace

TEST_CASE("training state: a save and load round trip is exact, and training goes on bitwise", "[io][state]") {
  for (const bool adamw : {false, true}) {
    INFO((adamw ? "AdamW" : "SGD"));
    TempPath f(adamw ? "adamw" : "sgd");
    Run a(1, adamw);
    for (std::int64_t t = 0; t < 3; ++t) a.step(t);
    a.opt->set_lr(0.0123);
    manual_seed(77);
    (void)rand({5});  // the default generator moved on
    io::TrainingState s;
    s.step = 3;
    s.data_position = 12345;
    s.scalars["best_loss"] = 0.1 + 0.2;  // not exactly representable in decimal: must round-trip exactly
    s.tensors["loss_history"] = tensor({1.5f, 1.25f, 1.0f});
    s.generators["data"] = Generator(9).state();
    io::save_training_state(f.path, a.model, *a.opt, s);
    const Generator::State rng_saved = default_generator().state();

    Run b(2, adamw);  // other initial weights, no optimizer state
    manual_seed(5);
    const io::TrainingState got = io::load_training_state(f.path, b.model, *b.opt);
    CHECK(b.weights() == a.weights());
    CHECK(b.buffers() == a.buffers());
    CHECK(b.opt->lr() == 0.0123);
    CHECK(b.opt->state().scalars == a.opt->state().scalars);
    CHECK(default_generator().state() == rng_saved);
    CHECK(got.step == 3);
    CHECK(got.data_position == 12345);
    CHECK(got.scalars.at("best_loss") == 0.1 + 0.2);
    CHECK(got.tensors.at("loss_history").to_vector() == std::vector<float>{1.5f, 1.25f, 1.0f});
    CHECK(got.generators.at("data") == Generator(9).state());
    for (std::int64_t t = 3; t < 6; ++t) {
      a.step(t);
      b.step(t);
    }
    CHECK(b.weights() == a.weights());
  }
}

TEST_CASE("training state: a truncated or altered file is rejected and changes nothing", "[io][state]") {
  TempPath f("damaged"), g("victim");
  Run a(3, true);
  for (std::int64_t t = 0; t < 2; ++t) a.step(t);
  io::save_training_state(f.path, a.model, *a.opt, {});
  const std::string good = read_all(f.path);
  const std::uint64_t header = io::detail::header_length(good);

  Run b(4, true);
  b.step(0);
  const auto weights = b.weights();
  const auto buffers = b.buffers();
  const double lr = b.opt->lr();
  auto unchanged = [&] { return b.weights() == weights && b.buffers() == buffers && b.opt->lr() == lr; };

  std::mt19937_64 pick(1);
  std::uniform_int_distribution<std::size_t> cut(0, good.size() - 1);
  int rejected = 0;
  for (int k = 0; k < 1000; ++k) {
    write_all(g.path, good.substr(0, cut(pick)));
    try {
      io::load_training_state(g.path, b.model, *b.opt);
    } catch (const Error&) {
      ++rejected;
    }
  }
  CHECK(rejected == 1000);
  CHECK(unchanged());
  // Every byte of the length field and the header, changed.
  int header_rejected = 0;
  for (std::size_t i = 0; i < 8 + header; ++i) {
    std::string bad = good;
    bad[i] = static_cast<char>(bad[i] ^ 0x20);
    write_all(g.path, bad);
    try {
      io::load_training_state(g.path, b.model, *b.opt);
    } catch (const Error&) {
      ++header_rejected;
    }
  }
  CHECK(header_rejected == static_cast<int>(8 + header));
  // And a byte of the data.
  std::string bad = good;
  bad[good.size() - 5] = static_cast<char>(bad[good.size() - 5] ^ 1);
  write_all(g.path, bad);
  CHECK_THROWS_AS(io::load_training_state(g.path, b.model, *b.opt), Error);
  CHECK(unchanged());
  // A model or optimizer that does not match is an error naming what differs, and changes nothing.
  Run sgd(5, false);
  REQUIRE_ERROR(io::load_training_state(f.path, sgd.model, *sgd.opt), "AdamW", "SGD");
  nn::Sequential other;
  Generator init(6);
  other.push_back(std::make_unique<nn::Linear>(6, 9, true, init));
  optim::AdamW other_opt(other.parameters());
  REQUIRE_ERROR(io::load_training_state(f.path, other, other_opt), "model");
  // The same parameters split into other groups: the groups must match too.
  Run regrouped(10, true);
  std::vector<Tensor*> ps = regrouped.model.parameters();
  optim::AdamW two_groups({optim::ParamGroup{{ps[0], ps[1]}, 0.1}, optim::ParamGroup{{ps[2], ps[3]}, 0.0}}, optim::AdamWOptions{});
  REQUIRE_ERROR(io::load_training_state(f.path, regrouped.model, two_groups), "group");
  CHECK(unchanged());
}

TEST_CASE("training state: a writer killed at random moments always leaves a loadable file of one saved version",
          "[io][state][atomic]") {
  TempPath f("atomic");
  // Big enough (2.4 MB with AdamW's moments) that writing it in place would be caught half done.
  Run a(7, true, 20000);
  a.step(0);
  io::TrainingState s;
  s.step = 0;
  io::save_training_state(f.path, a.model, *a.opt, s);  // version 0 is in place before any kill
  std::mt19937_64 pick(2);
  std::uniform_int_distribution<int> wait_us(0, 20000);
  int kills = 0;
  for (int round = 0; round < 50; ++round) {
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      // Versions v = 1, 2, ..., told apart by their step.
      for (std::int64_t v = 1;; ++v) {
        io::TrainingState mine;
        mine.step = v;
        try {
          io::save_training_state(f.path, a.model, *a.opt, mine);
        } catch (...) {
          ::_exit(3);
        }
      }
    }
    ::usleep(static_cast<useconds_t>(wait_us(pick)));
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    kills += WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
    Run b(8, true, 20000);
    const io::TrainingState got = io::load_training_state(f.path, b.model, *b.opt);  // throws if broken
    CHECK(got.step >= 0);
    CHECK(b.weights() == a.weights());
  }
  CHECK(kills == 50);
  // Killed writers leave their temporary files behind (never in place of the state file); the
  // next save removes them.
  io::save_training_state(f.path, a.model, *a.opt, s);
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator("."))
    if (e.path().filename().string().rfind(f.path + ".tmp.", 0) == 0) left.push_back(e.path().string());
  CHECK(left.empty());
  for (const std::string& t : left) std::filesystem::remove(t);
}
