#pragma once
#include <remat/dist/context.hpp>
#include <remat/core/threads.hpp>

namespace remat::test {

dist::Context*& world_slot();
/// The process's MPI context (made by the distributed tests' main).
inline dist::Context& world() { return *world_slot(); }

}  // namespace remat::test
