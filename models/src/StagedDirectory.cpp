#include <kmamba/core/Error.hpp>
#include <kmamba/models/StagedDirectory.hpp>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <system_error>

#include <fcntl.h>
#include <unistd.h>

namespace kmamba {
namespace {

namespace fs = std::filesystem;

// "a/b/" -> "a/b": the staging and previous names are siblings of the directory itself.
std::string without_trailing_slash(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  return path;
}

void fsync_path(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  KMAMBA_REQUIRE(fd >= 0,
                 "kmamba::StagedDirectory: cannot open '" << path << "' to flush it: " << std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  KMAMBA_REQUIRE(rc == 0, "kmamba::StagedDirectory: flushing '" << path << "' to disk failed: " << std::strerror(err));
}

std::string parent_of(const std::string& path) {
  const fs::path parent = fs::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

// Atomically swaps two existing directories; false where the file system cannot.
bool exchange_directories(const std::string& a, const std::string& b) {
#ifdef RENAME_EXCHANGE
  if (::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) == 0) return true;
  KMAMBA_REQUIRE(errno == EINVAL || errno == ENOSYS || errno == ENOTSUP,
                 "kmamba::StagedDirectory: cannot exchange '" << a << "' and '" << b << "': " << std::strerror(errno));
#else
  (void)a;
  (void)b;
#endif
  return false;
}

}  // namespace

StagedDirectory::StagedDirectory(const std::string& target)
    : target_(without_trailing_slash(target)), staging_(target_ + ".saving") {
  KMAMBA_REQUIRE(!target_.empty(), "kmamba::StagedDirectory: empty target directory name");
  recover(target_);
  std::error_code error;
  fs::remove_all(staging_, error);
  KMAMBA_REQUIRE(!error, "kmamba::StagedDirectory: cannot remove the stale '" << staging_ << "': " << error.message());
  fs::create_directories(staging_, error);
  KMAMBA_REQUIRE(!error, "kmamba::StagedDirectory: cannot create '" << staging_ << "': " << error.message());
}

StagedDirectory::~StagedDirectory() {
  if (committed_) return;
  std::error_code ignored;
  fs::remove_all(staging_, ignored);
}

void StagedDirectory::commit() {
  KMAMBA_REQUIRE(!committed_, "kmamba::StagedDirectory: '" << staging_ << "' was already committed");
  for (const fs::directory_entry& entry : fs::directory_iterator(staging_)) {
    if (entry.is_regular_file()) fsync_path(entry.path().string(), O_RDONLY);
  }
  fsync_path(staging_, O_RDONLY | O_DIRECTORY);
  std::error_code error;
  const bool had_previous = fs::is_directory(target_, error);
  if (had_previous && exchange_directories(staging_, target_)) {
    committed_ = true;  // staging_ now holds the previous directory
    fsync_path(parent_of(target_), O_RDONLY | O_DIRECTORY);
    fs::remove_all(staging_, error);
    return;
  }
  const std::string previous = target_ + ".previous";
  if (had_previous) {
    fs::remove_all(previous, error);
    KMAMBA_REQUIRE(std::rename(target_.c_str(), previous.c_str()) == 0,
                   "kmamba::StagedDirectory: cannot move '" << target_ << "' aside: " << std::strerror(errno));
  }
  if (std::rename(staging_.c_str(), target_.c_str()) != 0) {
    const int err = errno;
    if (had_previous) std::rename(previous.c_str(), target_.c_str());
    KMAMBA_USER_ERROR("kmamba::StagedDirectory: cannot rename '" << staging_ << "' to '" << target_
                                                                 << "': " << std::strerror(err));
  }
  committed_ = true;
  fsync_path(parent_of(target_), O_RDONLY | O_DIRECTORY);
  fs::remove_all(previous, error);
}

void StagedDirectory::recover(const std::string& target) {
  const std::string dir = without_trailing_slash(target);
  const std::string previous = dir + ".previous";
  std::error_code error;
  if (fs::is_directory(previous, error) && !fs::exists(dir, error)) {
    KMAMBA_REQUIRE(std::rename(previous.c_str(), dir.c_str()) == 0, "kmamba::StagedDirectory: cannot restore '"
                                                                        << previous << "' as '" << dir
                                                                        << "': " << std::strerror(errno));
  }
}

}  // namespace kmamba
