#include "runner/sample/sample_types.h"

#include <cmath>

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
  if (r.topk_prompt_logprobs < 0 || r.topk_prompt_logprobs > limits.max_topk_prompt_logprobs) {
    return Invalid("topk_prompt_logprobs",
                   absl::StrCat("must be in [0, ", limits.max_topk_prompt_logprobs, "], got ",
                                r.topk_prompt_logprobs));
  }
  return absl::OkStatus();
}

}  // namespace tinkerd
