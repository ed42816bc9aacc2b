#include "server/core/command.h"

#include "runner/util/status_macros.h"
#include "server/core/convert.h"

namespace tinkerd {
namespace {

absl::Status RunSave(ModelRunner* r, const v1::internal::SaveState& s) {
  SaveStateOptions o;
  o.overwrite = s.overwrite();
  o.include_accumulated = s.include_accumulated();
  o.last_seq_id = s.last_seq_id();
  return r->SaveState(s.model_id(), s.fs_path(), o);
}

absl::StatusOr<std::string> RunCreate(ModelRunner* r, const v1::CreateModelRequest& req,
                                      const std::string& model_id) {
  ASSIGN_OR_RETURN(CreateModelOptions opts, CreateOptionsFromProto(req));
  return r->CreateModel(opts, model_id);
}

absl::Status NotDecoded() {
  return absl::InternalError("a command's datums were not decoded before it ran");
}

}  // namespace

absl::StatusOr<Command> DecodeCommand(v1::internal::Command wire, const ModelLimits& limits) {
  using C = v1::internal::Command;
  Command cmd;
  switch (wire.op_case()) {
    case C::kForwardBackward:
    case C::kForward: {
      const v1::ForwardBackwardRequest& r =
          wire.has_forward_backward() ? wire.forward_backward() : wire.forward();
      ASSIGN_OR_RETURN(cmd.batch, BatchFromProto(r.data(), r.loss_fn(), limits));
      break;
    }
    case C::kStreamAppend: {
      const v1::internal::StreamAppend& a = wire.stream_append();
      ASSIGN_OR_RETURN(cmd.batch, BatchFromProto(a.data(), a.loss_fn(), limits));
      break;
    }
    case C::kJoint:
      for (const v1::ForwardBackwardRequest& r : wire.joint().calls()) {
        ASSIGN_OR_RETURN(Batch b, BatchFromProto(r.data(), r.loss_fn(), limits));
        cmd.batches.push_back(std::move(b));
      }
      break;
    default:
      break;
  }
  cmd.wire = std::move(wire);
  return cmd;
}

absl::StatusOr<CommandResult> Execute(ModelRunner* r, Command cmd) {
  using C = v1::internal::Command;
  const v1::internal::Command& w = cmd.wire;
  const Batch* batch = cmd.batch.has_value() ? &*cmd.batch : nullptr;
  CommandResult out;
  switch (w.op_case()) {
    case C::kCreateModel: {
      ASSIGN_OR_RETURN(out.model_id, RunCreate(r, w.create_model(), w.new_model_id()));
      return out;
    }
    case C::kDeleteModel:
      RETURN_IF_ERROR(r->DeleteModel(w.delete_model()));
      return out;
    case C::kForwardBackward: {
      if (batch == nullptr) return NotDecoded();
      ASSIGN_OR_RETURN(out.forward, r->ForwardBackward(w.forward_backward().model_id(), *batch));
      return out;
    }
    case C::kForward: {
      if (batch == nullptr) return NotDecoded();
      ASSIGN_OR_RETURN(out.forward, r->Forward(w.forward().model_id(), *batch));
      return out;
    }
    case C::kJoint: {
      const auto& calls = w.joint().calls();
      if (cmd.batches.size() != static_cast<size_t>(calls.size())) return NotDecoded();
      std::vector<ModelRunner::Call> joint;
      for (int i = 0; i < calls.size(); ++i)
        joint.push_back({calls[i].model_id(), &cmd.batches[i]});
      out.joint = r->ForwardBackwardJoint(joint, w.joint().backward());
      // A failed collective leaves the ranks out of step: the command's failure, not a call's.
      for (const auto& one : out.joint) {
        if (one.status().code() == absl::StatusCode::kUnavailable) return one.status();
      }
      return out;
    }
    case C::kJointSteps: {
      std::vector<ModelRunner::Step> steps;
      for (const v1::OptimStepRequest& o : w.joint_steps().steps()) {
        steps.push_back({o.model_id(), AdamFromProto(o.adam_params())});
      }
      out.joint_steps = r->OptimStepJoint(steps);
      for (const auto& one : out.joint_steps) {
        if (one.status().code() == absl::StatusCode::kUnavailable) return one.status();
      }
      return out;
    }
    case C::kOptimStep: {
      const auto& o = w.optim_step();
      ASSIGN_OR_RETURN(out.step, r->OptimStep(o.model_id(), AdamFromProto(o.adam_params())));
      return out;
    }
    case C::kStreamBegin: {
      const auto& b = w.stream_begin();
      ASSIGN_OR_RETURN(out.stream_id, r->BeginStream(b.model_id(), b.loss_fn().name(),
                                                     ConfigFromProto(b.loss_fn())));
      return out;
    }
    case C::kStreamAppend: {
      if (batch == nullptr) return NotDecoded();
      RETURN_IF_ERROR(r->StreamAppend(w.stream_append().stream_id(), *std::move(cmd.batch)));
      return out;
    }
    case C::kStreamFinish: {
      ASSIGN_OR_RETURN(out.forward, r->FinishStream(w.stream_finish()));
      return out;
    }
    case C::kStreamAbort:
      r->AbortStream(w.stream_abort());
      return out;
    case C::kLoadState: {
      const auto& l = w.load_state();
      if (l.model_id().empty()) {
        ASSIGN_OR_RETURN(out.model_id, r->CreateModelFromState(l.fs_path(), l.with_optimizer(),
                                                               w.new_model_id()));
        return out;
      }
      RETURN_IF_ERROR(r->LoadState(l.model_id(), l.fs_path(), l.with_optimizer()));
      return out;
    }
    case C::kSaveState:
      RETURN_IF_ERROR(RunSave(r, w.save_state()));
      return out;
    case C::kExportWeights: {
      const auto& e = w.export_weights();
      RETURN_IF_ERROR(
          r->SaveWeightsForSampler(e.model_id(), e.fs_path(), !e.adapter(), e.overwrite()));
      return out;
    }
    case C::kFreezePolicy: {
      ASSIGN_OR_RETURN(out.policy, r->FreezePolicy(w.freeze_policy(), w.experts_key()));
      return out;
    }
    case C::kLoadPolicy: {
      ASSIGN_OR_RETURN(out.policy, r->LoadPolicy(w.load_policy(), w.experts_key()));
      return out;
    }
    case C::kBaseForward:
      RETURN_IF_ERROR(r->ForwardGatheredBase(cmd.forward));
      return out;
    case C::kExpertForward:
      RETURN_IF_ERROR(r->ForwardSpreadExperts(cmd.lead));
      return out;
    case C::kPing:
    case C::kShutdown:
    case C::OP_NOT_SET:
      return out;
  }
  return out;
}

}  // namespace tinkerd
