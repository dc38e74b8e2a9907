#include <kmamba/core/Error.hpp>
#include <kmamba/core/Files.hpp>
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

int token_width(int vocab_size) { return vocab_size <= 65536 ? 2 : 4; }

std::vector<unsigned char> token_header(int vocab_size, std::uint64_t count) {
  std::vector<unsigned char> bytes(token_magic, token_magic + sizeof(token_magic));
  store_le(bytes, 1, 4);
  store_le(bytes, static_cast<std::uint64_t>(token_width(vocab_size)), 4);
  store_le(bytes, static_cast<std::uint64_t>(vocab_size), 8);
  store_le(bytes, count, 8);
  return bytes;
}

// Throws, naming `what`, unless tokens [0, n) are below the vocabulary size; `first` is the index
// of tokens[0] in the file.
void check_tokens(const std::uint32_t* tokens, std::size_t n, std::uint64_t first, int vocab_size, const char* what) {
  for (std::size_t i = 0; i < n; ++i) {
    KMAMBA_REQUIRE(
        tokens[i] < static_cast<std::uint32_t>(vocab_size),
        what << ": token " << first + i << " is " << tokens[i] << ", not below the vocabulary size " << vocab_size);
  }
}

void store_tokens(std::vector<unsigned char>& out, const std::uint32_t* tokens, std::size_t n, int width) {
  for (std::size_t i = 0; i < n; ++i) store_le(out, tokens[i], width);
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
  const char* what = "kmamba::TokenDataset::write_token_file";
  KMAMBA_REQUIRE(vocab_size >= 1, what << ": vocabulary size must be >= 1, got " << vocab_size);
  std::vector<unsigned char> bytes = token_header(vocab_size, tokens.size());
  check_tokens(tokens.data(), tokens.size(), 0, vocab_size, what);
  bytes.reserve(bytes.size() + tokens.size() * static_cast<std::size_t>(token_width(vocab_size)));
  store_tokens(bytes, tokens.data(), tokens.size(), token_width(vocab_size));
  return bytes;
}

// ---- TokenFileWriter ----

namespace {
// Tokens are buffered into writes of at least this many bytes.
constexpr std::size_t writer_buffer_bytes = 1u << 20;
}  // namespace

TokenFileWriter::TokenFileWriter(const std::string& path, int vocab_size, const char* what)
    : what_(what), vocab_size_(vocab_size), width_(token_width(vocab_size)) {
  KMAMBA_REQUIRE(vocab_size >= 1, what_ << ": '" << path << "': vocabulary size must be >= 1, got " << vocab_size);
  out_ = std::make_unique<OutputFile>(path, what);
  KMAMBA_REQUIRE(!out_->in_place(), what_ << ": '" << out_->target()
                                          << "' is a device or a FIFO; a token file must go to a regular file (its "
                                             "header's token count is written when all tokens are known)");
  out_->write(token_header(vocab_size, 0).data(), token_header_bytes);
}

TokenFileWriter::~TokenFileWriter() = default;

void TokenFileWriter::append(const std::vector<std::uint32_t>& tokens) {
  KMAMBA_REQUIRE(out_, what_ << ": the token file was already committed");
  check_tokens(tokens.data(), tokens.size(), count_, vocab_size_, what_.c_str());  // all or nothing is appended
  store_tokens(buffer_, tokens.data(), tokens.size(), width_);
  count_ += tokens.size();
  if (buffer_.size() >= writer_buffer_bytes) {
    out_->write(buffer_.data(), buffer_.size());
    buffer_.clear();
  }
}

void TokenFileWriter::commit() {
  KMAMBA_REQUIRE(out_, what_ << ": the token file was already committed");
  out_->write(buffer_.data(), buffer_.size());
  buffer_.clear();
  out_->rewrite(0, token_header(vocab_size_, count_).data(), token_header_bytes);
  out_->commit();
  out_.reset();
}

}  // namespace kmamba
