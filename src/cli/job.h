#pragma once
// What a subcommand that runs a model includes: joining the job and agreeing on input
// (session.h), the model (model_choice.h, model_build.h), the layout (job_layout.h) and the
// data (job_data.h). Each of those is its own concept; this header only gathers them.
#include "mdist/runtime/device.h"
#include "mdist/train/memory.h"
#include "src/cli/commands.h"
#include "src/cli/job_data.h"
#include "src/cli/job_layout.h"
#include "src/cli/model_build.h"
#include "src/cli/model_choice.h"
#include "src/cli/session.h"

namespace mdist::cli {

// Peak resident set size of this process (VmHWM), MiB.
using train::peak_rss_mib;

}  // namespace mdist::cli
