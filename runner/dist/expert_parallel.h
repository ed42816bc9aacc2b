// Expert parallelism (--expert_parallel=E): the world is cut into groups of E consecutive ranks,
// and within a group rank r holds block r % E of every routed layer's experts (num_experts / E
// consecutive ones), base weights, adapters and optimizer state alike, and no other expert.
// Attention, norms, embeddings and routers stay replicated, and every rank still trains on its
// own share of the datums (data parallelism over the whole world).
//
// A routed layer routes each rank's own tokens, then Exchange carries the (token, choice) slots by
// all-to-all to the rank holding their expert, runs the experts there over what every rank of the
// group sent them, and carries the outputs back; the backward runs the same exchanges in reverse.
// No slot is ever dropped: a rank receives at most the group's slots for its own experts, at most
// E · T · min(top_k, num_experts / E) rows per layer (T: micro_batch_tokens, or a longer datum's,
// which runs alone), the memory bound of a micro-batch's exchanged activations. Every exchange is a
// collective over the group, so its ranks run their forwards in step, as many micro-batches each
// (runner/train_step.cc pads, as under --shard=full).
//
// Gradients (Note [Reduce once] in collectives.h): an expert's gradient on its holder is already
// the sum over its group's tokens; the W / E ranks holding the same block in different groups
// (the replicas) sum theirs once per step, and every other gradient is summed over the world as
// before. The squared norm adds each block once: the replicated part, plus the experts' part
// summed over the group.
//
// Sampling is rank 0's alone, so there the exchanges are led: rank 0 runs the forward, and at each
// routed layer sends, beside its counts, which layer and whose weights (a policy's) the rest of
// its group runs; those ranks serve until rank 0 ends the forward (ModelRunner::
// ForwardSpreadExperts). Rank 0 may then skip a layer's exchange for a run of no rows.
//
// Shape suffixes: S this rank's slots, sorted by expert; R slots received; D hidden; E experts;
// G ranks of the group; C the counts' columns (E, then a head's).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/routed_experts.h"
#include "runner/dist/collectives.h"
#include "runner/model/transformer.h"

namespace tinkerd {

class ExpertParallel {
 public:
  // A collective over `world` (it makes the groups): every rank calls it once, with the same
  // arguments. INVALID_ARGUMENT unless `size` divides both the world size and num_experts.
  static absl::StatusOr<std::unique_ptr<ExpertParallel>> Create(Collectives& world, int size,
                                                                int64_t num_experts);
  // The experts rank `rank` of `world` ranks holds, [first, first + count), computed alone (before
  // any collective: what a rank reads of the base model). INVALID_ARGUMENT as for Create.
  struct Block {
    int64_t first, count;
  };
  static absl::StatusOr<Block> BlockOf(int rank, int world, int size, int64_t num_experts);

  int size() const { return group_->world_size(); }  // E
  int64_t first() const { return first_; }           // this rank's experts: [first, first + count)
  int64_t count() const { return count_; }
  bool Holds(int64_t expert) const { return expert >= first_ && expert < first_ + count_; }
  // The expert a tensor belongs to, from its Hugging Face name (".experts.<e>."), or -1.
  static int64_t ExpertOf(absl::string_view name);
  // Whether this rank keeps a tensor of that name: any but another rank's expert's.
  bool Keeps(absl::string_view name) const {
    const int64_t e = ExpertOf(name);
    return e < 0 || Holds(e);
  }

  Collectives& group() const { return *group_; }
  Collectives* replicas() const { return replicas_.get(); }  // null with one group

  // The routed layers' exchange (kernels::SlotsFn), in the forward and through autograd.
  kernels::SlotsFn Slots() const;

  // Sampling: one rank runs a forward and its group serves their experts to it. The leading rank
  // (the group's first) sends each exchange's head with its counts: the decoder layer and `key`,
  // which weights the serving ranks run (a policy's frozen experts; 0: the base's). Its rows go
  // out and come back as in Slots; the others send none. Throws CollectiveFailure as Slots does.
  kernels::SlotsFn Leading(int64_t layer, int64_t key) const;
  // Ends a leading forward, whether it succeeded or not: the serving ranks return.
  absl::Status EndLead() const;
  // A serving rank's part: answers the leader's exchanges until it ends them, running its
  // experts of each exchange's layer and key (`experts`), over activations of `options` and
  // `hidden` columns. Returns the first error of an expert that could not run (having answered
  // zeros from then on, so the group stays in step), or UNAVAILABLE when an exchange failed.
  using ServedExperts =
      std::function<absl::StatusOr<kernels::ExpertFn>(int64_t layer, int64_t key)>;
  absl::Status Serve(const ServedExperts& experts, const at::TensorOptions& options,
                     int64_t hidden) const;
  // Every expert's tensors, on every rank of the group: `kept` (this rank's, by name; other names
  // are returned as they are) gathered over the group under their own experts' names. A
  // collective; every rank of the group passes tensors of the same names, experts renumbered.
  absl::StatusOr<std::map<std::string, at::Tensor>> GatherExperts(
      const std::map<std::string, at::Tensor>& kept) const;

 private:
  ExpertParallel(std::shared_ptr<Collectives> group, std::shared_ptr<Collectives> replicas,
                 int64_t first, int64_t count)
      : group_(std::move(group)), replicas_(std::move(replicas)), first_(first), count_(count) {}

  // What a leader's exchange sends beside its counts (op: kExchange or kEnd).
  static constexpr int64_t kEnd = 0, kExchange = 1;
  struct Head {
    bool on = false;
    int64_t op = kEnd, layer = 0, key = 0;
  };
  // Every rank's slots per expert, [G, E] (then the head's columns): a collective of the group.
  at::Tensor Counts(const std::vector<int64_t>& rows_E, const Head& head) const;
  // `led` (sampling): an error running the experts is thrown only after the return exchange,
  // which carries zeros for the rows it left without outputs.
  at::Tensor Exchange(const at::Tensor& x_SD, const std::vector<int64_t>& rows_E,
                      const at::Tensor& all_GC, const kernels::ExpertFn& expert,
                      bool led = false) const;

  std::shared_ptr<Collectives> group_, replicas_;
  int64_t first_, count_;
};

}  // namespace tinkerd
