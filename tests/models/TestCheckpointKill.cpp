// kill -9 during real checkpoint saves: a helper process (CheckpointSaver.cpp) steps and saves in
// a loop; it is killed at a random moment, many times, and after every kill the checkpoint
// directory must resume cleanly (Trainer::resume checks that model.safetensors and
// training_state.safetensors come from the same save) at the last step whose save finished or
// the one being saved, never an older one.
#include <kmamba/models/Trainer.hpp>

#include "CheckpointKillModel.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <thread>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

namespace {

struct Helper {
  pid_t pid = -1;
  int out = -1;  // the helper's stdout
  std::string pending;
  long long begun = 0, saved = 0;

  explicit Helper(const std::string& dir) {
    int fds[2];
    if (::pipe(fds) != 0) std::abort();
    pid = ::fork();
    if (pid == 0) {
      ::dup2(fds[1], STDOUT_FILENO);
      ::close(fds[0]);
      ::close(fds[1]);
      ::execl(KMAMBA_CHECKPOINT_SAVER, KMAMBA_CHECKPOINT_SAVER, dir.c_str(), static_cast<char*>(nullptr));
      std::_Exit(127);
    }
    ::close(fds[1]);
    out = fds[0];
  }

  // Reads the helper's lines for up to `timeout_ms`; returns false on end of output.
  bool read_lines(int timeout_ms) {
    pollfd p{out, POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) <= 0) return true;
    char buffer[4096];
    const ssize_t n = ::read(out, buffer, sizeof(buffer));
    if (n <= 0) return false;
    pending.append(buffer, static_cast<std::size_t>(n));
    std::size_t end;
    while ((end = pending.find('\n')) != std::string::npos) {
      const std::string line = pending.substr(0, end);
      pending.erase(0, end + 1);
      if (line.rfind("begin ", 0) == 0) begun = std::atoll(line.c_str() + 6);
      if (line.rfind("saved ", 0) == 0) saved = std::atoll(line.c_str() + 6);
    }
    return true;
  }

  // SIGKILL, then collect what it printed before dying.
  void kill() {
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    while (read_lines(0)) {
      pollfd p{out, POLLIN, 0};
      if (::poll(&p, 1, 0) <= 0) break;
    }
    ::close(out);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "the helper exited on its own: " << status;
  }
};

TEST(CheckpointKill, EveryKilledSaveLeavesALoadableCheckpoint) {
  using Exec = Kokkos::DefaultHostExecutionSpace;
  const std::string dir = ::testing::TempDir() + "kmamba_test_checkpoint_kill/checkpoint";
  std::filesystem::remove_all(std::filesystem::path(dir).parent_path());
  const int kills = std::getenv("KMAMBA_KILL_POINTS") ? std::atoi(std::getenv("KMAMBA_KILL_POINTS")) : 60;
  std::mt19937_64 random(std::random_device{}());
  int inside_save = 0;
  for (int k = 0; k < kills; ++k) {
    Helper helper(dir);
    // Wait until the helper has a checkpoint of its own (or, from the second run on, has resumed
    // nothing and saved once), timing one save.
    auto t0 = std::chrono::steady_clock::now();
    auto begin_time = t0;
    long long first_begin = 0;
    while (helper.saved == 0) {
      ASSERT_TRUE(helper.read_lines(1000)) << "the helper died before its first save";
      if (helper.begun > 0 && first_begin == 0) {
        first_begin = helper.begun;
        begin_time = std::chrono::steady_clock::now();
      }
      ASSERT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(120)) << "no save within 2 minutes";
    }
    const auto save_us = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() -
                                                                               begin_time).count();
    // Every other kill: a random moment within the next few steps-and-saves (wherever it lands);
    // otherwise a random moment around the next save, from its "begin" line on (when steps take
    // much longer than saves, the first kind alone would rarely hit a save).
    const long long span = std::max<long long>(save_us, 1000);
    if (k % 2 == 1) {
      const long long next = helper.saved + 1;
      while (helper.begun < next) {
        ASSERT_TRUE(helper.read_lines(1000)) << "the helper died before its save " << next;
        ASSERT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(120)) << "no save within 2 minutes";
      }
    }
    std::uniform_int_distribution<long long> delay(0, (k % 2 == 1 ? 2 : 3) * span);
    std::this_thread::sleep_for(std::chrono::microseconds(delay(random)));
    helper.kill();
    if (helper.begun > helper.saved) ++inside_save;

    auto trainer = kmamba::test::checkpoint_kill_trainer<Exec>();
    ASSERT_NO_THROW(trainer.resume(dir)) << "kill " << k << " after 'begin " << helper.begun << "', 'saved "
                                         << helper.saved << "' left a checkpoint that does not load";
    EXPECT_GE(trainer.steps_taken(), helper.saved) << "kill " << k << ": an older checkpoint than the last saved";
    EXPECT_LE(trainer.steps_taken(), helper.begun) << "kill " << k << ": a checkpoint from a save never begun";
    EXPECT_FALSE(std::filesystem::exists(dir + ".previous"));
    // The next helper starts from scratch and overwrites this checkpoint.
  }
  std::printf("checkpoint kill: %d kills, %d inside a save\n", kills, inside_save);
  EXPECT_GE(inside_save, kills / 8) << "too few kills landed inside a save for the test to mean anything";
}

}  // namespace
