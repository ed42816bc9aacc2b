#include "runner/validate.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "runner/util/status_macros.h"

namespace tinkerd {
namespace {

absl::Status Field(size_t i, const std::string& key, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("data[", i, "].loss_fn_inputs[\"", key, "\"]: ", why));
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// The shape an input must have: [T], or [T, K] where the datum's targets are top-K (K > 0).
std::vector<int64_t> Want(int64_t T, int64_t K) {
  return K > 0 ? std::vector<int64_t>{T, K} : std::vector<int64_t>{T};
}

// Where element p of a [T] or [T, K] input sits.
std::string Where(size_t p, int64_t K) {
  if (K <= 0) return absl::StrCat("position ", p);
  return absl::StrCat("position ", p / K, ", column ", p % K);
}

absl::Status CheckShape(size_t i, const std::string& key, const TensorData& t,
                        const std::vector<int64_t>& want) {
  // An unset shape means 1-D of the data's length.
  const std::vector<int64_t> shape =
      t.shape.empty() ? std::vector<int64_t>{t.NumElements()} : t.shape;
  if (shape != want) {
    return Field(i, key,
                 absl::StrCat("shape ", ShapeText(shape), " does not match model_input: want ",
                              ShapeText(want)));
  }
  // Dimensions ≤ the context length and the vocabulary (checked before), so no overflow.
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  if (n != t.NumElements()) {
    return Field(i, key,
                 absl::StrCat("shape ", ShapeText(shape), " does not match its ", t.NumElements(),
                              " values"));
  }
  return absl::OkStatus();
}

// The targets' shape: [T] (K = 0) or [T, K] with 0 < K ≤ vocab, top-K targets, which only
// cross_entropy takes. K is the same for every datum of a call (the SDK returns one batched
// logprobs tensor per call).
absl::StatusOr<int64_t> CheckTargetWidth(size_t i, const TensorData& tgt, const LossSpec& loss,
                                         const ModelLimits& limits) {
  if (tgt.shape.size() <= 1) return 0;
  if (tgt.shape.size() > 2) {
    return Field(i, "target_tokens",
                 absl::StrCat("shape ", ShapeText(tgt.shape), " must be [T] or [T, K]"));
  }
  if (loss.name != "cross_entropy") {
    return Field(i, "target_tokens",
                 absl::StrCat("shape ", ShapeText(tgt.shape), " is top-K; ", loss.name,
                              " takes [T] targets (only cross_entropy takes [T, K])"));
  }
  const int64_t K = tgt.shape[1];
  if (K < 1 || K > limits.vocab_size) {
    return Field(i, "target_tokens",
                 absl::StrCat("K = ", K, " targets per position must be in [1, ", limits.vocab_size,
                              "] (the vocabulary)"));
  }
  return K;
}

// Router replay's input: [T, R, k] expert ids, distinct within each token's layer (a repeated
// expert would count twice in the token's output).
absl::Status CheckRoutes(size_t i, const TensorData& t, int64_t T, const ModelLimits& limits) {
  const char* key = "routed_experts";
  if (t.dtype != TensorData::DType::kInt64) return Field(i, key, "must be int64");
  const int64_t k = limits.top_k;
  RETURN_IF_ERROR(CheckShape(i, key, t, {T, limits.routed_layers, k}));
  if (t.shape.empty()) return Field(i, key, "must be [T, routed layers, experts per token]");
  // Where row `row` (a token's k experts in one layer) sits, for the messages.
  auto at = [&](size_t row) {
    const auto r = static_cast<int64_t>(row) / k;
    return absl::StrCat("position ", r / limits.routed_layers, ", routed layer ",
                        r % limits.routed_layers);
  };
  for (size_t row = 0; row < t.int64_data.size(); row += static_cast<size_t>(k)) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = t.int64_data[row + static_cast<size_t>(j)];
      if (e < 0 || e >= limits.experts) {
        return Field(
            i, key,
            absl::StrCat("expert ", e, " at ", at(row), " is outside [0, ", limits.experts, ")"));
      }
      for (int64_t other = 0; other < j; ++other) {
        if (t.int64_data[row + static_cast<size_t>(other)] == e) {
          return Field(i, key, absl::StrCat("expert ", e, " appears twice at ", at(row)));
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

int64_t TargetWidth(const Datum& d) {
  auto it = d.loss_fn_inputs.find("target_tokens");
  return it != d.loss_fn_inputs.end() && it->second.shape.size() == 2 ? it->second.shape[1] : 0;
}

absl::Status ValidateData(const std::vector<Datum>& data, const LossSpec& loss,
                          const ModelLimits& limits) {
  if (data.empty()) return absl::InvalidArgumentError("data: the batch has no datums");
  std::set<std::string> allowed{"target_tokens", "mask"};
  for (const std::string& k : loss.required_inputs) allowed.insert(k);
  if (limits.routed_layers > 0) allowed.insert("routed_experts");
  int64_t call_width = -1;
  int replays = -1;  // whether data[0] carries routed_experts
  for (size_t i = 0; i < data.size(); ++i) {
    const Datum& d = data[i];
    const int64_t T = static_cast<int64_t>(d.tokens.size());
    if (T == 0) return absl::InvalidArgumentError(absl::StrCat("data[", i, "].model_input: empty"));
    if (T > limits.max_context_length) {
      return absl::InvalidArgumentError(absl::StrCat("data[", i, "].model_input: length ", T,
                                                     " exceeds the model's context length ",
                                                     limits.max_context_length));
    }
    for (int64_t t = 0; t < T; ++t) {
      if (d.tokens[t] < 0 || d.tokens[t] >= limits.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat("data[", i, "].model_input: token ",
                                                       d.tokens[t], " at position ", t,
                                                       " is outside [0, ", limits.vocab_size, ")"));
      }
    }
    for (const auto& [key, t] : d.loss_fn_inputs) {
      if (key == "routed_experts" && limits.routed_layers == 0) {
        return Field(i, key,
                     "the model routes no experts (router replay is for mixtures of experts)");
      }
      if (!allowed.count(key)) {
        return Field(i, key,
                     absl::StrCat("not an input of ", loss.name, " (expected ",
                                  absl::StrJoin(allowed, ", "), ")"));
      }
    }
    auto it = d.loss_fn_inputs.find("target_tokens");
    if (it == d.loss_fn_inputs.end()) return Field(i, "target_tokens", "missing");
    const TensorData& tgt = it->second;
    if (tgt.dtype != TensorData::DType::kInt64) return Field(i, "target_tokens", "must be int64");
    absl::StatusOr<int64_t> K = CheckTargetWidth(i, tgt, loss, limits);
    if (!K.ok()) return K.status();
    if (call_width >= 0 && *K != call_width) {
      return Field(i, "target_tokens",
                   absl::StrCat(*K > 0 ? absl::StrCat("K = ", *K) : "[T]",
                                " targets per position, where data[0] has ",
                                call_width > 0 ? absl::StrCat("K = ", call_width) : "[T]",
                                "; the datums of a call share one target shape"));
    }
    call_width = *K;
    if (auto st = CheckShape(i, "target_tokens", tgt, Want(T, *K)); !st.ok()) return st;
    for (size_t p = 0; p < tgt.int64_data.size(); ++p) {
      if (tgt.int64_data[p] < 0 || tgt.int64_data[p] >= limits.vocab_size) {
        return Field(i, "target_tokens",
                     absl::StrCat("token ", tgt.int64_data[p], " at ", Where(p, *K),
                                  " is outside [0, ", limits.vocab_size, ")"));
      }
    }
    const auto routes = d.loss_fn_inputs.find("routed_experts");
    const int has_routes = routes != d.loss_fn_inputs.end();
    if (replays >= 0 && has_routes != replays) {
      return Field(i, "routed_experts",
                   "every datum of a call carries routed experts, or none does");
    }
    replays = has_routes;
    if (has_routes) RETURN_IF_ERROR(CheckRoutes(i, routes->second, T, limits));
    std::vector<std::string> floats = loss.required_inputs;
    if (d.loss_fn_inputs.count("mask")) floats.push_back("mask");
    for (const std::string& key : floats) {
      auto f = d.loss_fn_inputs.find(key);
      if (f == d.loss_fn_inputs.end())
        return Field(i, key, absl::StrCat("missing (", loss.name, " needs it)"));
      const TensorData& t = f->second;
      if (t.dtype != TensorData::DType::kFloat32) return Field(i, key, "must be float32");
      // weights go with each target; every other input is per position.
      const int64_t width = key == "weights" ? *K : 0;
      if (auto st = CheckShape(i, key, t, Want(T, width)); !st.ok()) return st;
      for (size_t p = 0; p < t.float32_data.size(); ++p) {
        const float v = t.float32_data[p];
        if (!std::isfinite(v)) {
          return Field(i, key, absl::StrCat("value at ", Where(p, width), " is not finite"));
        }
        if (key == "mask" && v != 0.0f && v != 1.0f) {
          return Field(i, key,
                       absl::StrCat("value at position ", p, " is ", v, "; must be 0 or 1"));
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateAdamParams(const AdamParams& p) {
  auto bad = [](const char* field, const char* why, double v) {
    return absl::InvalidArgumentError(
        absl::StrCat("adam_params.", field, ": ", why, " (got ", v, ")"));
  };
  if (!std::isfinite(p.learning_rate) || p.learning_rate < 0)
    return bad("learning_rate", "must be finite and >= 0", p.learning_rate);
  if (!(p.beta1 >= 0 && p.beta1 < 1)) return bad("beta1", "must be in [0, 1)", p.beta1);
  if (!(p.beta2 >= 0 && p.beta2 < 1)) return bad("beta2", "must be in [0, 1)", p.beta2);
  if (!std::isfinite(p.eps) || p.eps <= 0) return bad("eps", "must be finite and > 0", p.eps);
  if (!std::isfinite(p.weight_decay) || p.weight_decay < 0)
    return bad("weight_decay", "must be finite and >= 0", p.weight_decay);
  if (!std::isfinite(p.grad_clip_norm) || p.grad_clip_norm < 0)
    return bad("grad_clip_norm", "must be finite and >= 0 (0 disables clipping)", p.grad_clip_norm);
  return absl::OkStatus();
}

}  // namespace tinkerd
