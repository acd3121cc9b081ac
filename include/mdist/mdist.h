#pragma once
// mdist: the spec's distributed utilities and FSDP2 for C++ programs on libtorch.
// Layer by layer: runtime (joining a job), groups, object collectives, nn hooks, fsdp.
#include "mdist/error.h"                             // IWYU pragma: export
#include "mdist/fsdp/fully_shard.h"                  // IWYU pragma: export
#include "mdist/fsdp/state_dict.h"                   // IWYU pragma: export
#include "mdist/groups/distributed_process_group.h"  // IWYU pragma: export
#include "mdist/groups/parallel_state.h"             // IWYU pragma: export
#include "mdist/nn/hooks.h"                          // IWYU pragma: export
#include "mdist/nn/meta.h"                           // IWYU pragma: export
#include "mdist/objects/broadcast_state_dict.h"      // IWYU pragma: export
#include "mdist/objects/codec.h"                     // IWYU pragma: export
#include "mdist/objects/collectives.h"               // IWYU pragma: export
#include "mdist/optim/fused_adamw.h"                 // IWYU pragma: export
#include "mdist/runtime/device.h"                    // IWYU pragma: export
#include "mdist/runtime/environment.h"               // IWYU pragma: export
#include "mdist/runtime/file_lock.h"                 // IWYU pragma: export
#include "mdist/runtime/group.h"                     // IWYU pragma: export
#include "mdist/runtime/runtime.h"                   // IWYU pragma: export
#include "mdist/tp/collectives.h"                    // IWYU pragma: export
#include "mdist/tp/cross_entropy.h"                  // IWYU pragma: export
#include "mdist/tp/layers.h"                         // IWYU pragma: export
