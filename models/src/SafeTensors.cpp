#include <kmamba/core/Error.hpp>
#include <kmamba/core/Files.hpp>
#include <kmamba/core/Json.hpp>
#include <kmamba/models/SafeTensors.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

namespace kmamba {
namespace {

// A header larger than this is not a checkpoint header (the largest real ones are a few MB).
constexpr std::uint64_t max_header_bytes = 100ull * 1024 * 1024;

const std::pair<const char*, DType> dtype_table[] = {
    {"F64", DType::F64}, {"F32", DType::F32}, {"F16", DType::F16}, {"BF16", DType::BF16}, {"I64", DType::I64},
    {"I32", DType::I32}, {"I16", DType::I16}, {"I8", DType::I8},   {"U8", DType::U8},     {"BOOL", DType::Bool}};

// bf16 -> float is exact: the bf16 bits are the top half of the float's (kmamba/core/Bf16.hpp holds the
// device-side twin; this file stays free of Kokkos so that the reader can be fuzzed on its own).
float bf16_to_float(std::uint16_t bits) {
  const std::uint32_t wide = static_cast<std::uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h >> 15) << 31;
  const int exponent = (h >> 10) & 0x1f;
  const std::uint32_t mantissa = h & 0x3ffu;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 31) {
    magnitude = mantissa ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x400u), exponent - 25);
  }
  return sign ? -magnitude : magnitude;
}

std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::ostringstream os;
  os << "(";
  for (std::size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  if (shape.size() == 1) os << ",";
  os << ")";
  return os.str();
}

template <class T>
T load_le(const unsigned char* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));  // x86-64 and aarch64 hosts are little-endian
  return value;
}

double json_number(const nlohmann::json& v, const std::string& where) {
  if (v.is_number()) return v.get<double>();
  if (v.is_string()) {
    const std::string text = v.get<std::string>();
    if (text == "inf" || text == "Infinity" || text == "+inf") return std::numeric_limits<double>::infinity();
    if (text == "-inf" || text == "-Infinity") return -std::numeric_limits<double>::infinity();
  }
  KMAMBA_USER_ERROR(where << " is " << quote_json(v) << ", not a number");
}

// The extents of `shape`; returns their product, refusing one whose bytes could not fit in
// `data_size` (an empty tensor, with an extent 0, fits whatever its other extents).
std::uint64_t parse_shape(const nlohmann::json& shape, const std::string& where, std::uint64_t data_size,
                          std::vector<std::int64_t>& extents) {
  KMAMBA_REQUIRE(shape.is_array(), where << ": shape is " << quote_json(shape) << ", not an array");
  bool empty = false;
  for (const nlohmann::json& d : shape) {
    KMAMBA_REQUIRE(d.is_number_unsigned(),
                   where << ": shape holds " << quote_json(d) << ", not a non-negative integer");
    const std::uint64_t extent = d.get<std::uint64_t>();
    KMAMBA_REQUIRE(extent <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()),
                   where << ": shape " << quote_json(shape) << " has an extent beyond 2^63 - 1");
    empty = empty || extent == 0;
    extents.push_back(static_cast<std::int64_t>(extent));
  }
  if (empty) return 0;
  std::uint64_t numel = 1;
  for (const std::int64_t extent : extents) {
    const auto e = static_cast<std::uint64_t>(extent);
    KMAMBA_REQUIRE(numel <= data_size / e, where << ": shape " << quote_json(shape) << " is larger than the file ("
                                                 << data_size << " bytes of tensor data)");
    numel *= e;
  }
  return numel;
}

TensorInfo parse_tensor(const std::string& name, const nlohmann::json& value, const std::string& path,
                        std::uint64_t data_size) {
  const std::string where = "safetensors: '" + path + "', tensor '" + name + "'";
  KMAMBA_REQUIRE(
      value.is_object() && value.contains("dtype") && value.contains("shape") && value.contains("data_offsets"),
      where << ": needs dtype, shape and data_offsets");
  TensorInfo info;
  info.name = name;
  KMAMBA_REQUIRE(value["dtype"].is_string(), where << ": dtype is " << quote_json(value["dtype"]) << ", not a string");
  const std::string dtype = value["dtype"].get<std::string>();
  bool known = false;
  for (const auto& entry : dtype_table) {
    if (dtype == entry.first) {
      info.dtype = entry.second;
      known = true;
    }
  }
  KMAMBA_REQUIRE(known, where << ": unsupported dtype '" << dtype.substr(0, 32) << (dtype.size() > 32 ? "...'" : "'"));
  const std::uint64_t numel = parse_shape(value["shape"], where, data_size, info.shape);
  const nlohmann::json& offsets = value["data_offsets"];
  KMAMBA_REQUIRE(
      offsets.is_array() && offsets.size() == 2 && offsets[0].is_number_unsigned() && offsets[1].is_number_unsigned(),
      where << ": data_offsets must be two non-negative integers, got " << quote_json(offsets));
  info.begin = offsets[0].get<std::uint64_t>();
  info.end = offsets[1].get<std::uint64_t>();
  KMAMBA_REQUIRE(info.begin <= info.end && info.end <= data_size, where << ": data_offsets [" << info.begin << ", "
                                                                        << info.end << "] lie outside the " << data_size
                                                                        << "-byte data section");
  KMAMBA_REQUIRE(info.end - info.begin == numel * dtype_size(info.dtype),
                 where << ": " << info.end - info.begin << " bytes for " << dtype << " " << shape_string(info.shape)
                       << ", which needs " << numel * dtype_size(info.dtype));
  return info;
}

}  // namespace

const char* dtype_name(DType dtype) {
  for (const auto& entry : dtype_table) {
    if (entry.second == dtype) return entry.first;
  }
  KMAMBA_ASSERT(false, "dtype_name: unknown dtype " << static_cast<int>(dtype));
  return "";
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F64:
    case DType::I64:
      return 8;
    case DType::F32:
    case DType::I32:
      return 4;
    case DType::F16:
    case DType::BF16:
    case DType::I16:
      return 2;
    case DType::I8:
    case DType::U8:
    case DType::Bool:
      return 1;
  }
  KMAMBA_ASSERT(false, "dtype_size: unknown dtype " << static_cast<int>(dtype));
  return 0;
}

std::int64_t TensorInfo::numel() const {
  std::int64_t n = 1;
  for (const std::int64_t d : shape) n *= d;
  return n;
}

SafeTensorsReader::SafeTensorsReader(const std::string& path) : path_(path) {
  require_regular_file(path, "safetensors");  // a FIFO would block the open below forever
  std::ifstream in(path, std::ios::binary);
  KMAMBA_REQUIRE(in.good(), "safetensors: cannot open '" << path << "': " << std::strerror(errno));
  in.seekg(0, std::ios::end);
  const std::uint64_t file_size = static_cast<std::uint64_t>(in.tellg());
  in.seekg(0, std::ios::beg);
  KMAMBA_REQUIRE(file_size >= 8,
                 "safetensors: '" << path << "' is " << file_size << " bytes, shorter than the 8-byte header length");
  unsigned char length_bytes[8];
  in.read(reinterpret_cast<char*>(length_bytes), 8);
  std::uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i) header_length = (header_length << 8) | length_bytes[i];
  KMAMBA_REQUIRE(header_length <= file_size - 8, "safetensors: '" << path << "' declares a " << header_length
                                                                  << "-byte header but holds only " << file_size - 8
                                                                  << " bytes after the length");
  KMAMBA_REQUIRE(header_length <= max_header_bytes,
                 "safetensors: '" << path << "' declares a " << header_length << "-byte header (more than 100 MB)");
  std::string header(static_cast<std::size_t>(header_length), '\0');
  in.read(&header[0], static_cast<std::streamsize>(header_length));
  KMAMBA_REQUIRE(in.good(), "safetensors: reading the header of '" << path << "' failed");
  data_start_ = 8 + header_length;
  const std::uint64_t data_size = file_size - data_start_;

  // Duplicate tensor names would silently overwrite each other: parse_json refuses them.
  const nlohmann::json json = parse_json(header, "safetensors: the header of '" + path + "'");
  KMAMBA_REQUIRE(json.is_object(), "safetensors: the header of '" << path << "' is not a JSON object");

  for (auto it = json.begin(); it != json.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& value = it.value();
    if (name == "__metadata__") {
      KMAMBA_REQUIRE(value.is_object(), "safetensors: '" << path << "': __metadata__ is not an object");
      for (auto m = value.begin(); m != value.end(); ++m) {
        KMAMBA_REQUIRE(m.value().is_string(),
                       "safetensors: '" << path << "': metadata entry '" << m.key() << "' is not a string");
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    tensors_.emplace(name, parse_tensor(name, value, path, data_size));
  }

  std::vector<const TensorInfo*> by_offset;
  for (const auto& t : tensors_) by_offset.push_back(&t.second);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->begin < b->begin; });
  for (std::size_t i = 1; i < by_offset.size(); ++i) {
    KMAMBA_REQUIRE(by_offset[i]->begin >= by_offset[i - 1]->end || by_offset[i - 1]->begin == by_offset[i - 1]->end,
                   "safetensors: '" << path << "': tensors '" << by_offset[i - 1]->name << "' and '"
                                    << by_offset[i]->name << "' overlap");
  }
}

const TensorInfo& SafeTensorsReader::info(const std::string& name) const {
  const auto it = tensors_.find(name);
  KMAMBA_REQUIRE(it != tensors_.end(), "safetensors: '" << path_ << "' has no tensor named '" << name << "'");
  return it->second;
}

std::vector<std::string> SafeTensorsReader::names() const {
  std::vector<const TensorInfo*> by_offset;
  for (const auto& t : tensors_) by_offset.push_back(&t.second);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->name < b->name;
  });
  std::vector<std::string> out;
  for (const TensorInfo* t : by_offset) out.push_back(t->name);
  return out;
}

std::vector<unsigned char> SafeTensorsReader::read_bytes(const std::string& name) const {
  const TensorInfo& t = info(name);
  std::ifstream in(path_, std::ios::binary);
  KMAMBA_REQUIRE(in.good(), "safetensors: cannot reopen '" << path_ << "'");
  in.seekg(static_cast<std::streamoff>(data_start_ + t.begin));
  std::vector<unsigned char> bytes(static_cast<std::size_t>(t.end - t.begin));
  in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  KMAMBA_REQUIRE(in.good() || bytes.empty(),
                 "safetensors: reading tensor '" << name << "' of '" << path_ << "' failed (file changed?)");
  return bytes;
}

namespace {
// The parsed "config" metadata entry, or null when there is none.
nlohmann::json parsed_config(const std::map<std::string, std::string>& metadata, const std::string& path) {
  const auto it = metadata.find("config");
  if (it == metadata.end()) return nullptr;
  // Python's json module (the reference's writer) spells infinite floats as bare Infinity.
  nlohmann::json config =
      parse_json(spell_python_infinities(it->second), "safetensors: '" + path + "': metadata 'config'");
  KMAMBA_REQUIRE(config.is_object(), "safetensors: '" << path << "': metadata 'config' is not a JSON object");
  return config;
}
}  // namespace

bool SafeTensorsReader::config_bool(const std::string& key, bool fallback) const {
  const nlohmann::json config = parsed_config(metadata_, path_);
  if (config.is_null() || !config.contains(key)) return fallback;
  KMAMBA_REQUIRE(config[key].is_boolean(), "safetensors: '" << path_ << "': config '" << key << "' is "
                                                            << quote_json(config[key]) << ", not true or false");
  return config[key].get<bool>();
}

double SafeTensorsReader::config_number(const std::string& key, double fallback) const {
  const nlohmann::json config = parsed_config(metadata_, path_);
  if (config.is_null() || !config.contains(key)) return fallback;
  return json_number(config[key], "safetensors: '" + path_ + "': config '" + key + "'");
}

std::vector<double> SafeTensorsReader::config_numbers(const std::string& key,
                                                      const std::vector<double>& fallback) const {
  const nlohmann::json config = parsed_config(metadata_, path_);
  if (config.is_null() || !config.contains(key)) return fallback;
  const std::string where = "safetensors: '" + path_ + "': config '" + key + "'";
  KMAMBA_REQUIRE(config[key].is_array(), where << " is " << quote_json(config[key]) << ", not an array");
  std::vector<double> out;
  for (const nlohmann::json& v : config[key]) out.push_back(json_number(v, where));
  return out;
}

std::vector<float> SafeTensorsReader::read_f32(const std::string& name) const {
  const TensorInfo& t = info(name);
  const std::vector<unsigned char> bytes = read_bytes(name);
  const std::size_t n = static_cast<std::size_t>(t.numel());
  std::vector<float> out(n);
  switch (t.dtype) {
    case DType::F32:
      for (std::size_t i = 0; i < n; ++i) out[i] = load_le<float>(&bytes[4 * i]);
      break;
    case DType::F64:
      for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<float>(load_le<double>(&bytes[8 * i]));
      break;
    case DType::BF16:
      for (std::size_t i = 0; i < n; ++i) out[i] = bf16_to_float(load_le<std::uint16_t>(&bytes[2 * i]));
      break;
    case DType::F16:
      for (std::size_t i = 0; i < n; ++i) out[i] = half_to_float(load_le<std::uint16_t>(&bytes[2 * i]));
      break;
    default:
      KMAMBA_USER_ERROR("safetensors: tensor '" << name << "' of '" << path_ << "' has dtype " << dtype_name(t.dtype)
                                                << ", expected a floating-point dtype");
  }
  return out;
}

std::vector<std::int64_t> SafeTensorsReader::read_i64(const std::string& name) const {
  const TensorInfo& t = info(name);
  const std::vector<unsigned char> bytes = read_bytes(name);
  const std::size_t n = static_cast<std::size_t>(t.numel());
  std::vector<std::int64_t> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    switch (t.dtype) {
      case DType::I64:
        out[i] = load_le<std::int64_t>(&bytes[8 * i]);
        break;
      case DType::I32:
        out[i] = load_le<std::int32_t>(&bytes[4 * i]);
        break;
      case DType::I16:
        out[i] = load_le<std::int16_t>(&bytes[2 * i]);
        break;
      case DType::I8:
        out[i] = static_cast<std::int8_t>(bytes[i]);
        break;
      case DType::U8:
      case DType::Bool:
        out[i] = bytes[i];
        break;
      default:
        KMAMBA_USER_ERROR("safetensors: tensor '" << name << "' of '" << path_ << "' has dtype " << dtype_name(t.dtype)
                                                  << ", expected an integer dtype");
    }
  }
  return out;
}

void SafeTensorsReader::check_shape(const std::string& name, const std::vector<std::int64_t>& expected) const {
  const TensorInfo& t = info(name);
  KMAMBA_REQUIRE(t.shape == expected, "safetensors: tensor '" << name << "' of '" << path_ << "' has shape "
                                                              << shape_string(t.shape) << " but "
                                                              << shape_string(expected) << " was expected");
}

void SafeTensorsWriter::add(const std::string& name, DType dtype, const std::vector<std::int64_t>& shape,
                            const void* data) {
  KMAMBA_REQUIRE(!name.empty() && name != "__metadata__", "safetensors: invalid tensor name '" << name << "'");
  KMAMBA_REQUIRE(tensors_.count(name) == 0, "safetensors: tensor '" << name << "' added twice");
  std::size_t numel = 1;
  for (const std::int64_t d : shape) {
    KMAMBA_REQUIRE(d >= 0, "safetensors: tensor '" << name << "' has negative extent in " << shape_string(shape));
    numel *= static_cast<std::size_t>(d);
  }
  Pending p{dtype, shape, std::vector<unsigned char>(numel * dtype_size(dtype))};
  if (!p.bytes.empty()) std::memcpy(p.bytes.data(), data, p.bytes.size());
  tensors_.emplace(name, std::move(p));
  order_.push_back(name);
}

void SafeTensorsWriter::add_f32(const std::string& name, const std::vector<std::int64_t>& shape,
                                const std::vector<float>& values) {
  std::size_t numel = 1;
  for (const std::int64_t d : shape) numel *= static_cast<std::size_t>(std::max<std::int64_t>(d, 0));
  KMAMBA_REQUIRE(values.size() == numel, "safetensors: tensor '" << name << "' of shape " << shape_string(shape)
                                                                 << " given " << values.size() << " values");
  add(name, DType::F32, shape, values.data());
}

void SafeTensorsWriter::add_i64(const std::string& name, const std::vector<std::int64_t>& shape,
                                const std::vector<std::int64_t>& values) {
  std::size_t numel = 1;
  for (const std::int64_t d : shape) numel *= static_cast<std::size_t>(std::max<std::int64_t>(d, 0));
  KMAMBA_REQUIRE(values.size() == numel, "safetensors: tensor '" << name << "' of shape " << shape_string(shape)
                                                                 << " given " << values.size() << " values");
  add(name, DType::I64, shape, values.data());
}

void SafeTensorsWriter::write(const std::string& path) const {
  nlohmann::json header = nlohmann::json::object();
  std::uint64_t offset = 0;
  for (const std::string& name : order_) {
    const Pending& p = tensors_.at(name);
    header[name] = {
        {"dtype", dtype_name(p.dtype)}, {"shape", p.shape}, {"data_offsets", {offset, offset + p.bytes.size()}}};
    offset += p.bytes.size();
  }
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // align the data section to 8 bytes

  unsigned char length_bytes[8];
  const std::uint64_t length = text.size();
  for (int i = 0; i < 8; ++i) length_bytes[i] = static_cast<unsigned char>((length >> (8 * i)) & 0xffu);
  OutputFile out(path, "safetensors");
  out.write(length_bytes, 8);
  out.write(text);
  for (const std::string& name : order_) {
    const Pending& p = tensors_.at(name);
    out.write(p.bytes.data(), p.bytes.size());
  }
  out.commit();
}

}  // namespace kmamba
