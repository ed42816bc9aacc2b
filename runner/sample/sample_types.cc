#include "runner/sample/sample_types.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "absl/strings/str_cat.h"

namespace tinkerd {
namespace {

absl::Status Invalid(const std::string& field, const std::string& reason) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", reason));
}

absl::Status CheckTokens(const std::string& field, const std::vector<int64_t>& tokens,
                         int64_t vocab) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab) {
      return Invalid(
          absl::StrCat(field, "[", i, "]"),
          absl::StrCat("token id ", tokens[i], " is outside the vocabulary [0, ", vocab, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckPromptFits(int64_t tokens, const ModelLimits& model) {
  if (model.max_context_length > 0 && tokens > model.max_context_length) {
    return Invalid("prompt",
                   absl::StrCat("has ", tokens, " tokens, more than the model's context of ",
                                model.max_context_length));
  }
  return absl::OkStatus();
}

absl::Status CheckStopStringsMatchable(size_t stop_strings, const ModelLimits& model) {
  if (stop_strings == 0 || model.tokenizer) return absl::OkStatus();
  return Invalid("sampling_params.stop",
                 "stop strings need the model's tokenizer (tokenizer.json or tokenizer.model in "
                 "its directory), and this model has none; send stop token ids");
}

absl::Status ValidateSampleRequest(const SampleRequest& r, const ModelLimits& model,
                                   const SampleLimits& limits) {
  const SamplingParams& p = r.params;
  if (r.prompt.empty()) return Invalid("prompt", "is empty");
  if (r.routed_experts && model.routed_layers == 0) {
    return Invalid("routed_experts",
                   "the model routes no experts (router replay is for mixtures "
                   "of experts)");
  }
  if (auto st = CheckTokens("prompt", r.prompt, model.vocab_size); !st.ok()) return st;
  if (auto st = CheckPromptFits(std::ssize(r.prompt), model); !st.ok()) return st;
  if (p.max_tokens <= 0) {
    return Invalid("sampling_params.max_tokens",
                   absl::StrCat("must be positive, got ", p.max_tokens));
  }
  const int64_t length = static_cast<int64_t>(r.prompt.size()) + p.max_tokens;
  if (model.max_context_length > 0 && length > model.max_context_length) {
    return Invalid(
        "sampling_params.max_tokens",
        absl::StrCat("prompt (", r.prompt.size(), " tokens) + max_tokens (", p.max_tokens,
                     ") exceeds the model's context of ", model.max_context_length));
  }
  if (!std::isfinite(p.temperature) || p.temperature < 0) {
    return Invalid("sampling_params.temperature",
                   absl::StrCat("must be finite and >= 0, got ", p.temperature));
  }
  if (!(p.top_p > 0 && p.top_p <= 1)) {
    return Invalid("sampling_params.top_p", absl::StrCat("must be in (0, 1], got ", p.top_p));
  }
  for (size_t i = 0; i < p.stop.size(); ++i) {
    const std::string field = absl::StrCat("sampling_params.stop[", i, "]");
    if (p.stop[i].empty()) return Invalid(field, "is empty");
    if (auto st = CheckTokens(field, p.stop[i], model.vocab_size); !st.ok()) return st;
  }
  if (auto st = CheckStopStringsMatchable(p.stop_strings.size(), model); !st.ok()) return st;
  if (std::ssize(p.stop_strings) > limits.max_stop_strings) {
    return Invalid("sampling_params.stop",
                   absl::StrCat("at most ", limits.max_stop_strings, " stop strings, got ",
                                p.stop_strings.size()));
  }
  for (size_t i = 0; i < p.stop_strings.size(); ++i) {
    const std::string field = absl::StrCat("sampling_params.stop[", i, "]");
    if (p.stop_strings[i].empty()) return Invalid(field, "is an empty string");
    if (std::ssize(p.stop_strings[i]) > limits.max_stop_string_bytes) {
      return Invalid(field,
                     absl::StrCat("is longer than ", limits.max_stop_string_bytes, " bytes"));
    }
  }
  if (r.num_samples < 1 || r.num_samples > limits.max_num_samples) {
    return Invalid("num_samples", absl::StrCat("must be in [1, ", limits.max_num_samples, "], got ",
                                               r.num_samples));
  }
  for (const auto& [field, k, max] :
       {std::tuple<const char*, int64_t, int64_t>{"topk_prompt_logprobs", r.topk_prompt_logprobs,
                                                  limits.max_topk_prompt_logprobs},
        {"topk_sample_logprobs", r.topk_sample_logprobs, limits.max_topk_sample_logprobs}}) {
    const int64_t most = std::min(max, model.vocab_size);
    if (k < 0 || k > most) {
      return Invalid(field, absl::StrCat("must be in [0, ", most, "], got ", k));
    }
  }
  const int64_t P = std::ssize(r.prompt);
  if (r.prompt_alt_tokens_k < 0 || r.prompt_alt_tokens_k > limits.max_prompt_alt_tokens_k) {
    return Invalid("prompt_alt_tokens_k",
                   absl::StrCat("must be in [0, ", limits.max_prompt_alt_tokens_k, "], got ",
                                r.prompt_alt_tokens_k));
  }
  if (r.prompt_alt_tokens_k > 0 && P < 2) {
    return Invalid("prompt_alt_tokens_k", "needs a prompt of at least 2 tokens");
  }
  if (r.prompt_logprobs_last_n != 0) {
    if (!r.prompt_logprobs) {
      return Invalid("prompt_logprobs_last_n", "needs prompt_logprobs");
    }
    if (r.prompt_logprobs_last_n < 1 || r.prompt_logprobs_last_n > P - 1) {
      return Invalid("prompt_logprobs_last_n",
                     absl::StrCat("must be in [1, len(prompt) - 1 = ", P - 1, "], got ",
                                  r.prompt_logprobs_last_n));
    }
  }
  if (r.target_prompt_k != 0 || !r.target_prompt_ids.empty()) {
    const int64_t K = r.target_prompt_k;
    if (K < 1 || K > limits.max_target_prompt_k) {
      return Invalid("target_prompt_logprobs",
                     absl::StrCat("K = ", K, " ids per position must be in [1, ",
                                  limits.max_target_prompt_k, "]"));
    }
    if (std::ssize(r.target_prompt_ids) != (P - 1) * K) {
      return Invalid("target_prompt_logprobs",
                     absl::StrCat("must be [len(prompt) - 1, K] = [", P - 1, ", ", K, "], got ",
                                  r.target_prompt_ids.size(), " ids"));
    }
    bool any = false;
    for (size_t i = 0; i < r.target_prompt_ids.size(); ++i) {
      const int64_t id = r.target_prompt_ids[i];
      if (id == -1) continue;
      any = true;
      if (id < 0 || id >= model.vocab_size) {
        return Invalid(absl::StrCat("target_prompt_logprobs[", i / K, "][", i % K, "]"),
                       absl::StrCat("token id ", id, " is outside the vocabulary [0, ",
                                    model.vocab_size, ") (-1 asks for nothing)"));
      }
    }
    if (!any) return Invalid("target_prompt_logprobs", "names no token id (every cell is -1)");
  }
  return absl::OkStatus();
}

}  // namespace tinkerd
