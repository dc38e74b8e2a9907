// Reading and writing .safetensors files (the Hugging Face checkpoint format):
//   8-byte little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ..., "__metadata__": {str: str}},
//   then the tensor bytes (offsets relative to the end of the header).
//
// The reader validates everything before it trusts it: header length, JSON, dtypes, shapes,
// offsets inside the file, sizes that match dtype x shape, overlapping ranges and duplicate names
// each give a kmamba::UserError naming the file and the tensor; so do a header nested too deep
// and a file that is not a regular one (a FIFO). The writer writes through kmamba::OutputFile
// (kmamba/core/Files.hpp): a regular file is replaced atomically (temporary file, flush, rename),
// so a reader sees either the old file or the new one, never half of one; symbolic links are
// followed and a device or a FIFO is written in place, never replaced.
#ifndef KMAMBA_MODELS_SAFETENSORS_HPP
#define KMAMBA_MODELS_SAFETENSORS_HPP

#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace kmamba {

enum class DType { F64, F32, F16, BF16, I64, I32, I16, I8, U8, Bool };

/// "F32", "BF16", ... as written in safetensors headers.
const char* dtype_name(DType dtype);
/// Bytes per element.
std::size_t dtype_size(DType dtype);

/// One tensor of a safetensors file.
struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;  // byte range within the data section
  std::uint64_t end = 0;
  /// Product of the extents (1 for a scalar).
  std::int64_t numel() const;
};

class SafeTensorsReader {
 public:
  /// Opens `path` and validates its header; throws kmamba::UserError on any malformed content.
  explicit SafeTensorsReader(const std::string& path);

  const std::string& path() const { return path_; }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  /// Throws kmamba::UserError naming the file and the tensor if absent.
  const TensorInfo& info(const std::string& name) const;
  /// Tensor names in file order (by data offset).
  std::vector<std::string> names() const;
  /// The "__metadata__" entries (empty if the file has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  /// Fields of the JSON object stored in the metadata entry "config" (how reference tools record an
  /// op's attributes). Absent entry or key -> `fallback`; a value of the wrong type is a UserError.
  /// Numbers may be written as the strings "inf", "-inf" or "Infinity".
  bool config_bool(const std::string& key, bool fallback) const;
  double config_number(const std::string& key, double fallback) const;
  std::vector<double> config_numbers(const std::string& key, const std::vector<double>& fallback) const;

  /// Values converted to float from F32, F64, F16 or BF16.
  std::vector<float> read_f32(const std::string& name) const;
  /// Values converted to int64 from I64, I32, I16, I8, U8 or Bool.
  std::vector<std::int64_t> read_i64(const std::string& name) const;
  /// The raw little-endian bytes of one tensor.
  std::vector<unsigned char> read_bytes(const std::string& name) const;

  /// Throws kmamba::UserError unless tensor `name` has exactly `expected` as its shape.
  void check_shape(const std::string& name, const std::vector<std::int64_t>& expected) const;

 private:
  std::string path_;
  std::uint64_t data_start_ = 0;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

class SafeTensorsWriter {
 public:
  /// Adds a tensor; `data` holds numel x dtype_size bytes, little-endian. Names must be unique.
  void add(const std::string& name, DType dtype, const std::vector<std::int64_t>& shape, const void* data);
  void add_f32(const std::string& name, const std::vector<std::int64_t>& shape, const std::vector<float>& values);
  void add_i64(const std::string& name, const std::vector<std::int64_t>& shape,
               const std::vector<std::int64_t>& values);
  void set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

  /// Writes the file through kmamba::OutputFile. Throws kmamba::UserError if the directory is not
  /// writable or the disk is full; the previous file, if any, is then untouched.
  void write(const std::string& path) const;

 private:
  struct Pending {
    DType dtype;
    std::vector<std::int64_t> shape;
    std::vector<unsigned char> bytes;
  };
  std::map<std::string, Pending> tensors_;
  std::vector<std::string> order_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace kmamba

#endif
