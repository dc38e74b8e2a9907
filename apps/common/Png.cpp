#include "Png.hpp"

#include <kmamba/core/Error.hpp>
#include <kmamba/core/Files.hpp>

#include <png.h>

namespace kmamba {
namespace app {

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

std::vector<std::uint8_t> encode_png(const Image& image) {
  png_image png{};
  png.version = PNG_IMAGE_VERSION;
  png.width = static_cast<png_uint_32>(image.width());
  png.height = static_cast<png_uint_32>(image.height());
  png.format = PNG_FORMAT_RGB;
  // libpng's bound on the encoded size of an image of this size and format.
  png_alloc_size_t size = PNG_IMAGE_PNG_SIZE_MAX(png);
  std::vector<std::uint8_t> encoded(size);
  const bool ok = png_image_write_to_memory(&png, encoded.data(), &size, 0, image.pixels().data(), 0, nullptr) != 0;
  const std::string libpng_message = png.message;  // libpng's reason when `ok` is false
  png_image_free(&png);
  KMAMBA_REQUIRE(ok, "kmamba::app::encode_png: libpng failed on a " << image.width() << " x " << image.height()
                                                                    << " image: " << libpng_message);
  encoded.resize(size);
  return encoded;
}

void write_png(const std::string& path, const Image& image) {
  const std::vector<std::uint8_t> png = encode_png(image);
  write_output_file(path, png.data(), png.size(), "kmamba::app::write_png");
}

}  // namespace app
}  // namespace kmamba
