// An RGB image and its PNG file, written through libpng (8-bit RGB, zlib-compressed).
//
//   kmamba::app::Image image(640, 480, kmamba::app::Rgb{255, 255, 255});
//   image.set(10, 20, {0, 0, 0});
//   kmamba::app::write_png("plot.png", image);
#ifndef KMAMBA_APPS_COMMON_PNG_HPP
#define KMAMBA_APPS_COMMON_PNG_HPP

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

/// The PNG file of `image` (8-bit RGB, encoded by libpng).
std::vector<std::uint8_t> encode_png(const Image& image);
/// Writes encode_png(image) to `path` through kmamba::write_output_file (atomically for a regular
/// file); throws kmamba::UserError naming the path if it cannot.
void write_png(const std::string& path, const Image& image);

}  // namespace app
}  // namespace kmamba

#endif
