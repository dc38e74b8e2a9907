#include "Plot.hpp"
#include "Png.hpp"

#include <kmamba/core/Error.hpp>

#include <gtest/gtest.h>

#include <png.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace {

using kmamba::app::Image;
using kmamba::app::Rgb;

// A PNG file decoded by libpng: its size and RGB pixels (empty if libpng cannot read it).
struct Decoded {
  int width = 0, height = 0;
  std::vector<std::uint8_t> pixels;
};

Decoded read_png(const std::string& path) {
  png_image png{};
  png.version = PNG_IMAGE_VERSION;
  Decoded d;
  if (png_image_begin_read_from_file(&png, path.c_str()) == 0) {
    ADD_FAILURE() << "libpng cannot read '" << path << "': " << png.message;
    return d;
  }
  png.format = PNG_FORMAT_RGB;
  std::vector<std::uint8_t> pixels(PNG_IMAGE_SIZE(png));
  if (png_image_finish_read(&png, nullptr, pixels.data(), 0, nullptr) == 0) {
    ADD_FAILURE() << "libpng cannot decode '" << path << "': " << png.message;
    png_image_free(&png);
    return d;
  }
  d.width = static_cast<int>(png.width);
  d.height = static_cast<int>(png.height);
  d.pixels = std::move(pixels);
  return d;
}

std::vector<std::uint8_t> file_bytes(const std::string& path) {
  std::vector<std::uint8_t> bytes;
  if (std::FILE* f = std::fopen(path.c_str(), "rb")) {
    for (int c = std::fgetc(f); c != EOF; c = std::fgetc(f)) bytes.push_back(static_cast<std::uint8_t>(c));
    std::fclose(f);
  }
  return bytes;
}

TEST(Png, FileDecodesToTheImageAndCompressesPlots) {
  Image image(300, 200, Rgb{255, 255, 255});
  for (int x = 0; x < 300; ++x) image.set(x, 100 + static_cast<int>(50 * std::sin(x / 20.0)), Rgb{200, 30, 30});
  image.set(-1, 5, Rgb{});  // outside: ignored
  const std::string path = ::testing::TempDir() + "kmamba_test_png.png";
  kmamba::app::write_png(path, image);
  const std::vector<std::uint8_t> bytes = file_bytes(path);
  const Decoded back = read_png(path);
  std::remove(path.c_str());
  EXPECT_EQ(back.width, 300);
  EXPECT_EQ(back.height, 200);
  EXPECT_EQ(back.pixels, image.pixels());
  EXPECT_LT(bytes.size(), 300u * 200u * 3u / 10u) << "a mostly blank image should compress well";
  EXPECT_TRUE(file_bytes(path + ".tmp").empty()) << "the temporary file must be renamed away";
}

TEST(Png, PlotDrawsIntoTheImageAndWritesAFile) {
  kmamba::app::Series train{"train", Rgb{31, 119, 180}, {}, {}, false};
  for (int i = 0; i < 200; ++i) {
    train.x.push_back(i);
    train.y.push_back(5.0 * std::exp(-i / 40.0) + 0.01);
  }
  kmamba::app::Series eval{"eval", Rgb{255, 127, 14}, {0, 100, 199}, {5.0, 0.7, 0.05}, true};
  kmamba::app::Panel loss{"loss", true, {train, eval}};
  kmamba::app::Panel accuracy{
      "accuracy %", false, {{"eval", Rgb{255, 127, 14}, {0, 100, 199}, {1.0, 40.0, 99.0}, true}}};
  const Image image = kmamba::app::plot({loss, accuracy}, "step", 640, 480);
  int colored = 0;
  for (int y = 0; y < image.height(); ++y) {
    for (int x = 0; x < image.width(); ++x) {
      const Rgb p = image.get(x, y);
      colored += (p.r == 31 && p.g == 119 && p.b == 180) ? 1 : 0;
    }
  }
  EXPECT_GT(colored, 200) << "the train curve should be drawn";
  const std::string path = ::testing::TempDir() + "kmamba_test_plot.png";
  kmamba::app::write_png(path, image);
  const Decoded back = read_png(path);
  std::remove(path.c_str());
  EXPECT_EQ(back.width, 640);
  EXPECT_EQ(back.height, 480);
  EXPECT_EQ(back.pixels, image.pixels());
  EXPECT_THROW(kmamba::app::write_png("/nonexistent-dir/x.png", image), kmamba::UserError);
  EXPECT_THROW(kmamba::app::plot({}, "step", 640, 480), kmamba::UserError);
  EXPECT_THROW(Image(0, 5, Rgb{}), kmamba::UserError);
}

}  // namespace
