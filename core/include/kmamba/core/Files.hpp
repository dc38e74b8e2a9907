// Files that kmamba reads and writes, handled so that a hostile or careless path never hangs a
// reader, never replaces what it must not and never loses what was there before.
//
// Inputs: only regular files are read (after following symbolic links). A FIFO would block the
// reader forever and a device would feed it endless bytes, so both are refused with an error
// naming the path.
//
// Outputs: the path's symbolic links are followed and the file they end at is the one written.
//   - a regular file (or a path that does not exist yet) is replaced atomically: the bytes go to a
//     temporary file beside it, are flushed to disk, and the temporary is renamed over it, so a
//     reader or a process killed at any moment sees the old file or the new one, never half;
//   - a character device or a FIFO (/dev/stdout, /dev/null, a pipe) is written in place, never
//     replaced, and a failed write (/dev/full) is an error;
//   - a directory, a block device or a socket is refused.
//
//   kmamba::write_output_file("out/config.json", text, "kmamba::ModelConfig::save");
//   kmamba::OutputFile out("out/generated.jsonl", "kmamba-generate");
//   out.write(line);  ...  out.commit();     // an output never committed leaves the old file
//
// A run directory is owned by one process at a time: DirectoryLock holds an advisory lock (flock)
// on `dir`/kmamba.lock for its lifetime and names the holder's process id when it is taken.
#ifndef KMAMBA_CORE_FILES_HPP
#define KMAMBA_CORE_FILES_HPP

#include <cstddef>
#include <cstdint>
#include <string>

namespace kmamba {

/// Throws kmamba::UserError, naming `what` and `path`, unless `path` exists and is a regular file
/// (symbolic links followed). Never opens the file, so it cannot block on a FIFO.
void require_regular_file(const std::string& path, const char* what);

/// The whole content of the regular file `path`. Throws kmamba::UserError naming `what` and the
/// path when it cannot be opened, is not a regular file, or holds more than `max_bytes` bytes.
std::string read_input_file(const std::string& path, std::uint64_t max_bytes, const char* what);

/// An output file, written as the header above describes. Writes throw kmamba::UserError naming
/// `what`, the path and the system's reason (disk full, permission denied).
class OutputFile {
 public:
  OutputFile(const std::string& path, const char* what);
  /// Removes the temporary file unless commit() succeeded (the previous file stays).
  ~OutputFile();
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;

  void write(const void* data, std::size_t size);
  void write(const std::string& text) { write(text.data(), text.size()); }
  /// Writes `size` bytes over bytes already written, from `offset` on (a header whose content is
  /// known only at the end). Only a replaced regular file can go back: an output written in place
  /// (in_place()) is a UserError, and so is a range past the bytes written.
  void rewrite(std::uint64_t offset, const void* data, std::size_t size);
  /// Whether the bytes go straight to `path` (a character device or a FIFO) rather than to a
  /// temporary file that commit() renames.
  bool in_place() const { return temporary_.empty(); }
  /// Flushes the bytes to disk and puts them in place (the rename, for a regular file).
  void commit();
  /// The file the bytes end up in: `path` with its symbolic links resolved.
  const std::string& target() const { return target_; }

 private:
  std::string what_;
  std::string target_;
  std::string temporary_;  // empty when written in place
  int fd_ = -1;
};

/// Writes `size` bytes to `path` through an OutputFile and commits them.
void write_output_file(const std::string& path, const void* data, std::size_t size, const char* what);
void write_output_file(const std::string& path, const std::string& text, const char* what);

/// A log that grows by whole lines (metrics.jsonl). Each append() is one checked write; a failed
/// or short write (disk full) cuts the file back to its previous length, so that it never ends in
/// half a line, and throws kmamba::UserError naming the file and the reason.
class AppendFile {
 public:
  /// Opens `path` for appending, creating it; `truncate` empties it first.
  AppendFile(const std::string& path, bool truncate, const char* what);
  ~AppendFile();
  AppendFile(const AppendFile&) = delete;
  AppendFile& operator=(const AppendFile&) = delete;

  void append(const std::string& text);
  const std::string& path() const { return path_; }

 private:
  std::string what_;
  std::string path_;
  int fd_ = -1;
};

/// Exclusive ownership of a directory (created with its parents if absent) for the lifetime of
/// this object: an advisory flock on `dir`/kmamba.lock, which records the holder's process id.
/// Throws kmamba::UserError naming the directory and the holder's process id when another process
/// holds it. The lock dies with its process (kill -9 included); the file itself stays.
class DirectoryLock {
 public:
  DirectoryLock(const std::string& dir, const char* what);
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

  /// `dir`/kmamba.lock.
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace kmamba

#endif
