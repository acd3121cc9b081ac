#pragma once
// Shell-style wildcards as Python's fnmatch.fnmatchcase (POSIX: case-sensitive), the matching
// modelopt 0.47 applies to quantizer names (`conversion.py`, `_match_quantizer`):
//
//   mdist::quant::wildcard_match("*mlp.gate.*", "model.layers.0.mlp.gate.weight_quantizer");
//
// The whole name must match. `*` is any run of characters (dots included), `?` one character,
// `[abc]`, `[a-z]` one character of a set, `[!abc]` one character outside it (a `]` first in a
// set is a member); a `[` without its closing `]` is an ordinary character, as in Python.
#include <string_view>

namespace mdist::quant {

bool wildcard_match(std::string_view pattern, std::string_view name);

}  // namespace mdist::quant
