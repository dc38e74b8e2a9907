// Line charts rendered into an Image (for kmamba-train's loss curve): stacked panels sharing an x
// axis, linear or logarithmic y axes with labelled ticks, lines or point markers, a legend, and a
// built-in 5x7 pixel font (digits, lower-case letters and a little punctuation).
//
//   kmamba::app::Panel loss{"loss", true, {{"train", {31, 119, 180}, steps, losses, false}}};
//   kmamba::app::write_png("loss.png", kmamba::app::plot({loss}, "step", 800, 500));
#ifndef KMAMBA_APPS_COMMON_PLOT_HPP
#define KMAMBA_APPS_COMMON_PLOT_HPP

#include "Png.hpp"

#include <string>
#include <vector>

namespace kmamba {
namespace app {

struct Series {
  std::string label;
  Rgb color;
  std::vector<double> x, y;  // same length; non-finite (and, on a log axis, non-positive) y are skipped
  bool markers = false;      // draw each point as a small square instead of joining them
};

struct Panel {
  std::string title;   // drawn above the panel, e.g. "loss"
  bool log_y = false;  // logarithmic y axis (falls back to linear when a value is not positive)
  std::vector<Series> series;
};

/// Draws `panels` stacked top to bottom in a width × height image; the x range is shared.
Image plot(const std::vector<Panel>& panels, const std::string& x_label, int width, int height);

/// Draws `text` with its top-left corner at (x, y), each font pixel `scale` pixels wide.
void draw_text(Image& image, int x, int y, const std::string& text, Rgb color, int scale = 1);

}  // namespace app
}  // namespace kmamba

#endif
