// The process group torch gets for a jacklring C++ Backend: torch's own c10d::ProcessGroup,
// whose dispatch goes straight to the registered Backend, but named "jacklring" rather than
// "custom" (DDP's logging data and other C++ readers ask the group for its backend's name).
// Made in C++ so that no Python override check sits on the call path.
#ifndef JACKLRING_TORCH_NAMED_GROUP_H
#define JACKLRING_TORCH_NAMED_GROUP_H

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <string>

namespace jacklring {

class NamedProcessGroup : public c10d::ProcessGroup {
 public:
  NamedProcessGroup(int rank, int size) : c10d::ProcessGroup(rank, size) {}
  const std::string getBackendName() const override { return "jacklring"; }
};

}  // namespace jacklring

#endif
