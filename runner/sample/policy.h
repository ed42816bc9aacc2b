// A policy: the weights a sampler reads, frozen when it was made, so training may go on changing
// the model while its previous policy is sampled (asynchronous RL). A LoRA policy holds a copy of
// the adapter and shares the base's tensors; a full fine-tune's policy holds a copy of every
// weight. On a sharded base (--shard_base) the base's tensors are gathered for each forward.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "runner/model/config.h"
#include "runner/model/lora.h"
#include "runner/model/rope.h"
#include "runner/model/transformer.h"
#include "runner/sample/base_forward.h"
#include "runner/sample/expert_forward.h"
#include "runner/tokenizer/token_texts.h"
#include "runner/util/memory_account.h"

namespace tinkerd {

struct Policy {
  ModelConfig config;
  BaseWeights weights;
  // Set where the base is sharded: `weights` are then placeholders (no tensors), and every
  // forward of the policy runs through it, the base gathered for that forward alone.
  std::shared_ptr<const GatherBase> gathered;
  // Set where the experts are spread over ranks (--expert_parallel): every forward of the policy
  // runs through it, rank 0 leading its group, whose ranks run their experts of `experts_key`'s
  // frozen copy (held on those ranks until this key is dropped: ModelRunner::TakeDropped); null
  // key: the base's experts. `weights` and `lora` then hold rank 0's experts alone.
  std::shared_ptr<const SpreadExperts> spread;
  std::shared_ptr<const int64_t> experts_key;
  std::optional<LoraAdapter> lora;
  at::ScalarType compute_dtype = at::kFloat;
  at::Device device = at::kCPU;
  std::shared_ptr<RopeCache> rope;
  std::string model_id;  // empty: the base model
  int64_t step = 0;      // the model's optimizer steps when it was frozen
  int64_t bytes = 0;     // memory the policy holds beyond the base's
  // Those bytes, held in the runner's memory account for the policy's life (none under data
  // parallelism: rank 0 alone samples, and every rank's account must admit the same models).
  // Shared by copies of the policy, which share its tensors.
  std::shared_ptr<const Reservation> memory;
  // The base model's tokenizer, to match stop strings; null when its directory has none.
  std::shared_ptr<const TokenTexts> texts;
};

struct LeadSlots {
  std::function<kernels::SlotsFn(int64_t layer, int64_t key)> of;
};

// The key Policy::experts_key names (0: the base's experts).
inline int64_t ExpertsKey(const Policy& p) {
  return p.experts_key ? *p.experts_key : 0;
}

}  // namespace tinkerd
