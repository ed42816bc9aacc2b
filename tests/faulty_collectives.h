// Collectives that forward to real ones (c10d over Gloo, or the identity at world size 1) and
// break them on purpose: the broken controls and faults of the tests. Production code carries no
// such switches.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "runner/dist/collectives.h"

namespace tinkerd::testing {

struct Faults {
  // The reduced gradient stays DDP's mean instead of the sum (the world-size factor forgotten).
  bool forget_world_size_factor = false;
  // At this gradient reduction (0-based), this rank adds 1e-3 to the first reduced value: its
  // replica no longer matches the others'.
  int perturb_at_reduction = -1;
  // The reduced gradient is reduced once more: every rank's contribution counted world-size
  // times, as when an accumulator that was already reduced is reduced again (reducing per call
  // does that to every earlier call's gradient: the double-reduction bug of peers.md).
  bool reduce_twice = false;
  // The loss-sum reduction at the end of every forward(_backward) fails (UNAVAILABLE), after the
  // call's micro-batches ran and its counts were reduced: the last moment before it commits.
  bool fail_loss_reduction = false;
  // Every all-gather keeps this rank's row alone and leaves the others' zero: sharded weights
  // used without the slices the other ranks hold.
  bool gather_own_only = false;
  // Every all-to-all (expert parallelism's dispatch and return, in the forward and the backward)
  // delivers the first row this rank sends as zeros: a token dropped on its way to an expert.
  bool drop_sent_row = false;
};

class FaultyCollectives : public Collectives {
 public:
  FaultyCollectives(std::shared_ptr<Collectives> inner, Faults faults)
      : inner_(std::move(inner)), faults_(faults) {}

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  absl::Status AllReduceSumGradients(std::vector<at::Tensor>& grads) override {
    absl::Status st = inner_->AllReduceSumGradients(grads);
    if (!st.ok()) return st;
    if (faults_.reduce_twice) {
      st = inner_->AllReduceSumGradients(grads);
      if (!st.ok()) return st;
    }
    if (faults_.forget_world_size_factor) {
      for (at::Tensor& g : grads) g.div_(static_cast<double>(world_size()));
    }
    if (reductions_++ == faults_.perturb_at_reduction && !grads.empty()) {
      grads[0].view(-1)[0].add_(1e-3);
    }
    return st;
  }
  // reduce_twice on sharded state: a call's gradient reduce-scattered into its shard twice.
  absl::Status ReduceScatterSum(const at::Tensor& in_WK, at::Tensor& out_K) override {
    absl::Status st = inner_->ReduceScatterSum(in_WK, out_K);
    if (!st.ok() || !faults_.reduce_twice) return st;
    at::Tensor again_K = at::empty_like(out_K);
    st = inner_->ReduceScatterSum(in_WK, again_K);
    if (st.ok()) out_K.add_(again_K);
    return st;
  }
  absl::Status AllGather(const at::Tensor& in_K, at::Tensor& out_WK) override {
    gathered_values += out_WK.numel();
    absl::Status st = inner_->AllGather(in_K, out_WK);
    if (st.ok() && faults_.gather_own_only) {
      out_WK.zero_();
      out_WK[rank()].copy_(in_K);
    }
    return st;
  }
  absl::Status AllReduceSumCounts(std::vector<int64_t>& counts) override {
    return inner_->AllReduceSumCounts(counts);
  }
  absl::Status AllAgree(bool& ok) override { return inner_->AllAgree(ok); }
  absl::Status AllReduceSumDoubles(std::vector<double>& values) override {
    if (faults_.fail_loss_reduction) return absl::UnavailableError("injected: a reduction failed");
    return inner_->AllReduceSumDoubles(values);
  }
  absl::StatusOr<std::vector<std::string>> AllGatherBytes(const std::string& mine) override {
    return inner_->AllGatherBytes(mine);
  }
  absl::Status BroadcastBytes(std::string& bytes, int root) override {
    return inner_->BroadcastBytes(bytes, root);
  }
  absl::StatusOr<at::Tensor> AllToAll(const at::Tensor& in_ND,
                                      const std::vector<int64_t>& send_rows,
                                      const std::vector<int64_t>& recv_rows) override {
    if (!faults_.drop_sent_row || in_ND.size(0) == 0) {
      return inner_->AllToAll(in_ND, send_rows, recv_rows);
    }
    at::Tensor dropped_ND = in_ND.clone();
    dropped_ND[0].zero_();
    return inner_->AllToAll(dropped_ND, send_rows, recv_rows);
  }
  // A group of these ranks breaks as this world does.
  absl::StatusOr<std::shared_ptr<Collectives>> Subgroup(const std::vector<int>& ranks) override {
    auto inner = inner_->Subgroup(ranks);
    if (!inner.ok()) return inner.status();
    return std::shared_ptr<Collectives>(std::make_shared<FaultyCollectives>(*inner, faults_));
  }

  // Faults may change between calls (the runner calls its collectives on one thread at a time).
  Faults& faults() { return faults_; }

  // Values every all-gather has delivered so far (out_WK's), faults or not.
  int64_t gathered_values = 0;

 private:
  std::shared_ptr<Collectives> inner_;
  Faults faults_;
  int reductions_ = 0;
};

}  // namespace tinkerd::testing
