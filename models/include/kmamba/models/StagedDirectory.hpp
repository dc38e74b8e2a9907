// Replacing a whole directory atomically (checkpoints): the files are written into a staging
// directory beside the target, flushed to disk, and the staging directory then takes the
// target's place in one rename, so that a reader, or a process killed at any moment of the save,
// finds either the complete previous directory or the complete new one, never a mix.
//
//   kmamba::StagedDirectory staged("runs/recall/checkpoint");
//   model.save(staged.path());                 // runs/recall/checkpoint.saving/...
//   staged.commit();                           // runs/recall/checkpoint is now the new one
//
// The swap is renameat2(RENAME_EXCHANGE) (Linux >= 3.15 on local file systems); where the file
// system refuses it, the previous directory is first renamed to `target`.previous, which leaves a
// short window in which `target` is absent and `target`.previous holds the previous checkpoint
// (StagedDirectory::recover() puts it back).
#ifndef KMAMBA_MODELS_STAGEDDIRECTORY_HPP
#define KMAMBA_MODELS_STAGEDDIRECTORY_HPP

#include <string>

namespace kmamba {

class StagedDirectory {
 public:
  /// Creates `target`.saving empty (removing whatever a killed save left there) and the parents
  /// of `target`. Throws kmamba::UserError when they cannot be created.
  explicit StagedDirectory(const std::string& target);
  /// Removes the staging directory unless commit() succeeded.
  ~StagedDirectory();
  StagedDirectory(const StagedDirectory&) = delete;
  StagedDirectory& operator=(const StagedDirectory&) = delete;

  /// Where to write the new directory's files.
  const std::string& path() const { return staging_; }
  /// fsyncs every file of the staging directory and the directory itself, puts it in the target's
  /// place, removes the previous directory and fsyncs the parent. Throws kmamba::UserError on
  /// failure, leaving the previous directory in place.
  void commit();

  /// Puts `target`.previous back as `target` when a save was killed between the two renames of
  /// the fallback path; a no-op otherwise. Loaders of staged directories call it first.
  static void recover(const std::string& target);

 private:
  std::string target_;
  std::string staging_;
  bool committed_ = false;
};

}  // namespace kmamba

#endif
