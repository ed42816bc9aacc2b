#include "runner/validate.h"

#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tinkerd {
namespace {

absl::Status Field(size_t i, const std::string& key, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("data[", i, "].loss_fn_inputs[\"", key, "\"]: ", why));
}

absl::Status CheckShape(size_t i, const std::string& key, const TensorData& t, int64_t T) {
  if (t.shape.size() > 1) {
    return Field(i, key,
                 absl::StrCat("must be 1-D, got ", t.shape.size(),
                              "-D (top-K targets are not supported yet)"));
  }
  if (!t.shape.empty() && t.shape[0] != t.NumElements()) {
    return Field(
        i, key,
        absl::StrCat("shape [", t.shape[0], "] does not match its ", t.NumElements(), " values"));
  }
  if (t.NumElements() != T) {
    return Field(
        i, key, absl::StrCat("length ", t.NumElements(), " does not match model_input length ", T));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateData(const std::vector<Datum>& data, const LossSpec& loss,
                          const ModelLimits& limits) {
  if (data.empty()) return absl::InvalidArgumentError("data: the batch has no datums");
  std::set<std::string> allowed{"target_tokens", "mask"};
  for (const std::string& k : loss.required_inputs) allowed.insert(k);
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
    if (auto st = CheckShape(i, "target_tokens", tgt, T); !st.ok()) return st;
    for (int64_t t = 0; t < T; ++t) {
      if (tgt.int64_data[t] < 0 || tgt.int64_data[t] >= limits.vocab_size) {
        return Field(i, "target_tokens",
                     absl::StrCat("token ", tgt.int64_data[t], " at position ", t,
                                  " is outside [0, ", limits.vocab_size, ")"));
      }
    }
    std::vector<std::string> floats = loss.required_inputs;
    if (d.loss_fn_inputs.count("mask")) floats.push_back("mask");
    for (const std::string& key : floats) {
      auto f = d.loss_fn_inputs.find(key);
      if (f == d.loss_fn_inputs.end())
        return Field(i, key, absl::StrCat("missing (", loss.name, " needs it)"));
      const TensorData& t = f->second;
      if (t.dtype != TensorData::DType::kFloat32) return Field(i, key, "must be float32");
      if (auto st = CheckShape(i, key, t, T); !st.ok()) return st;
      for (int64_t p = 0; p < T; ++p) {
        const float v = t.float32_data[p];
        if (!std::isfinite(v)) {
          return Field(i, key, absl::StrCat("value at position ", p, " is not finite"));
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
