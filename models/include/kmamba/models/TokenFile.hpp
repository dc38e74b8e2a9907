// The KMTOKENS pre-tokenized file format (see TokenDataset in Data.hpp), encoded and decoded
// without Kokkos so that the parser can be fuzzed on its own:
//   bytes 0-7   "KMTOKENS"
//   bytes 8-11  format version (1), little-endian uint32
//   bytes 12-15 bytes per token (2 or 4), little-endian uint32
//   bytes 16-23 vocabulary size, little-endian uint64
//   bytes 24-31 token count, little-endian uint64
//   then count tokens of that width, little-endian, each below the vocabulary size.
#ifndef KMAMBA_MODELS_TOKENFILE_HPP
#define KMAMBA_MODELS_TOKENFILE_HPP

#include <cstddef>
#include <cstdint>
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

}  // namespace kmamba

#endif
