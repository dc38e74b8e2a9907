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
  // When the last "begin" and "saved" lines arrived; how long the last save took from its "begin"
  // line to its "saved" line, and the last step-and-save from one "saved" line to the next (as this
  // process saw them; 0 until known).
  std::chrono::steady_clock::time_point begin_time{}, saved_time{};
  long long last_save_us = 0, last_cycle_us = 0;

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
      const auto now = std::chrono::steady_clock::now();
      if (line.rfind("begin ", 0) == 0) {
        begun = std::atoll(line.c_str() + 6);
        begin_time = now;
      }
      if (line.rfind("saved ", 0) == 0) {
        const long long step = std::atoll(line.c_str() + 6);
        if (step == begun)
          last_save_us = std::chrono::duration_cast<std::chrono::microseconds>(now - begin_time).count();
        if (saved > 0 && step == saved + 1)
          last_cycle_us = std::chrono::duration_cast<std::chrono::microseconds>(now - saved_time).count();
        saved = step;
        saved_time = now;
      }
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
  // At least a quarter of the kills must land inside a save. On a loaded machine (sanitizers,
  // parallel tests) saves and steps vary in length, so the test goes on killing, up to five times
  // `kills`, until that many did.
  const int inside_wanted = kills / 4;
  const int kills_at_most = 5 * kills;
  std::mt19937_64 random(std::random_device{}());
  int inside_save = 0, k = 0;
  for (; k < kills_at_most && (k < kills || inside_save < inside_wanted); ++k) {
    Helper helper(dir);
    // Wait until the helper has saved twice (the first run starts from nothing; later runs start
    // from scratch too and overwrite the checkpoint), which times a save and a step-and-save.
    const auto t0 = std::chrono::steady_clock::now();
    while (helper.saved < 2) {
      ASSERT_TRUE(helper.read_lines(1000)) << "the helper died before its second save";
      ASSERT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(120)) << "no save within 2 minutes";
    }
    // Even kills: a random moment within the next few steps-and-saves, wherever it lands. Odd
    // kills: a random moment inside the next save as long as it lasts like the last one, counted
    // from its "begin" line (when steps take much longer than saves, the first kind alone would
    // rarely hit a save).
    long long window_us = 3 * std::max<long long>(helper.last_cycle_us, 1000);
    if (k % 2 == 1) {
      const long long next = helper.saved + 1;
      while (helper.begun < next) {
        ASSERT_TRUE(helper.read_lines(1000)) << "the helper died before its save " << next;
        ASSERT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(120)) << "no save within 2 minutes";
      }
      window_us = std::max<long long>(helper.last_save_us, 100);
    }
    std::uniform_int_distribution<long long> delay(0, window_us);
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
  std::printf("checkpoint kill: %d kills, %d inside a save\n", k, inside_save);
  EXPECT_GE(inside_save, inside_wanted) << "too few of " << k
                                        << " kills landed inside a save for the test to mean anything";
}

}  // namespace
