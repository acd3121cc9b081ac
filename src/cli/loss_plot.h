#pragma once
// The loss curve `mdist train` leaves in its output directory, as a self-contained SVG (no
// plotting library: a polyline over labelled axes, readable in any browser).
#include <string>
#include <utility>
#include <vector>

namespace mdist::cli {

// points: (step, loss) in step order. Returns the SVG document.
std::string loss_curve_svg(const std::vector<std::pair<int, double>>& points,
                           const std::string& title);

}  // namespace mdist::cli
