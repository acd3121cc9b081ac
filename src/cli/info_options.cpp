// See src/cli/info_options.h.
#include "src/cli/info_options.h"

#include <CLI/CLI.hpp>

namespace mdist::cli {

void declare_info_flags(CLI::App& app, InfoOptions& o) {
  declare_tensor_parallel_flag(app, o.tensor_parallel);
  declare_expert_parallel_flag(app, o.expert_parallel);
  declare_timeout_flag(app, o.timeout_s);
}

}  // namespace mdist::cli
