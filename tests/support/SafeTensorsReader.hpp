// Test-only reader of .safetensors files (golden data):
//   8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}, ...,
//   "__metadata__": {...}}, then the raw little-endian tensor bytes.
//
//   kmamba::test::SafeTensorsFile file(path);
//   auto u = file.to_device<kmamba::Tensor3<float, Mem>>("u");   // checks the rank
#ifndef KMAMBA_TESTS_SUPPORT_SAFETENSORSREADER_HPP
#define KMAMBA_TESTS_SUPPORT_SAFETENSORSREADER_HPP

#include <Kokkos_Core.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace kmamba {
namespace test {

class SafeTensorsFile {
 public:
  struct Entry {
    std::string dtype;
    std::vector<std::int64_t> shape;
    std::size_t begin = 0, end = 0;
  };

  explicit SafeTensorsFile(const std::string& path) : path_(path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("SafeTensorsFile: cannot open " + path);
    unsigned char length_bytes[8];
    in.read(reinterpret_cast<char*>(length_bytes), 8);
    if (!in) throw std::runtime_error("SafeTensorsFile: " + path + " is shorter than its 8-byte header length");
    std::uint64_t header_length = 0;
    for (int i = 7; i >= 0; --i) header_length = (header_length << 8) | length_bytes[i];
    std::string header(header_length, '\0');
    in.read(&header[0], static_cast<std::streamsize>(header_length));
    if (!in) throw std::runtime_error("SafeTensorsFile: " + path + " ends inside its JSON header");
    bytes_.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    const nlohmann::json json = nlohmann::json::parse(header);
    for (auto it = json.begin(); it != json.end(); ++it) {
      if (it.key() == "__metadata__") {
        for (auto m = it.value().begin(); m != it.value().end(); ++m) metadata_[m.key()] = m.value().get<std::string>();
        continue;
      }
      Entry e;
      e.dtype = it.value().at("dtype").get<std::string>();
      e.shape = it.value().at("shape").get<std::vector<std::int64_t>>();
      const auto offsets = it.value().at("data_offsets").get<std::vector<std::size_t>>();
      if (offsets.size() != 2 || offsets[0] > offsets[1] || offsets[1] > bytes_.size()) {
        throw std::runtime_error("SafeTensorsFile: bad data_offsets for " + it.key() + " in " + path);
      }
      e.begin = offsets[0];
      e.end = offsets[1];
      entries_[it.key()] = e;
    }
  }

  bool contains(const std::string& name) const { return entries_.count(name) != 0; }

  const Entry& entry(const std::string& name) const {
    const auto it = entries_.find(name);
    if (it == entries_.end()) throw std::runtime_error("SafeTensorsFile: no tensor " + name + " in " + path_);
    return it->second;
  }

  /// Metadata value (empty if absent).
  std::string metadata(const std::string& key) const {
    const auto it = metadata_.find(key);
    return it == metadata_.end() ? std::string() : it->second;
  }

  /// The values of an F32 tensor, row-major.
  std::vector<float> floats(const std::string& name) const {
    const Entry& e = entry(name);
    if (e.dtype != "F32") throw std::runtime_error("SafeTensorsFile: " + name + " is " + e.dtype + ", not F32");
    std::size_t count = 1;
    for (const std::int64_t s : e.shape) count *= static_cast<std::size_t>(s);
    if (count * sizeof(float) != e.end - e.begin) {
      throw std::runtime_error("SafeTensorsFile: size of " + name + " disagrees with its shape");
    }
    std::vector<float> values(count);
    if (count != 0) std::memcpy(values.data(), bytes_.data() + e.begin, count * sizeof(float));
    return values;
  }

  /// A new View (LayoutRight, any memory space) holding the F32 tensor `name`; its rank must match.
  template <class ViewType>
  ViewType to_device(const std::string& name) const {
    const Entry& e = entry(name);
    if (e.shape.size() != ViewType::rank) {
      throw std::runtime_error("SafeTensorsFile: " + name + " has rank " + std::to_string(e.shape.size()));
    }
    std::size_t extents[8];
    std::fill(extents, extents + 8, KOKKOS_INVALID_INDEX);
    for (std::size_t i = 0; i < e.shape.size(); ++i) extents[i] = static_cast<std::size_t>(e.shape[i]);
    ViewType view(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kmamba::test::golden::" + name), extents[0],
                  extents[1], extents[2], extents[3], extents[4], extents[5], extents[6], extents[7]);
    const std::vector<float> values = floats(name);
    auto host = Kokkos::create_mirror_view(view);
    std::memcpy(host.data(), values.data(), values.size() * sizeof(float));
    Kokkos::deep_copy(view, host);
    return view;
  }

 private:
  std::string path_;
  std::vector<char> bytes_;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace test
}  // namespace kmamba

#endif
