// Helper of the checkpoint kill test (TestCheckpointKill.cpp): trains a tiny model and saves a
// checkpoint to argv[1] after every step, forever, printing "begin N" before and "saved N" after
// the save of step N. The test kills it with SIGKILL at random moments.
#include <kmamba/models/Data.hpp>
#include <kmamba/models/Trainer.hpp>

#include <Kokkos_Core.hpp>

#include <cstdio>
#include <memory>

#include "CheckpointKillModel.hpp"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CHECKPOINT_DIR\n", argv[0]);
    return 2;
  }
  Kokkos::ScopeGuard kokkos(argc, argv);
  using Exec = Kokkos::DefaultHostExecutionSpace;
  kmamba::Trainer<Exec> trainer = kmamba::test::checkpoint_kill_trainer<Exec>();
  for (;;) {
    const kmamba::StepResult s = trainer.step();
    std::printf("begin %lld\n", static_cast<long long>(s.step));
    std::fflush(stdout);
    trainer.save_checkpoint(argv[1]);
    std::printf("saved %lld\n", static_cast<long long>(s.step));
    std::fflush(stdout);
  }
}
