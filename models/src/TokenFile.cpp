#include <kmamba/core/Error.hpp>
#include <kmamba/models/TokenFile.hpp>

#include <cstring>
#include <limits>

namespace kmamba {
namespace {

constexpr char token_magic[8] = {'K', 'M', 'T', 'O', 'K', 'E', 'N', 'S'};
constexpr std::size_t token_header_bytes = 32;

std::uint64_t load_le(const unsigned char* p, int bytes) {
  std::uint64_t x = 0;
  for (int i = bytes - 1; i >= 0; --i) x = (x << 8) | p[i];
  return x;
}

void store_le(std::vector<unsigned char>& out, std::uint64_t x, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<unsigned char>((x >> (8 * i)) & 0xffu));
}

}  // namespace

bool has_token_magic(const unsigned char* bytes, std::size_t size) {
  return size >= sizeof(token_magic) && std::memcmp(bytes, token_magic, sizeof(token_magic)) == 0;
}

std::vector<std::uint32_t> parse_token_file(const unsigned char* bytes, std::size_t size, const std::string& source,
                                            int& vocab_size) {
  KMAMBA_REQUIRE(has_token_magic(bytes, size),
                 "kmamba::TokenDataset: '" << source << "' is not a token file (no KMTOKENS magic)");
  KMAMBA_REQUIRE(size >= token_header_bytes, "kmamba::TokenDataset: token file '"
                                                 << source << "' is truncated: " << size
                                                 << " bytes, the header alone has " << token_header_bytes);
  const std::uint64_t version = load_le(bytes + 8, 4);
  const std::uint64_t width = load_le(bytes + 12, 4);
  const std::uint64_t vocab = load_le(bytes + 16, 8);
  const std::uint64_t count = load_le(bytes + 24, 8);
  KMAMBA_REQUIRE(version == 1, "kmamba::TokenDataset: token file '" << source << "' has format version " << version
                                                                    << ", this kmamba reads version 1");
  KMAMBA_REQUIRE(width == 2 || width == 4, "kmamba::TokenDataset: token file '" << source << "' declares " << width
                                                                                << " bytes per token, expected 2 or 4");
  const std::uint64_t max_vocab = width == 2 ? 65536u : static_cast<std::uint64_t>(std::numeric_limits<int>::max());
  KMAMBA_REQUIRE(vocab >= 1 && vocab <= max_vocab, "kmamba::TokenDataset: token file '"
                                                       << source << "' declares vocabulary size " << vocab
                                                       << ", outside [1, " << max_vocab << "] for " << width
                                                       << "-byte tokens");
  const std::uint64_t payload = size - token_header_bytes;
  KMAMBA_REQUIRE(count <= payload / width && payload == count * width,
                 "kmamba::TokenDataset: token file '" << source << "' declares " << count << " tokens but holds "
                                                      << payload << " bytes of " << width << "-byte tokens"
                                                      << (count > payload / width ? " (truncated)" : ""));
  std::vector<std::uint32_t> tokens(static_cast<std::size_t>(count));
  const unsigned char* p = bytes + token_header_bytes;
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<std::uint32_t>(load_le(p + i * width, static_cast<int>(width)));
    KMAMBA_REQUIRE(tokens[i] < vocab, "kmamba::TokenDataset: token file '"
                                          << source << "': token " << i << " is " << tokens[i]
                                          << ", not below the vocabulary size " << vocab);
  }
  vocab_size = static_cast<int>(vocab);
  return tokens;
}

std::vector<unsigned char> encode_token_file(const std::vector<std::uint32_t>& tokens, int vocab_size) {
  KMAMBA_REQUIRE(vocab_size >= 1,
                 "kmamba::TokenDataset::write_token_file: vocabulary size must be >= 1, got " << vocab_size);
  const int width = vocab_size <= 65536 ? 2 : 4;
  std::vector<unsigned char> bytes(token_magic, token_magic + sizeof(token_magic));
  store_le(bytes, 1, 4);
  store_le(bytes, static_cast<std::uint64_t>(width), 4);
  store_le(bytes, static_cast<std::uint64_t>(vocab_size), 8);
  store_le(bytes, tokens.size(), 8);
  bytes.reserve(bytes.size() + tokens.size() * static_cast<std::size_t>(width));
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    KMAMBA_REQUIRE(tokens[i] < static_cast<std::uint32_t>(vocab_size),
                   "kmamba::TokenDataset::write_token_file: token "
                       << i << " is " << tokens[i] << ", not below the vocabulary size " << vocab_size);
    store_le(bytes, tokens[i], width);
  }
  return bytes;
}

}  // namespace kmamba
