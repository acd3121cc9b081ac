#include "mdist/groups/distributed_process_group.h"

#include <sstream>

namespace mdist {

std::string DistributedProcessGroup::to_string() const {
  std::ostringstream out;
  out << "DistributedProcessGroup(group=" << group_.name() << ", rank=" << rank()
      << ", world_size=" << world_size() << ")";
  return out.str();
}

std::ostream& operator<<(std::ostream& os, const DistributedProcessGroup& group) {
  return os << group.to_string();
}

}  // namespace mdist
