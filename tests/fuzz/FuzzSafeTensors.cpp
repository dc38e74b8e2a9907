// libFuzzer target: SafeTensorsReader on arbitrary bytes. Every malformed file must end in a
// kmamba::UserError; anything else (an out-of-bounds read, an absurd allocation, another
// exception escaping, an internal error) is a finding.
#include <kmamba/core/Error.hpp>
#include <kmamba/models/SafeTensors.hpp>

#include "FuzzSupport.hpp"

#include <cstdint>
#include <cstdlib>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string path = kmamba::fuzz::scratch_path("safetensors");
  kmamba::fuzz::write_file(path, data, size);
  try {
    const kmamba::SafeTensorsReader reader(path);
    for (const std::string& name : reader.names()) {
      const kmamba::TensorInfo& info = reader.info(name);
      for (const std::int64_t extent : info.shape) {
        if (extent < 0) std::abort();
      }
      if (reader.read_bytes(name).size() != info.end - info.begin) std::abort();
      try {
        if (reader.read_f32(name).size() != static_cast<std::size_t>(info.numel())) std::abort();
      } catch (const kmamba::UserError&) {
        if (reader.read_i64(name).size() != static_cast<std::size_t>(info.numel())) std::abort();
      }
      reader.check_shape(name, info.shape);
    }
    reader.config_bool("flag", false);
    reader.config_number("eps", 0.0);
    reader.config_numbers("limits", {});
  } catch (const kmamba::UserError&) {
  }
  return 0;
}
