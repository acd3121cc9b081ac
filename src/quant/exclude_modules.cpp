// modelopt's summary of the modules an export leaves unquantized (`exclude_modules`).
#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "mdist/quant/export.h"

namespace mdist::quant {
namespace {

// Every prefix wildcard ("", "m*", "mo*", ...) of `name`, and the name itself: none of these
// may appear in the summary, or it would exclude a quantized module.
void add_prefix_wildcards(std::set<std::string>& out, const std::string& name) {
  out.insert(name);
  for (std::size_t i = 0; i <= name.size(); ++i) out.insert(name.substr(0, i) + "*");
}

// The candidates for `name`, most general first: at each dot, "prefix*" and then the pair
// {"prefix", "prefix.*"}; finally the name itself.
std::vector<std::vector<std::string>> candidates(const std::string& name) {
  std::vector<std::vector<std::string>> out;
  for (std::size_t i = 0; i < name.size(); ++i) {
    if (name[i] != '.') continue;
    const std::string prefix = name.substr(0, i);
    out.push_back({prefix + "*"});
    out.push_back({prefix, prefix + ".*"});
  }
  out.push_back({name});
  return out;
}

}  // namespace

std::vector<std::string> summarize_exclude_modules(const std::vector<std::string>& unquantized,
                                                   const std::vector<std::string>& quantized) {
  std::set<std::string> forbidden;
  for (const auto& name : quantized) add_prefix_wildcards(forbidden, name);
  std::set<std::string> summary;
  for (const auto& name : unquantized) {
    std::vector<std::string> chosen;
    for (const auto& wildcards : candidates(name)) {
      const auto in = [](const std::set<std::string>& set) {
        return [&set](const std::string& w) { return set.contains(w); };
      };
      if (std::any_of(wildcards.begin(), wildcards.end(), in(forbidden))) continue;
      // Already covered by an earlier module's wildcard: nothing to add.
      if (std::all_of(wildcards.begin(), wildcards.end(), in(summary))) break;
      chosen = wildcards;
      break;
    }
    // The pair {"x", "x.*"} is written as "x.*" alone, as modelopt does for deployment.
    if (chosen.size() == 2 && chosen[1] == chosen[0] + ".*") {
      summary.insert(chosen[1]);
    } else {
      summary.insert(chosen.begin(), chosen.end());
    }
  }
  return {summary.begin(), summary.end()};
}

}  // namespace mdist::quant
