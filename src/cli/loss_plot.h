#pragma once
// The loss curve `mdist train` leaves in its output directory, as a self-contained SVG (no
// plotting library: a polyline over labelled axes, readable in any browser).
#include <string>
#include <utility>
#include <vector>

namespace mdist::cli {

// points: (step, training loss) in step order; held_out: (step, held-out loss), drawn beside
// it with markers and a legend when not empty. Returns the SVG document.
std::string loss_curve_svg(const std::vector<std::pair<int, double>>& points,
                           const std::string& title,
                           const std::vector<std::pair<int, double>>& held_out = {});

}  // namespace mdist::cli
