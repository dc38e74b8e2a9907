#include "Plot.hpp"

#include <kmamba/core/Error.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>

namespace kmamba {
namespace app {
namespace {

using Glyph = std::array<const char*, 7>;

// 5x7 glyphs, '#' = ink. Characters not listed draw as blanks.
const std::map<char, Glyph>& font() {
  static const std::map<char, Glyph> glyphs = {
      {'0', {".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."}},
      {'1', {"..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."}},
      {'2', {".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"}},
      {'3', {"#####", "...#.", "..#..", "...#.", "....#", "#...#", ".###."}},
      {'4', {"...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."}},
      {'5', {"#####", "#....", "####.", "....#", "....#", "#...#", ".###."}},
      {'6', {"..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."}},
      {'7', {"#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."}},
      {'8', {".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."}},
      {'9', {".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."}},
      {'.', {".....", ".....", ".....", ".....", ".....", ".##..", ".##.."}},
      {'-', {".....", ".....", ".....", ".###.", ".....", ".....", "....."}},
      {'+', {".....", "..#..", "..#..", "#####", "..#..", "..#..", "....."}},
      {'%', {"##...", "##..#", "...#.", "..#..", ".#...", "#..##", "...##"}},
      {'(', {"...#.", "..#..", ".#...", ".#...", ".#...", "..#..", "...#."}},
      {')', {".#...", "..#..", "...#.", "...#.", "...#.", "..#..", ".#..."}},
      {':', {".....", ".##..", ".##..", ".....", ".##..", ".##..", "....."}},
      {'/', {".....", "....#", "...#.", "..#..", ".#...", "#....", "....."}},
      {',', {".....", ".....", ".....", ".....", ".##..", "..#..", ".#..."}},
      {'=', {".....", ".....", "#####", ".....", "#####", ".....", "....."}},
      {'a', {".....", ".....", ".###.", "....#", ".####", "#...#", ".####"}},
      {'b', {"#....", "#....", "#.##.", "##..#", "#...#", "#...#", "####."}},
      {'c', {".....", ".....", ".###.", "#....", "#....", "#...#", ".###."}},
      {'d', {"....#", "....#", ".##.#", "#..##", "#...#", "#...#", ".####"}},
      {'e', {".....", ".....", ".###.", "#...#", "#####", "#....", ".###."}},
      {'f', {"..##.", ".#..#", ".#...", "###..", ".#...", ".#...", ".#..."}},
      {'g', {".....", ".####", "#...#", "#...#", ".####", "....#", ".###."}},
      {'h', {"#....", "#....", "#.##.", "##..#", "#...#", "#...#", "#...#"}},
      {'i', {"..#..", ".....", ".##..", "..#..", "..#..", "..#..", ".###."}},
      {'k', {"#....", "#....", "#..#.", "#.#..", "##...", "#.#..", "#..#."}},
      {'l', {".##..", "..#..", "..#..", "..#..", "..#..", "..#..", ".###."}},
      {'m', {".....", ".....", "##.#.", "#.#.#", "#.#.#", "#...#", "#...#"}},
      {'n', {".....", ".....", "#.##.", "##..#", "#...#", "#...#", "#...#"}},
      {'o', {".....", ".....", ".###.", "#...#", "#...#", "#...#", ".###."}},
      {'p', {".....", ".....", "####.", "#...#", "####.", "#....", "#...."}},
      {'r', {".....", ".....", "#.##.", "##..#", "#....", "#....", "#...."}},
      {'s', {".....", ".....", ".####", "#....", ".###.", "....#", "####."}},
      {'t', {".#...", ".#...", "###..", ".#...", ".#...", ".#..#", "..##."}},
      {'u', {".....", ".....", "#...#", "#...#", "#...#", "#..##", ".##.#"}},
      {'v', {".....", ".....", "#...#", "#...#", "#...#", ".#.#.", "..#.."}},
      {'w', {".....", ".....", "#...#", "#...#", "#.#.#", "#.#.#", ".#.#."}},
      {'x', {".....", ".....", "#...#", ".#.#.", "..#..", ".#.#.", "#...#"}},
      {'y', {".....", ".....", "#...#", "#...#", ".####", "....#", ".###."}},
      {'z', {".....", ".....", "#####", "...#.", "..#..", ".#...", "#####"}},
  };
  return glyphs;
}

constexpr int glyph_advance = 6;  // 5 columns and a space
const Rgb black{0, 0, 0};
const Rgb grid{225, 225, 225};
const Rgb label_gray{80, 80, 80};

int text_width(const std::string& text, int scale = 1) { return static_cast<int>(text.size()) * glyph_advance * scale; }

struct Rect {
  int x0, y0, x1, y1;  // inclusive
  bool contains(int x, int y) const { return x >= x0 && x <= x1 && y >= y0 && y <= y1; }
};

void line(Image& image, const Rect& clip, int x0, int y0, int x1, int y1, Rgb color) {
  const int dx = std::abs(x1 - x0), dy = -std::abs(y1 - y0);
  const int sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
  int err = dx + dy;
  for (;;) {
    if (clip.contains(x0, y0)) image.set(x0, y0, color);
    if (x0 == x1 && y0 == y1) break;
    const int e2 = 2 * err;
    if (e2 >= dy) err += dy, x0 += sx;
    if (e2 <= dx) err += dx, y0 += sy;
  }
}

void fill(Image& image, const Rect& r, Rgb color) {
  for (int y = r.y0; y <= r.y1; ++y) {
    for (int x = r.x0; x <= r.x1; ++x) image.set(x, y, color);
  }
}

// A "nice" tick spacing (1, 2 or 5 times a power of ten) giving about `count` intervals.
double nice_step(double range, int count) {
  const double raw = range / count;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  const double r = raw / magnitude;
  return magnitude * (r < 1.5 ? 1.0 : r < 3.5 ? 2.0 : r < 7.5 ? 5.0 : 10.0);
}

std::string format_number(double v) {
  char text[32];
  if (v != 0.0 && (std::fabs(v) >= 1e5 || std::fabs(v) < 1e-3)) {
    std::snprintf(text, sizeof(text), "%.0e", v);
  } else {
    std::snprintf(text, sizeof(text), "%g", v);
  }
  return text;
}

// Maps data values to pixel rows of a panel, linearly or by log10.
struct Axis {
  double lo = 0.0, hi = 1.0;
  bool log = false;
  double map(double v) const { return log ? (std::log10(v) - lo) / (hi - lo) : (v - lo) / (hi - lo); }
  bool valid(double v) const { return std::isfinite(v) && (!log || v > 0.0); }
};

Axis y_axis(const Panel& panel) {
  Axis a;
  a.log = panel.log_y;
  for (const Series& s : panel.series) {
    for (const double v : s.y) {
      if (a.log && std::isfinite(v) && v <= 0.0) a.log = false;
    }
  }
  double lo = INFINITY, hi = -INFINITY;
  for (const Series& s : panel.series) {
    for (const double v : s.y) {
      if (!a.valid(v)) continue;
      const double t = a.log ? std::log10(v) : v;
      lo = std::min(lo, t);
      hi = std::max(hi, t);
    }
  }
  if (!(lo <= hi)) lo = 0.0, hi = 1.0;
  if (hi - lo < 1e-12) lo -= a.log ? 0.5 : 1.0, hi += a.log ? 0.5 : 1.0;
  const double pad = 0.05 * (hi - lo);
  a.lo = lo - pad;
  a.hi = hi + pad;
  return a;
}

std::vector<double> y_ticks(const Axis& a) {
  std::vector<double> ticks;
  if (!a.log) {
    const double step = nice_step(a.hi - a.lo, 5);
    for (double t = std::ceil(a.lo / step) * step; t <= a.hi + 1e-9 * step; t += step)
      ticks.push_back(std::fabs(t) < 1e-12 * step ? 0.0 : t);
    return ticks;
  }
  const bool few_decades = a.hi - a.lo < 2.5;
  for (int e = static_cast<int>(std::floor(a.lo)); e <= static_cast<int>(std::ceil(a.hi)); ++e) {
    for (const double m : few_decades ? std::vector<double>{1, 2, 5} : std::vector<double>{1}) {
      const double v = m * std::pow(10.0, e);
      if (std::log10(v) >= a.lo && std::log10(v) <= a.hi) ticks.push_back(v);
    }
  }
  return ticks;
}

}  // namespace

void draw_text(Image& image, int x, int y, const std::string& text, Rgb color, int scale) {
  for (std::size_t i = 0; i < text.size(); ++i) {
    const auto glyph = font().find(text[i]);
    if (glyph == font().end()) continue;
    for (int row = 0; row < 7; ++row) {
      for (int col = 0; col < 5; ++col) {
        if (glyph->second[static_cast<std::size_t>(row)][col] != '#') continue;
        for (int sy = 0; sy < scale; ++sy) {
          for (int sx = 0; sx < scale; ++sx) {
            image.set(x + (static_cast<int>(i) * glyph_advance + col) * scale + sx, y + row * scale + sy, color);
          }
        }
      }
    }
  }
}

Image plot(const std::vector<Panel>& panels, const std::string& x_label, int width, int height) {
  KMAMBA_REQUIRE(!panels.empty(), "kmamba::app::plot: no panels");
  Image image(width, height, Rgb{255, 255, 255});
  const int left = 64, right = 16, title_band = 26, bottom = 36;
  const int panel_height = (height - bottom) / static_cast<int>(panels.size());
  KMAMBA_REQUIRE(
      panel_height > title_band + 20 && width > left + right + 40,
      "kmamba::app::plot: " << width << " x " << height << " is too small for " << panels.size() << " panels");

  double x_lo = INFINITY, x_hi = -INFINITY;
  for (const Panel& p : panels) {
    for (const Series& s : p.series) {
      KMAMBA_REQUIRE(s.x.size() == s.y.size(), "kmamba::app::plot: series '" << s.label << "' has " << s.x.size()
                                                                             << " x values and " << s.y.size()
                                                                             << " y values");
      for (const double x : s.x) {
        if (std::isfinite(x)) x_lo = std::min(x_lo, x), x_hi = std::max(x_hi, x);
      }
    }
  }
  if (!(x_lo <= x_hi)) x_lo = 0.0, x_hi = 1.0;
  if (x_hi - x_lo < 1e-12) x_hi = x_lo + 1.0;
  const double x_step = nice_step(x_hi - x_lo, 8);

  for (std::size_t k = 0; k < panels.size(); ++k) {
    const Panel& panel = panels[k];
    const int top = static_cast<int>(k) * panel_height;
    const Rect area{left, top + title_band, width - right - 1, top + panel_height - 8};
    const Axis axis = y_axis(panel);
    auto px = [&](double x) {
      return area.x0 + static_cast<int>(std::lround((x - x_lo) / (x_hi - x_lo) * (area.x1 - area.x0)));
    };
    auto py = [&](double y) { return area.y1 - static_cast<int>(std::lround(axis.map(y) * (area.y1 - area.y0))); };

    for (const double t : y_ticks(axis)) {
      const int y = py(t);
      line(image, area, area.x0, y, area.x1, y, grid);
      const std::string label = format_number(t);
      draw_text(image, area.x0 - 6 - text_width(label), y - 3, label, label_gray);
    }
    for (double t = std::ceil(x_lo / x_step) * x_step; t <= x_hi + 1e-9 * x_step; t += x_step) {
      const int x = px(t);
      line(image, area, x, area.y0, x, area.y1, grid);
      if (k + 1 == panels.size()) {
        const std::string label = format_number(t);
        draw_text(image, x - text_width(label) / 2, area.y1 + 6, label, label_gray);
      }
    }
    const Rect frame{area.x0 - 1, area.y0 - 1, area.x1 + 1, area.y1 + 1};
    line(image, frame, frame.x0, frame.y0, frame.x1, frame.y0, black);
    line(image, frame, frame.x0, frame.y1, frame.x1, frame.y1, black);
    line(image, frame, frame.x0, frame.y0, frame.x0, frame.y1, black);
    line(image, frame, frame.x1, frame.y0, frame.x1, frame.y1, black);
    draw_text(image, area.x0, top + 8, panel.title + (axis.log ? " (log scale)" : ""), black, 2);

    for (const Series& s : panel.series) {
      bool have_previous = false;
      int x_prev = 0, y_prev = 0;
      for (std::size_t i = 0; i < s.x.size(); ++i) {
        if (!std::isfinite(s.x[i]) || !axis.valid(s.y[i])) continue;
        const int x = px(s.x[i]), y = py(s.y[i]);
        if (s.markers) {
          fill(image,
               Rect{std::max(x - 2, area.x0), std::max(y - 2, area.y0), std::min(x + 2, area.x1),
                    std::min(y + 2, area.y1)},
               s.color);
        } else if (have_previous) {
          line(image, area, x_prev, y_prev, x, y, s.color);
        } else if (area.contains(x, y)) {
          image.set(x, y, s.color);
        }
        have_previous = true;
        x_prev = x;
        y_prev = y;
      }
    }

    int legend_x = area.x1 - 8, legend_y = area.y0 + 6;
    for (const Series& s : panel.series) legend_x = std::min(legend_x, area.x1 - 8 - 16 - text_width(s.label));
    fill(image, Rect{legend_x - 4, legend_y - 3, area.x1 - 4, legend_y + 12 * static_cast<int>(panel.series.size())},
         Rgb{255, 255, 255});
    for (const Series& s : panel.series) {
      fill(image, Rect{legend_x, legend_y + 1, legend_x + 10, legend_y + 5}, s.color);
      draw_text(image, legend_x + 16, legend_y, s.label, black);
      legend_y += 12;
    }
  }
  draw_text(image, left + (width - left - right - text_width(x_label, 2)) / 2, height - 16, x_label, black, 2);
  return image;
}

}  // namespace app
}  // namespace kmamba
