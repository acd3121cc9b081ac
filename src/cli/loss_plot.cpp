#include "src/cli/loss_plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace mdist::cli {
namespace {

constexpr double kWidth = 720, kHeight = 420;
constexpr double kLeft = 70, kRight = 20, kTop = 40, kBottom = 50;

std::string fixed(double value, int digits) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.*f", digits, value);
  return text;
}

std::string escape(const std::string& text) {
  std::string out;
  for (const char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// A "nice" tick spacing (1, 2 or 5 times a power of ten) giving about `target` ticks.
double tick_step(double span, int target) {
  if (!(span > 0)) return 1;
  const double raw = span / target;
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  for (const double m : {1.0, 2.0, 5.0, 10.0}) {
    if (m * power >= raw) return m * power;
  }
  return 10 * power;
}

}  // namespace

std::string loss_curve_svg(const std::vector<std::pair<int, double>>& points,
                           const std::string& title,
                           const std::vector<std::pair<int, double>>& held_out) {
  std::ostringstream svg;
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << kWidth << "\" height=\"" << kHeight
      << "\" viewBox=\"0 0 " << kWidth << ' ' << kHeight
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << kWidth / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">"
      << escape(title) << "</text>\n";
  const double plot_w = kWidth - kLeft - kRight, plot_h = kHeight - kTop - kBottom;
  int x_min = 0, x_max = 1;
  double y_min = 0, y_max = 1;
  std::vector<std::pair<int, double>> finite, finite_held_out, all;
  for (const auto& p : points) {
    if (std::isfinite(p.second)) finite.push_back(p);
  }
  for (const auto& p : held_out) {
    if (std::isfinite(p.second)) finite_held_out.push_back(p);
  }
  all = finite;
  all.insert(all.end(), finite_held_out.begin(), finite_held_out.end());
  if (!all.empty()) {
    const auto [first, last] = std::minmax_element(
        all.begin(), all.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    x_min = first->first;
    x_max = std::max(last->first, x_min + 1);
    const auto [lo, hi] = std::minmax_element(
        all.begin(), all.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
    y_min = std::floor(lo->second * 2) / 2;
    y_max = std::max(std::ceil(hi->second * 2) / 2, y_min + 0.5);
  }
  const auto sx = [&](double x) { return kLeft + (x - x_min) / (x_max - x_min) * plot_w; };
  const auto sy = [&](double y) { return kTop + (y_max - y) / (y_max - y_min) * plot_h; };

  // Grid and tick labels.
  const double dy = tick_step(y_max - y_min, 6);
  for (double y = std::ceil(y_min / dy) * dy; y <= y_max + 1e-9; y += dy) {
    svg << "<line x1=\"" << kLeft << "\" x2=\"" << kWidth - kRight << "\" y1=\"" << fixed(sy(y), 1)
        << "\" y2=\"" << fixed(sy(y), 1) << "\" stroke=\"#e5e5e5\"/>\n"
        << "<text x=\"" << kLeft - 8 << "\" y=\"" << fixed(sy(y) + 4, 1)
        << "\" text-anchor=\"end\">" << fixed(y, dy < 1 ? 1 : 0) << "</text>\n";
  }
  const double dx = std::max(1.0, tick_step(x_max - x_min, 8));
  for (double x = std::ceil(x_min / dx) * dx; x <= x_max + 1e-9; x += dx) {
    svg << "<line x1=\"" << fixed(sx(x), 1) << "\" x2=\"" << fixed(sx(x), 1) << "\" y1=\"" << kTop
        << "\" y2=\"" << kHeight - kBottom << "\" stroke=\"#f0f0f0\"/>\n"
        << "<text x=\"" << fixed(sx(x), 1) << "\" y=\"" << kHeight - kBottom + 18
        << "\" text-anchor=\"middle\">" << fixed(x, 0) << "</text>\n";
  }
  svg << "<rect x=\"" << kLeft << "\" y=\"" << kTop << "\" width=\"" << plot_w << "\" height=\""
      << plot_h << "\" fill=\"none\" stroke=\"#444\"/>\n"
      << "<text x=\"" << kLeft + plot_w / 2 << "\" y=\"" << kHeight - 10
      << "\" text-anchor=\"middle\">step</text>\n"
      << "<text x=\"16\" y=\"" << kTop + plot_h / 2
      << "\" text-anchor=\"middle\" transform=\"rotate(-90 16 " << kTop + plot_h / 2
      << ")\">loss (nats per token)</text>\n";
  if (!finite.empty()) {
    svg << "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\" points=\"";
    for (const auto& [step, loss] : finite)
      svg << fixed(sx(step), 1) << ',' << fixed(sy(loss), 1) << ' ';
    svg << "\"/>\n";
  }
  if (!finite_held_out.empty()) {
    svg << "<polyline fill=\"none\" stroke=\"#ff7f0e\" stroke-width=\"1.5\" points=\"";
    for (const auto& [step, loss] : finite_held_out)
      svg << fixed(sx(step), 1) << ',' << fixed(sy(loss), 1) << ' ';
    svg << "\"/>\n";
    for (const auto& [step, loss] : finite_held_out) {
      svg << "<circle cx=\"" << fixed(sx(step), 1) << "\" cy=\"" << fixed(sy(loss), 1)
          << "\" r=\"3\" fill=\"#ff7f0e\"/>\n";
    }
    const double lx = kWidth - kRight - 150, ly = kTop + 16;
    svg << "<line x1=\"" << lx << "\" x2=\"" << lx + 20 << "\" y1=\"" << ly << "\" y2=\"" << ly
        << "\" stroke=\"#1f77b4\" stroke-width=\"2\"/><text x=\"" << lx + 26 << "\" y=\"" << ly + 4
        << "\">training</text>\n"
        << "<line x1=\"" << lx << "\" x2=\"" << lx + 20 << "\" y1=\"" << ly + 18 << "\" y2=\""
        << ly + 18 << "\" stroke=\"#ff7f0e\" stroke-width=\"2\"/><text x=\"" << lx + 26 << "\" y=\""
        << ly + 22 << "\">held out</text>\n";
  }
  svg << "</svg>\n";
  return std::move(svg).str();
}

}  // namespace mdist::cli
