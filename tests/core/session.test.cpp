// The per-thread session (core/session.hpp): one struct per thread, one guard for every slot.

#include <thread>

#include "support.hpp"

using namespace remat;

TEST_CASE("session: Install puts a value slot back, also when an exception leaves the scope", "[core][session]") {
  detail::Session& s = detail::session();
  REQUIRE(s.grad_enabled);
  {
    no_grad off;
    CHECK_FALSE(s.grad_enabled);
    {
      enable_grad on;
      CHECK(s.grad_enabled);
    }
    CHECK_FALSE(s.grad_enabled);
  }
  CHECK(s.grad_enabled);
  try {
    CheckpointChecking checking;
    CHECK(s.check_replay_values);
    throw Error("leave the scope");
  } catch (const Error&) {
  }
  CHECK_FALSE(s.check_replay_values);
}

TEST_CASE("session: a stack slot removes its own entry, even when scopes end out of order", "[core][session]") {
  const std::size_t before = detail::session().observers.size();
  auto a = std::make_unique<Observer>();
  auto b = std::make_unique<Observer>();
  REQUIRE(detail::session().observers.size() == before + 2);
  a.reset();  // out of order: the newest entry is b's
  REQUIRE(detail::session().observers.size() == before + 1);
  CHECK(detail::session().observers.back() == b.get());
  b.reset();
  CHECK(detail::session().observers.size() == before);
}

TEST_CASE("session: run scopes nest through their slot and know the one outside them", "[core][session]") {
  REQUIRE(detail::RunScope::current() == nullptr);
  struct Decider : OpOutputHook {};
  Decider outer_decider;
  detail::RunScope* const outer_scope = detail::RunScope::current();
  REQUIRE(outer_scope != nullptr);
  CHECK(OpOutputHook::current() == &outer_decider);
  {
    Decider inner;
    CHECK(OpOutputHook::current() == &inner);
    CHECK(detail::RunScope::current()->parent() == outer_scope);
    {
      OpOutputHook::Suspended none;
      CHECK(detail::RunScope::current() == nullptr);
      CHECK(OpOutputHook::current() == nullptr);
    }
    CHECK(OpOutputHook::current() == &inner);
  }
  CHECK(OpOutputHook::current() == &outer_decider);
  CHECK(outer_scope->parent() == nullptr);
}

TEST_CASE("session: another thread starts from its own defaults whatever this thread has switched", "[core][session]") {
  no_grad off;
  CheckpointDebug debug;
  CheckpointEarlyStop no_early_stop(false);
  struct Quiet : Observer {
  } listening;
  manual_seed(1234);
  bool grad = false, checking = true, early_stop = false, debug_on = true, replaying = true;
  std::size_t observers = 99, tapes = 99;
  std::uint64_t seed = 99;
  std::thread t([&] {
    const detail::Session& s = detail::session();
    grad = s.grad_enabled;
    checking = s.check_replay_values;
    early_stop = s.early_stop;
    debug_on = s.debug_replay;
    replaying = is_replaying();
    observers = s.observers.size();
    tapes = detail::tape_stack().size();
    seed = default_generator().seed();
  });
  t.join();
  CHECK(grad);
  CHECK_FALSE(checking);
  CHECK(early_stop);
  CHECK_FALSE(debug_on);
  CHECK_FALSE(replaying);
  CHECK(observers == 0);
  CHECK(tapes == 1);  // its own root tape, made at first use
  CHECK(seed == 0);
  CHECK(default_generator().seed() == 1234);
  manual_seed(0);
}
