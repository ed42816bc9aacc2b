#include "server/core/replicated_runner.h"

#include "absl/strings/str_cat.h"
#include "runner/util/log.h"
#include "runner/util/status_macros.h"
#include "server/core/convert.h"

namespace tinkerd {

absl::Status AgreeOnOutcome(Collectives* c, const absl::Status& mine) {
  // A runner command changes a rank's state only when it succeeds, so ranks that all failed (with
  // whatever codes) still hold the same state; ranks that differ in success no longer do.
  ASSIGN_OR_RETURN(
      std::vector<std::string> all,
      c->AllGatherBytes(mine.ok() ? std::string("ok")
                                  : absl::StrCat("failed: ", mine.ToString().substr(0, 400))));
  for (size_t r = 1; r < all.size(); ++r) {
    if ((all[r] == "ok") != (all[0] == "ok")) {
      return absl::DataLossError(
          absl::StrCat("the ranks diverged: rank 0 ", all[0], "; rank ", r, " ", all[r]));
    }
  }
  return absl::OkStatus();
}

ReplicatedRunner::ReplicatedRunner(ModelRunner* runner, std::shared_ptr<Collectives> collectives)
    : runner_(runner), collectives_(collectives ? std::move(collectives) : MakeLocalCollectives()) {
  if (collectives_->world_size() == 1) return;
  // A sampler's forward on a sharded base is a command: every rank gathers while rank 0 computes.
  runner_->SetGatherBase([this](const BaseForward& forward) {
    Command c;
    c.wire.set_base_forward(true);
    c.forward = forward;
    return Replicate(std::move(c)).status();
  });
  // So is one with the experts spread over ranks: rank 0's group serves the experts it holds.
  runner_->SetSpreadExperts([this](const ExpertForward& forward) {
    Command c;
    c.wire.set_expert_forward(true);
    c.lead = forward;
    return Replicate(std::move(c)).status();
  });
}

bool ReplicatedRunner::healthy() const {
  absl::MutexLock lock(&mu_);
  return broken_.ok();
}

void ReplicatedRunner::set_on_broken(std::function<void(const absl::Status&)> f) {
  on_broken_ = std::move(f);
}

void ReplicatedRunner::MarkBroken(const absl::Status& why) {
  if (!broken_.ok()) return;
  broken_ = absl::UnavailableError(absl::StrCat(
      "the data-parallel job is broken (a rank failed or timed out): ", why.message()));
  TLOG_ERROR("{}", std::string(broken_.message()));
  if (on_broken_) on_broken_(broken_);
}

absl::StatusOr<CommandResult> ReplicatedRunner::Replicate(Command cmd) {
  absl::MutexLock lock(&mu_);
  if (!broken_.ok()) return broken_;
  if (shut_down_) return absl::UnavailableError("server is shutting down");
  if (collectives_->world_size() > 1) {
    for (int64_t key : runner_->TakeDropped()) cmd.wire.add_dropped_experts(key);
    std::string bytes = cmd.wire.SerializeAsString();
    if (auto st = collectives_->BroadcastBytes(bytes, 0); !st.ok()) {
      MarkBroken(st);
      return broken_;
    }
  }
  absl::StatusOr<CommandResult> r = Execute(runner_, std::move(cmd));
  if (collectives_->world_size() == 1) return r;
  // Only collectives fail with UNAVAILABLE inside the runner: the ranks are out of step now.
  if (!r.ok() && r.status().code() == absl::StatusCode::kUnavailable) {
    MarkBroken(r.status());
    return broken_;
  }
  if (absl::Status agreed = AgreeOnOutcome(collectives_.get(), r.status()); !agreed.ok()) {
    MarkBroken(agreed);
    return broken_;
  }
  return r;
}

absl::StatusOr<std::string> ReplicatedRunner::CreateModel(const v1::CreateModelRequest& req) {
  v1::internal::Command c;
  *c.mutable_create_model() = req;
  ASSIGN_OR_RETURN(*c.mutable_new_model_id(), ModelRunner::NewModelId());
  ASSIGN_OR_RETURN(CommandResult r, Replicate(std::move(c)));
  return std::move(r.model_id);
}

absl::Status ReplicatedRunner::DeleteModel(const std::string& model_id) {
  v1::internal::Command c;
  c.set_delete_model(model_id);
  return Replicate(std::move(c)).status();
}

absl::StatusOr<ForwardBackwardResult> ReplicatedRunner::ForwardBackward(
    v1::ForwardBackwardRequest req, Batch batch, bool backward) {
  Command c;
  c.batch = std::move(batch);
  (backward ? c.wire.mutable_forward_backward() : c.wire.mutable_forward())->Swap(&req);
  ASSIGN_OR_RETURN(CommandResult r, Replicate(std::move(c)));
  return std::move(r.forward);
}

std::vector<absl::StatusOr<ForwardBackwardResult>> ReplicatedRunner::ForwardBackwardJoint(
    std::vector<v1::ForwardBackwardRequest> reqs, std::vector<Batch> batches, bool backward) {
  const size_t n = reqs.size();
  Command c;
  c.wire.mutable_joint()->set_backward(backward);
  for (v1::ForwardBackwardRequest& r : reqs) c.wire.mutable_joint()->add_calls()->Swap(&r);
  c.batches = std::move(batches);
  absl::StatusOr<CommandResult> r = Replicate(std::move(c));
  if (!r.ok()) return std::vector<absl::StatusOr<ForwardBackwardResult>>(n, r.status());
  return std::move(r->joint);
}

std::vector<absl::StatusOr<OptimStepResult>> ReplicatedRunner::OptimStepJoint(
    std::vector<v1::OptimStepRequest> reqs) {
  const size_t n = reqs.size();
  v1::internal::Command c;
  for (v1::OptimStepRequest& r : reqs) c.mutable_joint_steps()->add_steps()->Swap(&r);
  absl::StatusOr<CommandResult> r = Replicate(std::move(c));
  if (!r.ok()) return std::vector<absl::StatusOr<OptimStepResult>>(n, r.status());
  return std::move(r->joint_steps);
}

absl::StatusOr<OptimStepResult> ReplicatedRunner::OptimStep(const v1::OptimStepRequest& req) {
  v1::internal::Command c;
  *c.mutable_optim_step() = req;
  ASSIGN_OR_RETURN(CommandResult r, Replicate(std::move(c)));
  return r.step;
}

absl::StatusOr<int64_t> ReplicatedRunner::BeginStream(const std::string& model_id,
                                                      const v1::LossFn& loss) {
  v1::internal::Command c;
  c.mutable_stream_begin()->set_model_id(model_id);
  *c.mutable_stream_begin()->mutable_loss_fn() = loss;
  ASSIGN_OR_RETURN(CommandResult r, Replicate(std::move(c)));
  return r.stream_id;
}

absl::Status ReplicatedRunner::StreamAppend(int64_t stream_id, const v1::LossFn& loss,
                                            std::vector<v1::Datum> data, Batch batch) {
  Command c;
  c.batch = std::move(batch);
  v1::internal::StreamAppend* a = c.wire.mutable_stream_append();
  a->set_stream_id(stream_id);
  *a->mutable_loss_fn() = loss;
  a->mutable_data()->Reserve(static_cast<int>(data.size()));
  for (v1::Datum& d : data) a->add_data()->Swap(&d);
  return Replicate(std::move(c)).status();
}

absl::StatusOr<ForwardBackwardResult> ReplicatedRunner::FinishStream(int64_t stream_id) {
  v1::internal::Command c;
  c.set_stream_finish(stream_id);
  ASSIGN_OR_RETURN(CommandResult r, Replicate(std::move(c)));
  return std::move(r.forward);
}

void ReplicatedRunner::AbortStream(int64_t stream_id) {
  v1::internal::Command c;
  c.set_stream_abort(stream_id);
  (void)Replicate(std::move(c));
}

absl::Status ReplicatedRunner::LoadState(const std::string& model_id, const std::string& fs_path,
                                         bool with_optimizer) {
  v1::internal::Command c;
  c.mutable_load_state()->set_model_id(model_id);
  c.mutable_load_state()->set_fs_path(fs_path);
  c.mutable_load_state()->set_with_optimizer(with_optimizer);
  return Replicate(std::move(c)).status();
}

absl::Status ReplicatedRunner::SaveState(const std::string& model_id, const std::string& fs_path,
                                         const SaveStateOptions& options) {
  v1::internal::Command c;
  auto* s = c.mutable_save_state();
  s->set_model_id(model_id);
  s->set_fs_path(fs_path);
  s->set_overwrite(options.overwrite);
  s->set_include_accumulated(options.include_accumulated);
  s->set_last_seq_id(options.last_seq_id);
  return Replicate(std::move(c)).status();
}

absl::Status ReplicatedRunner::SaveWeightsForSampler(const std::string& model_id,
                                                     const std::string& fs_path, bool merged,
                                                     bool overwrite) {
  if (world_size() == 1 ||
      (!runner_->SpreadsExperts() && (!merged || !runner_->Gathers(model_id)))) {
    return runner_->SaveWeightsForSampler(model_id, fs_path, merged, overwrite);
  }
  v1::internal::Command c;
  auto* e = c.mutable_export_weights();
  e->set_model_id(model_id);
  e->set_fs_path(fs_path);
  e->set_overwrite(overwrite);
  e->set_adapter(!merged);
  return Replicate(std::move(c)).status();
}

absl::StatusOr<std::shared_ptr<const Policy>> ReplicatedRunner::FreezePolicy(
    const std::string& model_id) {
  const bool spread = runner_->SpreadsExperts() && !model_id.empty();
  if (world_size() == 1 || (!runner_->Gathers(model_id) && !spread)) {
    return runner_->FreezePolicy(model_id);
  }
  v1::internal::Command c;
  c.set_freeze_policy(model_id);
  if (spread) c.set_experts_key(++experts_keys_);
  ASSIGN_OR_RETURN(CommandResult r, Replicate(std::move(c)));
  return std::move(r.policy);
}

absl::StatusOr<std::shared_ptr<const Policy>> ReplicatedRunner::LoadPolicy(
    const std::string& fs_path) {
  if (world_size() == 1 || !runner_->SpreadsExperts()) return runner_->LoadPolicy(fs_path);
  v1::internal::Command c;
  c.set_load_policy(fs_path);
  c.set_experts_key(++experts_keys_);
  ASSIGN_OR_RETURN(CommandResult r, Replicate(std::move(c)));
  return std::move(r.policy);
}

absl::StatusOr<std::string> ReplicatedRunner::CreateModelFromState(const std::string& fs_path,
                                                                   bool with_optimizer) {
  v1::internal::Command c;
  c.mutable_load_state()->set_fs_path(fs_path);
  c.mutable_load_state()->set_with_optimizer(with_optimizer);
  ASSIGN_OR_RETURN(*c.mutable_new_model_id(), ModelRunner::NewModelId());
  ASSIGN_OR_RETURN(CommandResult r, Replicate(std::move(c)));
  return std::move(r.model_id);
}

absl::Status ReplicatedRunner::Ping() {
  if (collectives_->world_size() == 1) return absl::OkStatus();
  v1::internal::Command c;
  c.set_ping(true);
  return Replicate(std::move(c)).status();
}

void ReplicatedRunner::Shutdown() {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return;
  shut_down_ = true;
  if (collectives_->world_size() > 1 && broken_.ok()) {
    v1::internal::Command c;
    c.set_shutdown(true);
    std::string bytes = c.SerializeAsString();
    // The other ranks exit as soon as they read this, so the transport may see them hang up
    // before the broadcast completes here; that is the expected end, not a failure.
    (void)collectives_->BroadcastBytes(bytes, 0);
  }
}

absl::Status ReplicatedRunner::FollowerLoop(ModelRunner* runner, Collectives* collectives) {
  TLOG_INFO("following rank 0's commands");
  while (true) {
    std::string bytes;
    if (auto st = collectives->BroadcastBytes(bytes, 0); !st.ok()) {
      TLOG_ERROR("lost rank 0: {}", std::string(st.message()));
      return st;
    }
    v1::internal::Command wire;
    if (!wire.ParseFromString(bytes)) return absl::DataLossError("unparsable command from rank 0");
    // Before the command, whether or not it decodes: rank 0 no longer holds these keys.
    if (!wire.dropped_experts().empty()) {
      runner->DropFrozen({wire.dropped_experts().begin(), wire.dropped_experts().end()});
    }
    if (wire.has_shutdown()) {
      TLOG_INFO("rank 0 shut down; exiting");
      return absl::OkStatus();
    }
    // Rank 0 reports errors to the client; a failed collective, or an outcome other than the
    // other ranks', means this rank is out of step, and the job ends.
    absl::StatusOr<Command> cmd = DecodeCommand(std::move(wire), runner->limits());
    absl::Status st = cmd.ok() ? Execute(runner, *std::move(cmd)).status() : cmd.status();
    if (st.code() == absl::StatusCode::kUnavailable) return st;
    if (absl::Status agreed = AgreeOnOutcome(collectives, st); !agreed.ok()) {
      TLOG_ERROR("{}", std::string(agreed.message()));
      return agreed;
    }
  }
}

}  // namespace tinkerd
