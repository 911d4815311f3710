// The Catch2 main of the distributed tests: one MPI context for the whole run, every rank runs every
// test (each test's collectives are made by all ranks in the same order).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "dist/support_dist.hpp"

namespace remat::test {

dist::Context*& world_slot() {
  static dist::Context* ctx = nullptr;
  return ctx;
}

}  // namespace remat::test

int main(int argc, char** argv) {
  remat::dist::Context ctx(&argc, &argv);
  remat::test::world_slot() = &ctx;
  // Ranks share the cores (4 ranks on 2 in CI): one thread each, or OpenMP barriers spin.
  remat::set_num_threads(1);
  const int failed = Catch::Session().run(argc, argv);
  // A rank whose test failed may have left the others mid-collective: end the job, do not hang.
  int any = failed != 0 ? 1 : 0, all = 0;
  MPI_Allreduce(&any, &all, 1, MPI_INT, MPI_MAX, ctx.comm());
  return all != 0 ? 1 : 0;
}
