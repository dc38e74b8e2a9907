// Training data: the synthetic multi-query associative recall task (the default of kmamba-train)
// and token data sets read from text (byte-level) or pre-tokenized files. Every batch is a pure
// function of (seed, split, index, batch size): a run that resumes at a saved data position sees
// exactly the batches it would have seen without stopping, and batch `i` of size k·B holds the
// same sequences as batches k·i, ..., k·i + k − 1 of size B.
//
//   kmamba::AssociativeRecallTask task({/*vocab_size=*/128, /*seqlen=*/64, /*num_kv_pairs=*/8, /*seed=*/1});
//   kmamba::TokenBatch b = task.batch(/*index=*/0, /*batch_size=*/32);   // b.ids, b.targets: (32, 64)
//
//   auto text = kmamba::TokenDataset::from_file("book.txt", {/*seqlen=*/256});
//   auto held_out = text.batch(kmamba::Split::Validation, 0, 8);
#ifndef KMAMBA_MODELS_DATA_HPP
#define KMAMBA_MODELS_DATA_HPP

#include <kmamba/core/Tensor.hpp>
#include <kmamba/models/LanguageModel.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace kmamba {

/// Which part of a data set a batch comes from.
enum class Split { Train, Validation };

/// "train", "validation".
const char* split_name(Split split);

/// A batch of sequences on the host: the model reads `ids` and is scored against `targets`
/// (ignore_index where nothing is predicted). Rows of packed documents also carry their sequence
/// ids (LanguageModel::set_sequence_ids); an empty `seq_idx` is one sequence per row.
struct TokenBatch {
  Tensor2<std::int64_t, Kokkos::HostSpace> ids;      // (batch, seqlen)
  Tensor2<std::int64_t, Kokkos::HostSpace> targets;  // (batch, seqlen)
  Tensor2<std::int64_t, Kokkos::HostSpace> seq_idx;  // (batch, seqlen) or empty

  /// Positions whose target is not ignore_index.
  std::int64_t predicted_tokens() const;
};

/// A source of training and held-out batches, deterministic in (split, index, batch_size).
class Dataset {
 public:
  virtual ~Dataset() = default;

  /// Sequences index·batch_size, ..., (index + 1)·batch_size − 1 of `split`.
  virtual TokenBatch batch(Split split, std::int64_t index, std::int64_t batch_size) const = 0;
  /// Every id and target lies in [0, vocab_size()) (targets may also be ignore_index).
  virtual int vocab_size() const = 0;
  /// Tokens per sequence.
  virtual std::int64_t seqlen() const = 0;
  /// Whether batch(Split::Validation, ...) is available.
  virtual bool has_validation() const { return true; }
  /// Identifies the data and every setting that changes the batches (recorded in checkpoints so
  /// that a resumed run can check it sees the same data); independent of file paths.
  virtual std::string fingerprint() const = 0;
};

/// Multi-query associative recall (Zoology, Arora et al. 2023).
struct AssociativeRecallConfig {
  int vocab_size = 128;      ///< token 0 is the blank; keys and values split the rest in two disjoint ranges
  std::int64_t seqlen = 64;  ///< at least 2·num_kv_pairs + queries()
  int num_kv_pairs = 8;      ///< pairs per sequence
  std::uint64_t seed = 0;
  int num_queries = 0;  ///< queries per sequence; 0 = num_kv_pairs (every key once)

  /// The resolved number of queries per sequence.
  int queries() const { return num_queries > 0 ? num_queries : num_kv_pairs; }

  /// Throws kmamba::UserError naming the first inconsistent field.
  void validate() const;
};

/// Each sequence shows num_kv_pairs key–value pairs `k1 v1 k2 v2 ...` (distinct keys from the key
/// range, distinct values from the value range), then, at random positions of the rest of the
/// sequence (blank tokens elsewhere), queries: the keys again in a random order (every key once
/// per round of num_kv_pairs queries). The target at a query is the value paired with that key;
/// every other target is ignore_index, so the accuracy over the predicted positions is the recall
/// accuracy. The validation split uses its own random stream.
class AssociativeRecallTask : public Dataset {
 public:
  explicit AssociativeRecallTask(const AssociativeRecallConfig& config);

  /// Training batch `index` (the same as batch(Split::Train, index, batch_size)).
  TokenBatch batch(std::int64_t index, std::int64_t batch_size) const;
  TokenBatch batch(Split split, std::int64_t index, std::int64_t batch_size) const override;
  int vocab_size() const override { return config_.vocab_size; }
  std::int64_t seqlen() const override { return config_.seqlen; }
  std::string fingerprint() const override;

  const AssociativeRecallConfig& config() const { return config_; }
  /// The blank token between queries.
  static constexpr std::int64_t blank_token = 0;
  /// Keys are drawn from [key_begin(), value_begin()), values from [value_begin(), vocab_size).
  std::int64_t key_begin() const { return 1; }
  std::int64_t value_begin() const;

 private:
  AssociativeRecallConfig config_;
};

/// Settings of a TokenDataset.
struct TokenDatasetConfig {
  std::int64_t seqlen = 256;         ///< tokens per training window
  double validation_fraction = 0.1;  ///< the last fraction of the tokens is held out (0: no held-out split)
  std::uint64_t seed = 0;            ///< chooses the windows
  /// Packed documents: the token that ends every document (the end-of-document id kmamba-tokenize
  /// wrote), or -1 (the default) for windows that run across documents. With it, a window's tokens
  /// after each end-of-document token form a new sequence of TokenBatch::seq_idx, and the target
  /// of the end-of-document token itself (the next document's first token) is ignore_index.
  std::int64_t document_end = -1;
};

/// A token sequence split into a training part and a held-out tail; batches are windows at
/// random offsets, targets = the next tokens; with TokenDatasetConfig::document_end, each window
/// is a row of packed documents (the same windows, with their sequence ids and no target across
/// a document's end).
///
/// Files: from_file() reads a pre-tokenized token file when the file starts with the magic below,
/// and any other file as UTF-8/binary text with one token per byte (vocabulary 256). A token file
/// (extension .kmtok by convention) is, all integers little-endian:
///
///   offset  0  8 bytes  magic "KMTOKENS"
///   offset  8  u32      format version, 1
///   offset 12  u32      bytes per token, 2 or 4
///   offset 16  u64      vocabulary size V (every token < V; V <= 65536 with 2-byte tokens)
///   offset 24  u64      token count N
///   offset 32  N tokens, u16 or u32
///
/// From numpy: `open(f, "wb").write(b"KMTOKENS" + struct.pack("<IIQQ", 1, 2, V, len(t)) +
/// np.asarray(t, "<u2").tobytes())`, or TokenDataset::write_token_file.
class TokenDataset : public Dataset {
 public:
  /// `tokens` must each be < vocab_size; `source` names the data in error messages.
  TokenDataset(std::vector<std::uint32_t> tokens, int vocab_size, const TokenDatasetConfig& config,
               std::string source = "tokens");

  /// A token file (by its magic) or a text file; see the class comment. Throws kmamba::UserError
  /// naming the file for an unreadable, empty, truncated or inconsistent file, a token >= the
  /// vocabulary, or data too short for windows of config.seqlen + 1 tokens in each split.
  static TokenDataset from_file(const std::string& path, const TokenDatasetConfig& config);
  /// Byte-level tokens of a text file (vocabulary 256).
  static TokenDataset from_text(const std::string& path, const TokenDatasetConfig& config);
  /// A token file in the format of the class comment.
  static TokenDataset from_token_file(const std::string& path, const TokenDatasetConfig& config);
  /// Writes `tokens` as a token file (2-byte tokens when vocab_size <= 65536), atomically.
  static void write_token_file(const std::string& path, const std::vector<std::uint32_t>& tokens, int vocab_size);

  TokenBatch batch(Split split, std::int64_t index, std::int64_t batch_size) const override;
  int vocab_size() const override { return vocab_size_; }
  std::int64_t seqlen() const override { return config_.seqlen; }
  bool has_validation() const override { return size(Split::Validation) > 0; }
  std::string fingerprint() const override;

  /// Tokens in `split`.
  std::int64_t size(Split split) const;
  const std::vector<std::uint32_t>& tokens() const { return tokens_; }
  const std::string& source() const { return source_; }

 private:
  std::vector<std::uint32_t> tokens_;
  int vocab_size_;
  TokenDatasetConfig config_;
  std::string source_;
  std::int64_t train_size_ = 0;
};

}  // namespace kmamba

#endif
