#include "Png.hpp"

#include <kmamba/core/Error.hpp>
#include <kmamba/core/Files.hpp>

#include <algorithm>
#include <array>

namespace kmamba {
namespace app {
namespace {

// Writes bits least-significant first, as deflate packs them.
class BitWriter {
 public:
  explicit BitWriter(std::vector<std::uint8_t>& out) : out_(out) {}
  void bits(std::uint32_t value, int count) {
    for (int i = 0; i < count; ++i) {
      if (used_ == 0) out_.push_back(0);
      out_.back() = static_cast<std::uint8_t>(out_.back() | (((value >> i) & 1u) << used_));
      used_ = (used_ + 1) & 7;
    }
  }
  // Huffman codes are defined most-significant bit first.
  void code(std::uint32_t code, int length) {
    std::uint32_t reversed = 0;
    for (int i = 0; i < length; ++i) reversed |= ((code >> i) & 1u) << (length - 1 - i);
    bits(reversed, length);
  }

 private:
  std::vector<std::uint8_t>& out_;
  int used_ = 0;
};

// The fixed literal/length code of RFC 1951 §3.2.6.
void literal_length_symbol(BitWriter& w, int symbol) {
  if (symbol < 144) {
    w.code(static_cast<std::uint32_t>(0x30 + symbol), 8);
  } else if (symbol < 256) {
    w.code(static_cast<std::uint32_t>(0x190 + symbol - 144), 9);
  } else if (symbol < 280) {
    w.code(static_cast<std::uint32_t>(symbol - 256), 7);
  } else {
    w.code(static_cast<std::uint32_t>(0xC0 + symbol - 280), 8);
  }
}

constexpr std::array<int, 29> length_base = {3,  4,  5,  6,  7,  8,  9,  10, 11,  13,  15,  17,  19,  23, 27,
                                             31, 35, 43, 51, 59, 67, 83, 99, 115, 131, 163, 195, 227, 258};
constexpr std::array<int, 29> length_extra = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2,
                                              2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0};
constexpr std::array<int, 30> distance_base = {1,    2,    3,    4,    5,    7,    9,    13,    17,    25,
                                               33,   49,   65,   97,   129,  193,  257,  385,   513,   769,
                                               1025, 1537, 2049, 3073, 4097, 6145, 8193, 12289, 16385, 24577};
constexpr std::array<int, 30> distance_extra = {0, 0, 0, 0, 1, 1, 2, 2,  3,  3,  4,  4,  5,  5,  6,
                                                6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13};

void match(BitWriter& w, int length, int distance) {
  int l = 28;
  while (length_base[static_cast<std::size_t>(l)] > length) --l;
  literal_length_symbol(w, 257 + l);
  w.bits(static_cast<std::uint32_t>(length - length_base[static_cast<std::size_t>(l)]),
         length_extra[static_cast<std::size_t>(l)]);
  int d = 29;
  while (distance_base[static_cast<std::size_t>(d)] > distance) --d;
  w.code(static_cast<std::uint32_t>(d), 5);
  w.bits(static_cast<std::uint32_t>(distance - distance_base[static_cast<std::size_t>(d)]),
         distance_extra[static_cast<std::size_t>(d)]);
}

void put_be32(std::vector<std::uint8_t>& out, std::uint32_t x) {
  for (int i = 3; i >= 0; --i) out.push_back(static_cast<std::uint8_t>((x >> (8 * i)) & 0xffu));
}

void chunk(std::vector<std::uint8_t>& png, const char type[4], const std::vector<std::uint8_t>& data) {
  put_be32(png, static_cast<std::uint32_t>(data.size()));
  const std::size_t start = png.size();
  png.insert(png.end(), type, type + 4);
  png.insert(png.end(), data.begin(), data.end());
  put_be32(png, crc32(png.data() + start, png.size() - start));
}

}  // namespace

Image::Image(int width, int height, Rgb background) : width_(width), height_(height) {
  KMAMBA_REQUIRE(width > 0 && height > 0 && width <= 16384 && height <= 16384,
                 "kmamba::app::Image: size " << width << " x " << height << " outside [1, 16384]");
  pixels_.resize(static_cast<std::size_t>(width) * static_cast<std::size_t>(height) * 3);
  for (std::size_t i = 0; i < pixels_.size(); i += 3) {
    pixels_[i] = background.r;
    pixels_[i + 1] = background.g;
    pixels_[i + 2] = background.b;
  }
}

void Image::set(int x, int y, Rgb color) {
  if (x < 0 || y < 0 || x >= width_ || y >= height_) return;
  const std::size_t i =
      (static_cast<std::size_t>(y) * static_cast<std::size_t>(width_) + static_cast<std::size_t>(x)) * 3;
  pixels_[i] = color.r;
  pixels_[i + 1] = color.g;
  pixels_[i + 2] = color.b;
}

Rgb Image::get(int x, int y) const {
  KMAMBA_REQUIRE(x >= 0 && y >= 0 && x < width_ && y < height_,
                 "kmamba::app::Image::get: (" << x << ", " << y << ") is outside the image");
  const std::size_t i =
      (static_cast<std::size_t>(y) * static_cast<std::size_t>(width_) + static_cast<std::size_t>(x)) * 3;
  return Rgb{pixels_[i], pixels_[i + 1], pixels_[i + 2]};
}

std::uint32_t crc32(const std::uint8_t* data, std::size_t size, std::uint32_t crc) {
  static const std::array<std::uint32_t, 256> table = [] {
    std::array<std::uint32_t, 256> t{};
    for (std::uint32_t n = 0; n < 256; ++n) {
      std::uint32_t c = n;
      for (int k = 0; k < 8; ++k) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[n] = c;
    }
    return t;
  }();
  crc = ~crc;
  for (std::size_t i = 0; i < size; ++i) crc = table[(crc ^ data[i]) & 0xffu] ^ (crc >> 8);
  return ~crc;
}

std::uint32_t adler32(const std::uint8_t* data, std::size_t size) {
  std::uint32_t a = 1, b = 0;
  for (std::size_t i = 0; i < size; ++i) {
    a = (a + data[i]) % 65521u;
    b = (b + a) % 65521u;
  }
  return (b << 16) | a;
}

std::vector<std::uint8_t> zlib_compress(const std::vector<std::uint8_t>& data, std::size_t row_bytes) {
  std::vector<std::uint8_t> out = {0x78, 0x01};  // deflate, 32 KiB window, no dictionary; (0x7801 % 31 == 0)
  BitWriter w(out);
  w.bits(1, 1);  // final block
  w.bits(1, 2);  // fixed Huffman codes
  // Candidate back-references: the previous byte, the previous RGB pixel and the row above.
  const std::size_t candidates[] = {1, 3, row_bytes};
  std::size_t i = 0;
  while (i < data.size()) {
    std::size_t best_length = 0, best_distance = 0;
    for (const std::size_t d : candidates) {
      if (d == 0 || d > i || d > 32768) continue;
      std::size_t l = 0;
      while (l < 258 && i + l < data.size() && data[i + l] == data[i + l - d]) ++l;
      if (l > best_length) best_length = l, best_distance = d;
    }
    if (best_length >= 3) {
      match(w, static_cast<int>(best_length), static_cast<int>(best_distance));
      i += best_length;
    } else {
      literal_length_symbol(w, data[i]);
      ++i;
    }
  }
  literal_length_symbol(w, 256);  // end of block
  put_be32(out, adler32(data.data(), data.size()));
  return out;
}

std::vector<std::uint8_t> encode_png(const Image& image) {
  const auto width = static_cast<std::size_t>(image.width()), height = static_cast<std::size_t>(image.height());
  const std::size_t row_bytes = 1 + 3 * width;  // filter type 0 (none), then the row's pixels
  std::vector<std::uint8_t> raw;
  raw.reserve(row_bytes * height);
  for (std::size_t y = 0; y < height; ++y) {
    raw.push_back(0);
    const auto row = image.pixels().begin() + static_cast<std::ptrdiff_t>(y * width * 3);
    raw.insert(raw.end(), row, row + static_cast<std::ptrdiff_t>(width * 3));
  }
  std::vector<std::uint8_t> png = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  std::vector<std::uint8_t> header;
  put_be32(header, static_cast<std::uint32_t>(width));
  put_be32(header, static_cast<std::uint32_t>(height));
  header.insert(header.end(), {8, 2, 0, 0, 0});  // 8-bit RGB, deflate, adaptive filters, no interlace
  chunk(png, "IHDR", header);
  chunk(png, "IDAT", zlib_compress(raw, row_bytes));
  chunk(png, "IEND", {});
  return png;
}

void write_png(const std::string& path, const Image& image) {
  const std::vector<std::uint8_t> png = encode_png(image);
  write_output_file(path, png.data(), png.size(), "kmamba::app::write_png");
}

}  // namespace app
}  // namespace kmamba
