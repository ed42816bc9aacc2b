#include "runner/batch.h"

#include "absl/strings/str_cat.h"

namespace tinkerd {

absl::Status CheckLossForModel(const ResolvedLoss& loss, const ModelLimits& limits) {
  if (loss.router_aux_loss_coef != 0 && limits.routed_layers == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss_fn_config[\"", kRouterAuxLossCoef,
                     "\"]: the base model routes no layer (it is not a mixture of experts), so "
                     "it has no router loss"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Batch> Batch::Check(std::vector<Datum> data, ResolvedLoss loss,
                                   const ModelLimits& limits) {
  if (loss.spec == nullptr) return absl::InvalidArgumentError("loss_fn: not resolved");
  if (absl::Status st = CheckLossForModel(loss, limits); !st.ok()) return st;
  if (absl::Status st = ValidateData(data, *loss.spec, limits); !st.ok()) return st;
  return Batch(std::move(data), std::move(loss));
}

absl::StatusOr<Batch> Batch::Check(std::vector<Datum> data, const std::string& loss_fn,
                                   const std::map<std::string, double>& loss_fn_config,
                                   const ModelLimits& limits) {
  absl::StatusOr<ResolvedLoss> loss = ResolveLoss(loss_fn, loss_fn_config);
  if (!loss.ok()) return loss.status();
  return Check(std::move(data), *std::move(loss), limits);
}

absl::Status Batch::Append(Batch&& more) {
  if (!(more.loss_ == loss_)) {
    return absl::InvalidArgumentError("loss_fn: a batch appended to one of another loss");
  }
  // Both are non-empty (Check refuses an empty batch) and each shares one target shape.
  if (TargetWidth(more.data_.front()) != TargetWidth(data_.front())) {
    return absl::InvalidArgumentError(
        "loss_fn_inputs[\"target_tokens\"]: a datum's targets per position differ from the "
        "call's first datum's; the datums of a call share one target shape");
  }
  data_.insert(data_.end(), std::make_move_iterator(more.data_.begin()),
               std::make_move_iterator(more.data_.end()));
  more.data_.clear();
  return absl::OkStatus();
}

}  // namespace tinkerd
