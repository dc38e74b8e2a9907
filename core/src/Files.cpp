#include <kmamba/core/Error.hpp>
#include <kmamba/core/Files.hpp>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <thread>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

namespace kmamba {
namespace {

// Linux's own limit on the symbolic links one path resolution follows.
constexpr int max_symlinks = 40;

const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

std::string directory_of(const std::string& path) {
  const std::size_t slash = path.rfind('/');
  if (slash == std::string::npos) return "";
  return path.substr(0, slash + 1);
}

// `path` with the symbolic links of its last component followed to the file they end at (which
// may not exist yet); links in the directories above are left to the kernel.
std::string resolve_links(const std::string& path, const char* what) {
  std::string current = path;
  for (int followed = 0; followed <= max_symlinks; ++followed) {
    struct stat st;
    if (::lstat(current.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return current;
    std::string target(static_cast<std::size_t>(st.st_size > 0 ? st.st_size : 4096) + 1, '\0');
    const ssize_t n = ::readlink(current.c_str(), &target[0], target.size());
    KMAMBA_REQUIRE(n >= 0, what << ": cannot read the symbolic link '" << current << "': " << std::strerror(errno));
    target.resize(static_cast<std::size_t>(n));
    current = !target.empty() && target[0] == '/' ? target : directory_of(current) + target;
  }
  KMAMBA_USER_ERROR(what << ": '" << path << "' is a chain of more than " << max_symlinks << " symbolic links");
}

// Writes all of `size` bytes, retrying short writes and interruptions; false with errno set on failure.
bool write_all(int fd, const void* data, std::size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = ENOSPC;
      return false;
    }
    p += n;
    size -= static_cast<std::size_t>(n);
  }
  return true;
}

std::string reason(int err) { return std::strerror(err); }

}  // namespace

void require_regular_file(const std::string& path, const char* what) {
  struct stat st;
  KMAMBA_REQUIRE(::stat(path.c_str(), &st) == 0, what << ": cannot open '" << path << "': " << std::strerror(errno));
  KMAMBA_REQUIRE(S_ISREG(st.st_mode),
                 what << ": '" << path << "' is " << kind_of(st.st_mode) << ", expected a regular file");
}

std::string read_input_file(const std::string& path, std::uint64_t max_bytes, const char* what) {
  // O_NONBLOCK: opening a FIFO that slipped in between the check and the open must not block.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  KMAMBA_REQUIRE(fd >= 0, what << ": cannot open '" << path << "': " << std::strerror(errno));
  struct stat st;
  const bool known = ::fstat(fd, &st) == 0;
  if (!known || !S_ISREG(st.st_mode)) {
    const int err = errno;
    ::close(fd);
    KMAMBA_REQUIRE(known, what << ": cannot read '" << path << "': " << std::strerror(err));
    KMAMBA_USER_ERROR(what << ": '" << path << "' is " << kind_of(st.st_mode) << ", expected a regular file");
  }
  const std::uint64_t size = static_cast<std::uint64_t>(st.st_size);
  if (size > max_bytes) {
    ::close(fd);
    KMAMBA_USER_ERROR(what << ": '" << path << "' holds " << size << " bytes, more than the " << max_bytes
                           << " this reader accepts");
  }
  std::string text(static_cast<std::size_t>(size), '\0');
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::read(fd, &text[done], text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<std::size_t>(n);
  }
  const int err = errno;
  ::close(fd);
  KMAMBA_REQUIRE(done == text.size(), what << ": reading '" << path << "' failed after " << done << " of " << size
                                           << " bytes: " << (done < text.size() ? reason(err) : "file changed"));
  return text;
}

OutputFile::OutputFile(const std::string& path, const char* what) : what_(what), target_(resolve_links(path, what)) {
  struct stat st;
  const bool exists = ::stat(target_.c_str(), &st) == 0;
  if (exists && (S_ISCHR(st.st_mode) || S_ISFIFO(st.st_mode))) {
    fd_ = ::open(target_.c_str(), O_WRONLY | O_CLOEXEC);
    KMAMBA_REQUIRE(fd_ >= 0, what_ << ": cannot open '" << target_ << "': " << std::strerror(errno));
    return;
  }
  KMAMBA_REQUIRE(!exists || S_ISREG(st.st_mode),
                 what_ << ": '" << target_ << "' is " << kind_of(st.st_mode)
                       << "; an output must be a regular file, a character device or a FIFO");
  temporary_ = target_ + ".tmp." + std::to_string(::getpid());
  ::unlink(temporary_.c_str());  // left by a killed process that had this process id
  fd_ = ::open(temporary_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  KMAMBA_REQUIRE(fd_ >= 0, what_ << ": cannot create '" << temporary_ << "': " << std::strerror(errno));
  if (exists) {
    const int ignored = ::fchmod(fd_, st.st_mode & 07777);  // the replacement keeps the file's permissions
    (void)ignored;
  }
}

OutputFile::~OutputFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!temporary_.empty()) ::unlink(temporary_.c_str());
}

void OutputFile::write(const void* data, std::size_t size) {
  KMAMBA_REQUIRE(fd_ >= 0, what_ << ": '" << target_ << "' was already committed");
  KMAMBA_REQUIRE(write_all(fd_, data, size), what_ << ": writing '" << (temporary_.empty() ? target_ : temporary_)
                                                   << "' failed: " << std::strerror(errno) << "; '" << target_
                                                   << "' was left unchanged");
}

void OutputFile::rewrite(std::uint64_t offset, const void* data, std::size_t size) {
  KMAMBA_REQUIRE(fd_ >= 0, what_ << ": '" << target_ << "' was already committed");
  KMAMBA_REQUIRE(!in_place(), what_ << ": '" << target_
                                    << "' is written in place (a device or a FIFO), so bytes already written cannot "
                                       "be rewritten; write to a regular file");
  const off_t end = ::lseek(fd_, 0, SEEK_CUR);
  KMAMBA_REQUIRE(end >= 0 && offset + size <= static_cast<std::uint64_t>(end),
                 what_ << ": rewriting bytes [" << offset << ", " << offset + size << ") of '" << temporary_
                       << "', which holds " << end << " bytes");
  const auto* bytes = static_cast<const unsigned char*>(data);
  std::size_t done = 0;
  while (done < size) {
    const ssize_t n = ::pwrite(fd_, bytes + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    KMAMBA_REQUIRE(n > 0, what_ << ": writing '" << temporary_ << "' failed: " << std::strerror(errno) << "; '"
                                << target_ << "' was left unchanged");
    done += static_cast<std::size_t>(n);
  }
}

void OutputFile::commit() {
  KMAMBA_REQUIRE(fd_ >= 0, what_ << ": '" << target_ << "' was already committed");
  const int fd = fd_;
  fd_ = -1;
  if (temporary_.empty()) {
    KMAMBA_REQUIRE(::close(fd) == 0, what_ << ": writing '" << target_ << "' failed: " << std::strerror(errno));
    return;
  }
  // The bytes are on disk before the rename publishes them.
  const bool synced = ::fsync(fd) == 0;
  const int sync_err = errno;
  const bool closed = ::close(fd) == 0;
  KMAMBA_REQUIRE(synced && closed, what_ << ": writing '" << temporary_
                                         << "' failed: " << std::strerror(synced ? errno : sync_err) << "; '" << target_
                                         << "' was left unchanged");
  KMAMBA_REQUIRE(::rename(temporary_.c_str(), target_.c_str()) == 0,
                 what_ << ": cannot rename '" << temporary_ << "' to '" << target_ << "': " << std::strerror(errno));
  temporary_.clear();
}

void write_output_file(const std::string& path, const void* data, std::size_t size, const char* what) {
  OutputFile out(path, what);
  out.write(data, size);
  out.commit();
}

void write_output_file(const std::string& path, const std::string& text, const char* what) {
  write_output_file(path, text.data(), text.size(), what);
}

AppendFile::AppendFile(const std::string& path, bool truncate, const char* what) : what_(what), path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | (truncate ? O_TRUNC : 0), 0666);
  KMAMBA_REQUIRE(fd_ >= 0, what_ << ": cannot open '" << path_ << "' for writing: " << std::strerror(errno));
}

AppendFile::~AppendFile() {
  if (fd_ >= 0) ::close(fd_);
}

void AppendFile::append(const std::string& text) {
  const off_t before = ::lseek(fd_, 0, SEEK_END);
  if (write_all(fd_, text.data(), text.size())) return;
  const int err = errno;
  if (before >= 0) {
    const int ignored = ::ftruncate(fd_, before);  // a FIFO or a device has no length to restore
    (void)ignored;
  }
  KMAMBA_USER_ERROR(what_ << ": writing '" << path_ << "' failed: " << std::strerror(err));
}

namespace {

// The process id a lock file's holder wrote, or "" if it wrote none. The holder writes it just
// after it takes the lock, so a process that finds the lock taken may read the file before the
// write: it reads again, for up to a second, while the file is empty.
std::string lock_holder(int fd) {
  for (int attempt = 0; attempt < 50; ++attempt) {
    char holder[32] = {0};
    const ssize_t n = ::pread(fd, holder, sizeof(holder) - 1, 0);
    if (n > 0) return std::string(holder, static_cast<std::size_t>(n));
    if (n < 0) return std::string();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return std::string();
}

}  // namespace

DirectoryLock::DirectoryLock(const std::string& dir, const char* what) : path_(dir + "/kmamba.lock") {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  KMAMBA_REQUIRE(!error, what << ": cannot create the directory '" << dir << "': " << error.message());
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  KMAMBA_REQUIRE(fd_ >= 0, what << ": cannot open the lock file '" << path_ << "': " << std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    const std::string holder = err == EWOULDBLOCK ? lock_holder(fd_) : std::string();
    ::close(fd_);
    fd_ = -1;
    KMAMBA_REQUIRE(err != EWOULDBLOCK, what << ": '" << dir << "' is in use by another process (process id "
                                            << (holder.empty() ? "unknown" : holder) << ", holding '" << path_
                                            << "'); wait for it to end or use another directory");
    KMAMBA_USER_ERROR(what << ": cannot lock '" << path_ << "': " << std::strerror(err));
  }
  const std::string pid = std::to_string(::getpid());
  const bool recorded =
      ::ftruncate(fd_, 0) == 0 && ::pwrite(fd_, pid.data(), pid.size(), 0) == static_cast<ssize_t>(pid.size());
  if (!recorded) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    KMAMBA_USER_ERROR(what << ": cannot write the lock file '" << path_ << "': " << std::strerror(err));
  }
}

DirectoryLock::~DirectoryLock() {
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace kmamba
