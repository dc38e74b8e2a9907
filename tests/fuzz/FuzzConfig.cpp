// libFuzzer target: ModelConfig::from_json on arbitrary bytes (config.json of transformers or
// mamba_ssm). Every malformed or unsupported config must end in a kmamba::UserError, and every
// config that loads must survive a round trip through to_hf_json() unchanged.
#include <kmamba/core/Error.hpp>
#include <kmamba/models/Config.hpp>

#include <cstdint>
#include <cstdlib>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  kmamba::ModelConfig config;
  try {
    config = kmamba::ModelConfig::from_json(text, "fuzz/config.json");
  } catch (const kmamba::UserError&) {
    return 0;
  }
  const std::string written = config.to_hf_json();
  const kmamba::ModelConfig again = kmamba::ModelConfig::from_json(written, "fuzz/round-trip.json");
  if (again.to_hf_json() != written) std::abort();
  return 0;
}
