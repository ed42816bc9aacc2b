// A sampler's forward on a base that the ranks hold in slices (--shard_base), and what runs one.
// Apart from policy.h so that the runner's API names them without LibTorch's headers.
#pragma once

#include <functional>

#include "absl/status/status.h"

namespace tinkerd {

struct BaseWeights;
struct LayerSource;

// `rest` holds the embedding, final norm and head whole, its layers placeholders; `layers` gathers
// each decoder layer as the forward reaches it (ForwardOptions::layers).
using BaseForward = std::function<void(const BaseWeights& rest, const LayerSource& layers)>;
// Runs one such forward: a collective that every rank takes part in, the others gathering alone
// (ModelRunner::ForwardGatheredBase; the server replicates it to them as a command).
using GatherBase = std::function<absl::Status(const BaseForward& forward)>;

}  // namespace tinkerd
