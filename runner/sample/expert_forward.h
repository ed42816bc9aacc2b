// A sampler's forward where each layer's experts are spread over ranks (--expert_parallel), and
// what runs one. Apart from policy.h so that the runner's API names them without LibTorch's
// headers.
#pragma once

#include <cstdint>
#include <functional>

#include "absl/status/status.h"

namespace tinkerd {

// Where a leading forward's routed layers send their slots (runner/dist/expert_parallel.h): the
// slots of decoder layer `layer` for rows whose experts are the policy `key`'s (Policy::experts;
// 0: the base's). Defined in runner/sample/policy.h (it names LibTorch's types).
struct LeadSlots;
using ExpertForward = std::function<void(const LeadSlots& lead)>;
// Runs one such forward: a collective that rank 0 leads and its group serves (ModelRunner::
// ForwardSpreadExperts; the server replicates it to them as a command).
using SpreadExperts = std::function<absl::Status(const ExpertForward& forward)>;

}  // namespace tinkerd
