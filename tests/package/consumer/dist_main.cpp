// A user's program with remat::dist: starts MPI through remat's Context and prints its rank. Built
// by the CMake consumers (remat::dist) and with remat-dist.pc's flags, to check that both compile
// and link a remat::dist program.
#include <remat/dist/context.hpp>

int main(int argc, char** argv) {
  remat::dist::Context ctx(&argc, &argv);
  fmt::print("rank {} of {}\n", ctx.rank(), ctx.world_size());
  return 0;
}
