// A batch of datums that passed every check, with its resolved loss. It is made once where a
// request enters the server (decoded from the wire and checked there), and the runner trusts it
// without checking again: the type is the proof, since Check is the only way to make one.
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "runner/loss/loss_spec.h"
#include "runner/types.h"
#include "runner/validate.h"

namespace tinkerd {

// InvalidArgument, naming the key, for a loss the model cannot compute: the router's loss on a
// dense model. Part of Check; a stream checks it when it begins, before its first datum.
absl::Status CheckLossForModel(const ResolvedLoss& loss, const ModelLimits& limits);

class Batch {
 public:
  // ValidateData's checks of `data` against `loss` and the model's limits.
  static absl::StatusOr<Batch> Check(std::vector<Datum> data, ResolvedLoss loss,
                                     const ModelLimits& limits);
  // ResolveLoss, then Check.
  static absl::StatusOr<Batch> Check(std::vector<Datum> data, const std::string& loss_fn,
                                     const std::map<std::string, double>& loss_fn_config,
                                     const ModelLimits& limits);

  const std::vector<Datum>& data() const { return data_; }
  const ResolvedLoss& loss() const { return loss_; }
  // Appends the datums of a batch of the same loss: every datum was checked alone, so the
  // concatenation holds only checked datums (a stream's datums arrive one by one).
  absl::Status Append(Batch&& more);
  std::vector<Datum> TakeData() && { return std::move(data_); }

 private:
  Batch(std::vector<Datum> data, ResolvedLoss loss)
      : data_(std::move(data)), loss_(std::move(loss)) {}
  std::vector<Datum> data_;
  ResolvedLoss loss_;
};

}  // namespace tinkerd
