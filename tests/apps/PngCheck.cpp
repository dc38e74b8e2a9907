// Helper of the app tests that write plots (CheckPngOutput.cmake, CheckRunDirectory.cmake): decodes
// the PNG file an app wrote with libpng, independently of the apps' writer, and exits 0 only if it
// decodes, is at least MIN_WIDTH × MIN_HEIGHT pixels and is not one flat colour (a chart drew
// something into it). Otherwise it exits 1 with a message naming the file; bad arguments exit 2.
//
//   kmamba_png_check FILE.png MIN_WIDTH MIN_HEIGHT
#include <png.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

// A pixel count in [1, 100000] from argv, or -1 (after a message naming the argument).
long parse_size(const char* name, const char* text) {
  char* end = nullptr;
  errno = 0;
  const long value = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || errno != 0 || value < 1 || value > 100000) {
    std::fprintf(stderr, "kmamba_png_check: %s: got '%s', expected an integer in [1, 100000]\n", name, text);
    return -1;
  }
  return value;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s FILE.png MIN_WIDTH MIN_HEIGHT\n", argv[0]);
    return 2;
  }
  const char* path = argv[1];
  const long min_width = parse_size("MIN_WIDTH", argv[2]);
  const long min_height = parse_size("MIN_HEIGHT", argv[3]);
  if (min_width < 0 || min_height < 0) return 2;

  png_image png{};
  png.version = PNG_IMAGE_VERSION;
  if (png_image_begin_read_from_file(&png, path) == 0) {
    std::fprintf(stderr, "kmamba_png_check: libpng cannot read '%s': %s\n", path, png.message);
    return 1;
  }
  png.format = PNG_FORMAT_RGB;
  std::vector<std::uint8_t> pixels(PNG_IMAGE_SIZE(png));
  if (png_image_finish_read(&png, nullptr, pixels.data(), 0, nullptr) == 0) {
    std::fprintf(stderr, "kmamba_png_check: libpng cannot decode '%s': %s\n", path, png.message);
    png_image_free(&png);
    return 1;
  }
  if (png.width < static_cast<png_uint_32>(min_width) || png.height < static_cast<png_uint_32>(min_height)) {
    std::fprintf(stderr, "kmamba_png_check: '%s' is %u × %u pixels, expected at least %ld × %ld\n", path,
                 static_cast<unsigned>(png.width), static_cast<unsigned>(png.height), min_width, min_height);
    return 1;
  }
  // Every pixel against the first: one colour everywhere means nothing was drawn.
  bool flat = true;
  for (std::size_t i = 3; i < pixels.size() && flat; i += 3) {
    flat = pixels[i] == pixels[0] && pixels[i + 1] == pixels[1] && pixels[i + 2] == pixels[2];
  }
  if (flat) {
    std::fprintf(stderr, "kmamba_png_check: '%s' is one flat colour (RGB %u %u %u): nothing was drawn\n", path,
                 unsigned{pixels[0]}, unsigned{pixels[1]}, unsigned{pixels[2]});
    return 1;
  }
  std::printf("kmamba_png_check: '%s' decodes, %u × %u pixels, not one flat colour\n", path,
              static_cast<unsigned>(png.width), static_cast<unsigned>(png.height));
  return 0;
}
