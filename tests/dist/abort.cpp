// One rank throws and never reaches the collective the others wait in: the Context must end every
// rank (tests/dist/abort.sh checks the exit status, the message and that it took seconds, not a hang).
#include <remat/dist/context.hpp>

int main(int argc, char** argv) {
  remat::dist::Context ctx(&argc, &argv);
  ctx.barrier();
  if (ctx.rank() == 1) throw remat::Error("a failure on purpose in rank 1");
  ctx.barrier();  // the others wait here for rank 1, which never comes
  return 0;
}
