#pragma once
// mdist: the spec's distributed utilities for C++ programs on libtorch.
#include "mdist/error.h"                             // IWYU pragma: export
#include "mdist/groups/distributed_process_group.h"  // IWYU pragma: export
#include "mdist/groups/parallel_state.h"             // IWYU pragma: export
#include "mdist/objects/codec.h"                     // IWYU pragma: export
#include "mdist/objects/collectives.h"               // IWYU pragma: export
#include "mdist/runtime/environment.h"               // IWYU pragma: export
#include "mdist/runtime/group.h"                     // IWYU pragma: export
#include "mdist/runtime/runtime.h"                   // IWYU pragma: export
