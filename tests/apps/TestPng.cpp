#include "Plot.hpp"
#include "Png.hpp"

#include <kmamba/core/Error.hpp>

#include <gtest/gtest.h>

#if KMAMBA_TEST_HAVE_ZLIB
#include <zlib.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace {

using kmamba::app::Image;
using kmamba::app::Rgb;

std::uint32_t be32(const std::vector<std::uint8_t>& b, std::size_t at) {
  return (std::uint32_t{b[at]} << 24) | (std::uint32_t{b[at + 1]} << 16) | (std::uint32_t{b[at + 2]} << 8) | b[at + 3];
}

struct Chunk {
  std::string type;
  std::vector<std::uint8_t> data;
};

// Splits a PNG file into its chunks, checking the signature, every length and every CRC.
std::vector<Chunk> parse_png(const std::vector<std::uint8_t>& png) {
  const std::vector<std::uint8_t> signature = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  EXPECT_GE(png.size(), signature.size());
  EXPECT_TRUE(std::equal(signature.begin(), signature.end(), png.begin()));
  std::vector<Chunk> chunks;
  std::size_t at = signature.size();
  while (at + 12 <= png.size()) {
    const std::uint32_t length = be32(png, at);
    EXPECT_LE(at + 12 + length, png.size());
    Chunk c;
    c.type.assign(png.begin() + static_cast<std::ptrdiff_t>(at + 4), png.begin() + static_cast<std::ptrdiff_t>(at + 8));
    c.data.assign(png.begin() + static_cast<std::ptrdiff_t>(at + 8),
                  png.begin() + static_cast<std::ptrdiff_t>(at + 8 + length));
    EXPECT_EQ(kmamba::app::crc32(png.data() + at + 4, length + 4), be32(png, at + 8 + length)) << "chunk " << c.type;
    chunks.push_back(c);
    at += 12 + length;
  }
  EXPECT_EQ(at, png.size());
  return chunks;
}

TEST(Png, ChecksumsMatchTheirStandards) {
  const std::string text = "123456789";
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(text.data());
  EXPECT_EQ(kmamba::app::crc32(bytes, text.size()), 0xCBF43926u);    // the CRC-32 check value
  EXPECT_EQ(kmamba::app::adler32(bytes, text.size()), 0x091E01DEu);  // Adler-32 of "123456789"
  EXPECT_EQ(kmamba::app::crc32(bytes + 4, 5, kmamba::app::crc32(bytes, 4)), 0xCBF43926u);
}

TEST(Png, FileHasValidChunksAndCompressesPlots) {
  Image image(300, 200, Rgb{255, 255, 255});
  for (int x = 0; x < 300; ++x) image.set(x, 100 + static_cast<int>(50 * std::sin(x / 20.0)), Rgb{200, 30, 30});
  image.set(-1, 5, Rgb{});  // outside: ignored
  const std::vector<std::uint8_t> png = kmamba::app::encode_png(image);
  const std::vector<Chunk> chunks = parse_png(png);
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[0].type, "IHDR");
  EXPECT_EQ(be32(chunks[0].data, 0), 300u);
  EXPECT_EQ(be32(chunks[0].data, 4), 200u);
  EXPECT_EQ(chunks[0].data[8], 8);  // bit depth
  EXPECT_EQ(chunks[0].data[9], 2);  // RGB
  EXPECT_EQ(chunks[1].type, "IDAT");
  EXPECT_EQ(chunks[2].type, "IEND");
  EXPECT_LT(png.size(), 300u * 200u * 3u / 10u) << "a mostly blank image should compress well";
  EXPECT_EQ((chunks[1].data[0] * 256 + chunks[1].data[1]) % 31, 0) << "zlib header check bits";

#if KMAMBA_TEST_HAVE_ZLIB
  std::vector<std::uint8_t> raw((1 + 300 * 3) * 200 + 16);
  uLongf raw_size = static_cast<uLongf>(raw.size());
  ASSERT_EQ(uncompress(raw.data(), &raw_size, chunks[1].data.data(), static_cast<uLong>(chunks[1].data.size())), Z_OK);
  ASSERT_EQ(raw_size, (1u + 300u * 3u) * 200u);
  for (int y = 0; y < 200; ++y) {
    ASSERT_EQ(raw[static_cast<std::size_t>(y) * 901], 0) << "filter byte of row " << y;
    for (int x = 0; x < 300; ++x) {
      const Rgb p = image.get(x, y);
      const std::size_t at = static_cast<std::size_t>(y) * 901 + 1 + static_cast<std::size_t>(x) * 3;
      ASSERT_TRUE(raw[at] == p.r && raw[at + 1] == p.g && raw[at + 2] == p.b) << "pixel " << x << ", " << y;
    }
  }
#endif
}

TEST(Png, NoisyDataRoundTripsThroughTheEncoder) {
  // Literals and long and short matches of every kind: the zlib stream must still decode.
  std::vector<std::uint8_t> data;
  std::uint32_t state = 12345;
  for (int i = 0; i < 70000; ++i) {
    state = state * 1103515245u + 12345u;
    data.push_back(static_cast<std::uint8_t>(i % 7 == 0 ? (state >> 24) : (i / 300) & 0xff));
  }
  const std::vector<std::uint8_t> z = kmamba::app::zlib_compress(data, 301);
  ASSERT_GE(z.size(), 6u);
  const std::uint32_t adler = be32(z, z.size() - 4);
  EXPECT_EQ(adler, kmamba::app::adler32(data.data(), data.size()));
#if KMAMBA_TEST_HAVE_ZLIB
  std::vector<std::uint8_t> back(data.size() + 16);
  uLongf size = static_cast<uLongf>(back.size());
  ASSERT_EQ(uncompress(back.data(), &size, z.data(), static_cast<uLong>(z.size())), Z_OK);
  back.resize(size);
  EXPECT_EQ(back, data);
#endif
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
  std::ifstream in(path, std::ios::binary);
  const std::vector<std::uint8_t> file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(file, kmamba::app::encode_png(image));
  std::remove(path.c_str());
  EXPECT_THROW(kmamba::app::write_png("/nonexistent-dir/x.png", image), kmamba::UserError);
  EXPECT_THROW(kmamba::app::plot({}, "step", 640, 480), kmamba::UserError);
  EXPECT_THROW(Image(0, 5, Rgb{}), kmamba::UserError);
}

}  // namespace
