#include "runner/joint_call.h"

#include <algorithm>
#include <map>
#include <memory>
#include <optional>

#include "runner/util/exception_status.h"

namespace tinkerd {

std::vector<std::vector<std::pair<int, int>>> PlanPasses(
    const std::vector<std::vector<int64_t>>& tokens, int64_t budget) {
  std::vector<size_t> next(tokens.size(), 0);
  std::vector<std::vector<std::pair<int, int>>> passes;
  while (true) {
    std::vector<std::pair<int, int>> pass;
    int64_t used = 0;
    // First fit over the calls in order, each call's next micro-batch at most once per pass.
    for (size_t c = 0; c < tokens.size(); ++c) {
      if (next[c] == tokens[c].size()) continue;
      const int64_t t = tokens[c][next[c]];
      if (!pass.empty() && used + t > budget) continue;
      pass.emplace_back(static_cast<int>(c), static_cast<int>(next[c]++));
      used += t;
    }
    if (pass.empty()) return passes;
    passes.push_back(std::move(pass));
  }
}

std::vector<absl::StatusOr<ForwardBackwardResult>> RunJoint(const StepContext& ctx,
                                                            const std::vector<JointCall>& calls,
                                                            bool backward, const RunAlone& alone) {
  Collectives& c = *ctx.collectives;
  std::vector<absl::StatusOr<ForwardBackwardResult>> results(
      calls.size(), absl::InternalError("joint call: not run"));
  // Admission: a call joins when every rank admits its memory beside the earlier ones'.
  std::vector<Reservation> memory(calls.size());
  std::vector<int64_t> admitted(calls.size(), 0);
  for (size_t i = 0; i < calls.size(); ++i) {
    auto r = ReserveCall(ctx, *calls[i].model, calls[i].batch->data(), backward);
    if (r.ok()) {
      memory[i] = *std::move(r);
      admitted[i] = 1;
    }
  }
  absl::Status agreed = c.AllReduceSumCounts(admitted);
  std::vector<size_t> joined, later;
  for (size_t i = 0; i < calls.size(); ++i) {
    (agreed.ok() && admitted[i] == c.world_size() ? joined : later).push_back(i);
  }
  if (!agreed.ok()) {
    for (auto& r : results) r = agreed;
    return results;
  }
  for (size_t i : later) memory[i] = Reservation();

  // The shared passes, staged per call.
  std::vector<std::unique_ptr<CallStage>> stages;
  std::vector<std::vector<std::vector<int>>> plans;
  std::vector<std::vector<int64_t>> tokens;
  absl::Status local;
  try {
    for (size_t i : joined) {
      stages.push_back(
          std::make_unique<CallStage>(ctx, *calls[i].model, calls[i].batch->loss(), backward));
      const std::vector<Datum>& data = calls[i].batch->data();
      plans.push_back(stages.back()->Plan(data));
      std::vector<int64_t>& t = tokens.emplace_back();
      for (const std::vector<int>& mb : plans.back()) {
        int64_t n = 0;
        for (int d : mb) n += static_cast<int64_t>(data[d].tokens.size());
        t.push_back(n);
      }
    }
    for (const auto& pass : PlanPasses(tokens, ctx.micro_batch_tokens)) {
      std::vector<Piece> pieces;
      for (auto [call, mb] : pass) pieces.push_back({stages[call].get(), plans[call][mb]});
      RunPacked(Pack(std::move(pieces)));
    }
  } catch (...) {
    local = ExceptionStatus("forward_backward (shared pass)", std::current_exception());
  }
  bool all_ok = local.ok();
  if (absl::Status st = c.AllAgree(all_ok); !st.ok()) {
    for (auto& r : results) r = st;
    return results;
  }
  if (all_ok) {
    for (size_t k = 0; k < joined.size(); ++k) {
      try {
        results[joined[k]] = stages[k]->Commit(local);
      } catch (...) {
        // A commit that throws may have left this rank's collectives out of step with the
        // others': the job's failure (UNAVAILABLE), the calls committed before it kept.
        const absl::Status st = ExceptionStatus("forward_backward", std::current_exception());
        for (size_t j = k; j < joined.size(); ++j) {
          results[joined[j]] = absl::UnavailableError(st.message());
        }
        return results;
      }
    }
  } else {
    // Nothing was applied (stages commit only here): each call runs again alone, so a failure
    // is its own call's.
    later.insert(later.begin(), joined.begin(), joined.end());
  }
  stages.clear();
  memory.clear();
  std::sort(later.begin(), later.end());
  for (size_t i : later) results[i] = alone(calls[i]);
  return results;
}

std::vector<absl::StatusOr<OptimStepResult>> StepJoint(const StepContext& ctx,
                                                       const std::vector<JointStep>& steps) {
  std::vector<absl::StatusOr<OptimStepResult>> results(steps.size(),
                                                       absl::InternalError("joint step: not run"));
  const bool replicas = ctx.collectives->world_size() > 1;
  // An exception between two of a step's collectives may leave this rank out of step with the
  // others; with other ranks the job then fails (UNAVAILABLE) rather than go on to the next
  // model's collectives, which would pair with another model's.
  auto fail_from = [&](size_t i, const absl::Status& st) {
    for (size_t j = i; j < steps.size(); ++j) {
      if (results[j].status().code() == absl::StatusCode::kInternal) {
        results[j] = absl::UnavailableError(st.message());
      }
    }
    return results;
  };
  std::vector<absl::StatusOr<PreparedStep>> prepared;
  std::vector<size_t> alone;  // refused memory beside the others: run alone once they are done
  for (size_t i = 0; i < steps.size(); ++i) {
    try {
      prepared.push_back(PrepareOptimStep(ctx, *steps[i].model, steps[i].params));
    } catch (...) {
      const absl::Status st = ExceptionStatus("optim_step", std::current_exception());
      if (replicas) return fail_from(i, st);
      prepared.push_back(st);
    }
    // Memory is reserved only in a world of one, so this is every rank's outcome.
    if (prepared.back().status().code() == absl::StatusCode::kResourceExhausted) {
      alone.push_back(i);
    }
  }
  // One AdamW per set of equal scalars, over every such model's tensors in model order. Each
  // step's reservation covers its share of AdamW's transient, and all are held here.
  using Key = std::tuple<double, double, double, double, double, int64_t>;
  std::map<Key, std::vector<size_t>> groups;
  for (size_t i = 0; i < prepared.size(); ++i) {
    if (!prepared[i].ok() || prepared[i]->result.skipped) continue;
    const kernels::AdamWParams& a = prepared[i]->adam;
    groups[{a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.step}].push_back(i);
  }
  for (const auto& [key, members] : groups) {
    kernels::AdamWParams adam = prepared[members.front()]->adam;  // the scalars
    adam.params.clear();
    adam.grads.clear();
    adam.exp_avgs.clear();
    adam.exp_avg_sqs.clear();
    for (size_t i : members) {
      const kernels::AdamWParams& a = prepared[i]->adam;
      adam.params.insert(adam.params.end(), a.params.begin(), a.params.end());
      adam.grads.insert(adam.grads.end(), a.grads.begin(), a.grads.end());
      adam.exp_avgs.insert(adam.exp_avgs.end(), a.exp_avgs.begin(), a.exp_avgs.end());
      adam.exp_avg_sqs.insert(adam.exp_avg_sqs.end(), a.exp_avg_sqs.begin(), a.exp_avg_sqs.end());
    }
    try {
      at::NoGradGuard no_grad;
      kernels::AdamW(adam);
    } catch (...) {
      const absl::Status st = ExceptionStatus("optim_step", std::current_exception());
      if (replicas) return fail_from(0, st);
      for (size_t i : members) prepared[i] = st;
    }
  }
  for (size_t i = 0; i < prepared.size(); ++i) {
    if (!prepared[i].ok()) {
      results[i] = prepared[i].status();
      continue;
    }
    try {
      results[i] = FinishOptimStep(ctx, *prepared[i]);
    } catch (...) {
      const absl::Status st = ExceptionStatus("optim_step", std::current_exception());
      if (replicas) return fail_from(i, st);
      results[i] = st;
    }
  }
  prepared.clear();  // the reservations released
  for (size_t i : alone) {
    try {
      results[i] = ApplyOptimStep(ctx, *steps[i].model, steps[i].params);
    } catch (...) {
      results[i] = ExceptionStatus("optim_step", std::current_exception());
    }
  }
  return results;
}

}  // namespace tinkerd
