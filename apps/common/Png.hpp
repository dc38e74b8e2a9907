// A small self-contained PNG writer (8-bit RGB, no external library): the image rows go through a
// deflate encoder with fixed Huffman codes and back-references to the previous pixel and the row
// above (what plots are made of), wrapped in zlib and PNG chunks with their CRC-32s.
//
//   kmamba::app::Image image(640, 480, kmamba::app::Rgb{255, 255, 255});
//   image.set(10, 20, {0, 0, 0});
//   kmamba::app::write_png("plot.png", image);
#ifndef KMAMBA_APPS_COMMON_PNG_HPP
#define KMAMBA_APPS_COMMON_PNG_HPP

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kmamba {
namespace app {

struct Rgb {
  std::uint8_t r = 0, g = 0, b = 0;
};

/// An RGB image, row-major from the top-left corner.
class Image {
 public:
  Image(int width, int height, Rgb background);
  int width() const { return width_; }
  int height() const { return height_; }
  /// Sets pixel (x, y); coordinates outside the image are ignored.
  void set(int x, int y, Rgb color);
  Rgb get(int x, int y) const;
  /// width · height · 3 bytes, R G B per pixel.
  const std::vector<std::uint8_t>& pixels() const { return pixels_; }

 private:
  int width_, height_;
  std::vector<std::uint8_t> pixels_;
};

/// CRC-32 (ISO-HDLC, as PNG uses) of `size` bytes, continuing from `crc` (0 to start).
std::uint32_t crc32(const std::uint8_t* data, std::size_t size, std::uint32_t crc = 0);
/// Adler-32 (as zlib uses) of `size` bytes.
std::uint32_t adler32(const std::uint8_t* data, std::size_t size);
/// `data` as a zlib stream (RFC 1950) of one fixed-Huffman deflate block (RFC 1951).
std::vector<std::uint8_t> zlib_compress(const std::vector<std::uint8_t>& data, std::size_t row_bytes);
/// The PNG file of `image`.
std::vector<std::uint8_t> encode_png(const Image& image);
/// Writes encode_png(image) to `path` through kmamba::write_output_file (atomically for a regular
/// file); throws kmamba::UserError if it cannot.
void write_png(const std::string& path, const Image& image);

}  // namespace app
}  // namespace kmamba

#endif
