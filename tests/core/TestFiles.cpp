// kmamba/core/Files.hpp: inputs that are not regular files are refused, outputs follow symbolic
// links and never replace a device or a FIFO, logs never end in half a line, a directory lock
// names its holder.
#include <kmamba/core/Error.hpp>
#include <kmamba/core/Files.hpp>

#include "Checks.hpp"

#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

namespace {

namespace fs = std::filesystem;
using kmamba::test::expect_user_error;

// A fresh, empty directory for one test.
std::string scratch_dir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "kmamba_files_" + name + "_" + std::to_string(::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string contents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(Files, InputsMustBeRegularFiles) {
  const std::string dir = scratch_dir("inputs");
  const std::string fifo = dir + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_user_error([&] { kmamba::read_input_file(fifo, 100, "reader"); }, {"reader: '" + fifo + "' is a FIFO"});
  expect_user_error([&] { kmamba::require_regular_file(fifo, "reader"); }, {"is a FIFO, expected a regular file"});
  expect_user_error([&] { kmamba::read_input_file("/dev/zero", 100, "reader"); }, {"is a character device"});
  expect_user_error([&] { kmamba::read_input_file(dir, 100, "reader"); }, {"is a directory"});
  expect_user_error([&] { kmamba::read_input_file(dir + "/absent", 100, "reader"); }, {"cannot open"});
  kmamba::write_output_file(dir + "/text", std::string("hello"), "writer");
  EXPECT_EQ(kmamba::read_input_file(dir + "/text", 5, "reader"), "hello");
  expect_user_error([&] { kmamba::read_input_file(dir + "/text", 4, "reader"); }, {"holds 5 bytes, more than the 4"});
}

TEST(Files, OutputsFollowSymlinksAndKeepPermissions) {
  const std::string dir = scratch_dir("symlink");
  const std::string target = dir + "/target.json", link = dir + "/link.json";
  kmamba::write_output_file(target, std::string("old"), "writer");
  ASSERT_EQ(::chmod(target.c_str(), 0640), 0);
  fs::create_symlink("target.json", link);  // relative, as `ln -s` makes them
  kmamba::write_output_file(link, std::string("new"), "writer");
  EXPECT_TRUE(fs::is_symlink(link)) << "the symbolic link was replaced by a file";
  EXPECT_EQ(contents(target), "new");
  EXPECT_EQ(fs::status(target).permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
  // A dangling link creates its target.
  fs::create_symlink(dir + "/created.json", dir + "/dangling");
  kmamba::write_output_file(dir + "/dangling", std::string("made"), "writer");
  EXPECT_TRUE(fs::is_symlink(dir + "/dangling"));
  EXPECT_EQ(contents(dir + "/created.json"), "made");
  // Nothing is left beside the target.
  for (const auto& entry : fs::directory_iterator(dir)) {
    EXPECT_EQ(entry.path().string().find(".tmp"), std::string::npos) << entry.path();
  }
}

TEST(Files, OutputsWriteDevicesAndFifosInPlace) {
  const std::string dir = scratch_dir("devices");
  // A FIFO is written into, not replaced: a child process reads what arrives.
  const std::string fifo = dir + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string received = dir + "/received";
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    {
      std::ifstream in(fifo, std::ios::binary);
      std::ofstream out(received, std::ios::binary);
      out << in.rdbuf();
    }
    ::_exit(0);
  }
  kmamba::write_output_file(fifo, std::string("through the pipe"), "writer");
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  struct stat st;
  ASSERT_EQ(::lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode)) << "the FIFO was replaced";
  EXPECT_EQ(contents(received), "through the pipe");
  // /dev/null takes anything; /dev/full fails, and stays a device.
  kmamba::write_output_file("/dev/null", std::string("discarded"), "writer");
  expect_user_error([] { kmamba::write_output_file("/dev/full", std::string(100, 'x'), "writer"); },
                    {"writer: writing '/dev/full' failed: No space left on device"});
  ASSERT_EQ(::stat("/dev/full", &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
  // A directory is never an output.
  expect_user_error([&] { kmamba::write_output_file(dir, std::string("x"), "writer"); }, {"is a directory"});
}

TEST(Files, AnUncommittedOutputLeavesThePreviousFile) {
  const std::string dir = scratch_dir("uncommitted");
  const std::string path = dir + "/out.json";
  kmamba::write_output_file(path, std::string("previous"), "writer");
  {
    kmamba::OutputFile out(path, "writer");
    out.write(std::string("half of the new"));
  }
  EXPECT_EQ(contents(path), "previous");
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1) << "a temporary file was left";
}

TEST(Files, RewritingGoesBackIntoAReplacedFileOnly) {
  const std::string dir = scratch_dir("rewrite");
  const std::string path = dir + "/out.bin";
  {
    kmamba::OutputFile out(path, "writer");
    EXPECT_FALSE(out.in_place());
    out.write(std::string("count=?; the rest"));
    out.rewrite(6, "7", 1);
    expect_user_error([&] { out.rewrite(15, "xyz", 3); }, {"writer", "rewriting bytes [15, 18)", "holds 17 bytes"});
    out.commit();
  }
  EXPECT_EQ(contents(path), "count=7; the rest");
  kmamba::OutputFile device("/dev/null", "writer");
  EXPECT_TRUE(device.in_place());
  device.write(std::string("abc"));
  expect_user_error([&] { device.rewrite(0, "x", 1); }, {"writer", "'/dev/null' is written in place"});
}

TEST(Files, AppendFileChecksEveryWrite) {
  const std::string dir = scratch_dir("append");
  const std::string path = dir + "/metrics.jsonl";
  {
    kmamba::AppendFile log(path, true, "metrics");
    log.append("{\"step\": 1}\n");
  }
  {
    kmamba::AppendFile log(path, false, "metrics");
    log.append("{\"step\": 2}\n");
  }
  EXPECT_EQ(contents(path), "{\"step\": 1}\n{\"step\": 2}\n");
  kmamba::AppendFile full("/dev/full", false, "metrics");
  expect_user_error([&] { full.append("line\n"); }, {"metrics: writing '/dev/full' failed: No space left on device"});
}

// A full disk: a 64 KiB tmpfs, which needs root (CAP_SYS_ADMIN).
TEST(Files, AFullDiskIsAnErrorAndNeverHalfALine) {
  if (::geteuid() != 0)
    GTEST_SKIP() << "mounting a small tmpfs to fill needs root; this test runs as uid " << ::geteuid();
  const std::string dir = scratch_dir("full");
  if (::mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=64k") != 0) {
    GTEST_SKIP() << "cannot mount a tmpfs at " << dir
                 << " (no CAP_SYS_ADMIN in this container?): " << std::strerror(errno);
  }
  const std::string log_path = dir + "/metrics.jsonl", model_path = dir + "/model.bin";
  kmamba::write_output_file(model_path, std::string(8192, 'm'), "writer");
  const std::string line = std::string(1000, 'x') + "\n";
  bool failed = false;
  {
    kmamba::AppendFile log(log_path, true, "metrics");
    for (int i = 0; i < 200 && !failed; ++i) {
      try {
        log.append(line);
      } catch (const kmamba::UserError& e) {
        EXPECT_NE(std::string(e.what()).find("No space left on device"), std::string::npos) << e.what();
        failed = true;
      }
    }
  }
  EXPECT_TRUE(failed) << "200 kB fitted in a 64 kB file system";
  const std::string logged = contents(log_path);
  EXPECT_EQ(logged.size() % line.size(), 0u) << "the log ends in part of a line";
  // Replacing a file on the full disk fails and leaves the previous one whole.
  expect_user_error([&] { kmamba::write_output_file(model_path, std::string(65536, 'n'), "writer"); },
                    {"No space left on device"});
  EXPECT_EQ(contents(model_path), std::string(8192, 'm'));
  EXPECT_EQ(::umount(dir.c_str()), 0) << std::strerror(errno);
}

TEST(Files, DirectoryLockNamesItsHolder) {
  const std::string dir = scratch_dir("lock") + "/run";
  int ready[2], release[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(release), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    kmamba::DirectoryLock lock(dir, "holder");
    char c = 1;
    if (::write(ready[1], &c, 1) != 1 || ::read(release[0], &c, 1) != 1) ::_exit(1);
    ::_exit(0);
  }
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  expect_user_error([&] { kmamba::DirectoryLock second(dir, "kmamba-train"); },
                    {"kmamba-train: '" + dir + "' is in use by another process (process id " + std::to_string(child)});
  ASSERT_EQ(::write(release[1], &c, 1), 1);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  // The holder is gone: the lock is free again (the file stays).
  const kmamba::DirectoryLock mine(dir, "kmamba-train");
  EXPECT_EQ(contents(mine.path()), std::to_string(::getpid()));
  for (int fd : {ready[0], ready[1], release[0], release[1]}) ::close(fd);
}

}  // namespace
