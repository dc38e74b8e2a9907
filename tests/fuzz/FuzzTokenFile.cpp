// libFuzzer target: the KMTOKENS token-file parser on arbitrary bytes. Every malformed file must
// end in a kmamba::UserError; a file that parses must re-encode to the same bytes.
#include <kmamba/core/Error.hpp>
#include <kmamba/models/TokenFile.hpp>

#include <cstdint>
#include <cstdlib>
#include <cstring>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  int vocab = 0;
  std::vector<std::uint32_t> tokens;
  try {
    tokens = kmamba::parse_token_file(data, size, "fuzz.tokens", vocab);
  } catch (const kmamba::UserError&) {
    return 0;
  }
  const std::vector<unsigned char> again = kmamba::encode_token_file(tokens, vocab);
  // The encoder picks the narrowest width: a file of 4-byte tokens with a small vocabulary
  // re-encodes with 2-byte tokens, so the bytes must match only when the headers' first 16 bytes
  // (magic, version, width) do.
  int vocab_again = 0;
  const std::vector<std::uint32_t> tokens_again =
      kmamba::parse_token_file(again.data(), again.size(), "again", vocab_again);
  if (tokens_again != tokens || vocab_again != vocab) std::abort();
  if (again.size() == size && std::memcmp(again.data(), data, 16) == 0 && std::memcmp(again.data(), data, size) != 0) {
    std::abort();
  }
  return 0;
}
