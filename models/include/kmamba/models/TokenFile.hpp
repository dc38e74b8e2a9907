// The KMTOKENS pre-tokenized file format (see TokenDataset in Data.hpp), encoded and decoded
// without Kokkos so that the parser can be fuzzed on its own:
//   bytes 0-7   "KMTOKENS"
//   bytes 8-11  format version (1), little-endian uint32
//   bytes 12-15 bytes per token (2 or 4), little-endian uint32
//   bytes 16-23 vocabulary size, little-endian uint64
//   bytes 24-31 token count, little-endian uint64
//   then count tokens of that width, little-endian, each below the vocabulary size.
// A corpus of several documents is one stream: kmamba-tokenize ends each document with an
// end-of-document token (the tokenizer's end-of-text token by default), as GPT-NeoX's data does.
#ifndef KMAMBA_MODELS_TOKENFILE_HPP
#define KMAMBA_MODELS_TOKENFILE_HPP

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kmamba {

/// True when `bytes` starts with the KMTOKENS magic.
bool has_token_magic(const unsigned char* bytes, std::size_t size);

/// The tokens of a KMTOKENS file held in `bytes` (`source` names it in errors); sets `vocab_size`.
/// Throws kmamba::UserError on a wrong magic, version or width, a vocabulary size out of range,
/// a token count that disagrees with the payload, or a token not below the vocabulary size.
std::vector<std::uint32_t> parse_token_file(const unsigned char* bytes, std::size_t size, const std::string& source,
                                            int& vocab_size);

/// The bytes of a KMTOKENS file holding `tokens` (2-byte tokens when vocab_size <= 65536).
std::vector<unsigned char> encode_token_file(const std::vector<std::uint32_t>& tokens, int vocab_size);

class OutputFile;

/// Writes a KMTOKENS file whose tokens arrive in pieces (a corpus too large to hold twice), through
/// an OutputFile: atomic, and a write that fails or is never committed leaves the previous file.
/// The header's token count is written by commit(), so the output must be a regular file.
///
///   kmamba::TokenFileWriter out("corpus.kmtok", tokenizer.vocab_size(), "kmamba-tokenize");
///   for (const auto& document : documents) out.append(document);
///   out.commit();
class TokenFileWriter {
 public:
  /// 2-byte tokens when vocab_size <= 65536, else 4-byte. Throws kmamba::UserError naming `what`
  /// and `path` for a vocabulary size below 1, or a path that is not (or cannot become) a regular
  /// file: a FIFO or a device cannot take the count afterwards.
  TokenFileWriter(const std::string& path, int vocab_size, const char* what);
  ~TokenFileWriter();
  TokenFileWriter(const TokenFileWriter&) = delete;
  TokenFileWriter& operator=(const TokenFileWriter&) = delete;

  /// Appends `tokens`; each must be below the vocabulary size (else kmamba::UserError, and nothing
  /// is appended).
  void append(const std::vector<std::uint32_t>& tokens);
  /// Writes the token count into the header and puts the file in place.
  void commit();

  std::uint64_t count() const { return count_; }
  int vocab_size() const { return vocab_size_; }

 private:
  std::unique_ptr<OutputFile> out_;
  std::string what_;
  int vocab_size_;
  int width_;
  std::uint64_t count_ = 0;
  std::vector<unsigned char> buffer_;
};

}  // namespace kmamba

#endif
