// Conversion between the Tinker HTTP API's bodies (protobuf from proto/tinker_public and JSON, as
// the Tinker Python SDK sends and parses them) and tinkerd's wire types (tinkerd.v1). Torch-free,
// like server/core/convert.h, so the request fuzzers can drive it.
//
// Only the encoding changes here: token and tensor bytes are checked and widened to what tinkerd
// accepts (INT64 tokens, FLOAT32/INT64 tensors). Semantic checks (loss names, vocab, lengths,
// required inputs) stay with tinkerd's own decoding (server/core/convert.h), which runs afterwards
// on the result.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tinker_public/tinker_public.pb.h"
#include "tinkerd/v1/tinkerd.pb.h"

namespace tinkerd::http {

// A Tinker forward_backward request as tinkerd's. request.model_id and request.seq_id are left
// unset: the caller maps Tinker's model ids and operation numbers onto tinkerd's.
struct TinkerFwdBwd {
  v1::ForwardBackwardRequest request;
  // Tinker's forward(): the caller runs tinkerd's Forward instead of ForwardBackward.
  bool forward_only = false;
};

// Consumes *in: dense tensor bytes that need no widening are moved out, not copied, so a large
// batch is not held twice. Errors are INVALID_ARGUMENT naming the field path and the reason, e.g.
// `data[2].model_input[0]: image chunks are not supported by this server`.
//
//   EncodedTextChunk tokens (int32)      -> v1 EncodedTextChunk tokens (int64)
//   Tensor dense FLOAT32 / INT64         -> the same bytes
//   Tensor dense INT32                   -> INT64 (sign-extended)
//   Tensor dense BFLOAT16                -> FLOAT32 (exact: bf16 is the top half of a binary32)
//   Tensor sparse_csr (2-D)              -> dense, unlisted entries 0 (the SDK's pad for the
//                                           [T, K] target_tokens and weights it sends sparse);
//                                           all the request's densified bytes together at most
//                                           max_dense_bytes (the body limit: what a dense body
//                                           could have held)
//   image/audio chunks, unset or unknown dtypes, malformed CSR: refused
//   loss_fn, loss_fn_config              -> v1 LossFn{name, config}
absl::StatusOr<TinkerFwdBwd> FwdBwdFromTinker(tinker_public::ForwardBackwardRequest* in,
                                              int64_t max_dense_bytes = int64_t{256} << 20);

// tinkerd's forward/forward_backward result as the Tinker output: one ArrayRecord (type_tag
// "ArrayRecord") holding every datum's "logprobs" as a FLOAT32 BatchedTensor with int64 byte
// offsets, which the SDK slices back into one TensorData per datum ([T], or [T, K] through
// trailing_shape [K] for top-K targets); metrics copied (their keys
// are already "name:reduction"). loss_fn is the request's loss name; every tinkerd loss returns
// the same record, so it does not change the encoding.
void FwdBwdOutputToTinker(const v1::ForwardBackwardOutput& in, const std::string& loss_fn,
                          tinker_public::ForwardBackwardOutput* out);

// What an asample asked for beyond tokens, which decides what its answer carries.
// target_prompt_logprobs' layout: its shape [rows, k], and for a sparse request the CSR indices,
// which the answer reuses.
struct TargetLayout {
  int64_t rows = 0, k = 0;
  bool sparse = false;
  std::vector<int64_t> crow, col;
};
struct SampleAnswer {
  bool prompt_logprobs = false;
  int64_t topk_prompt_logprobs = 0;
  int64_t topk_sample_logprobs = 0;
  std::optional<TargetLayout> target;
  int64_t prompt_alt_tokens_k = 0;
};

// tinkerd's sample result as Tinker's: tokens as int32 and logprobs as float32 bytes;
// prompt_logprobs (when asked) with NaN at position 0 and at the positions
// prompt_logprobs_last_n left out, which the SDK reads as None; top-k rows (prompt's and
// samples', when k > 0) padded to k with the SDK's sentinel (token 0, logprob -99999), so a row
// with none reads as None; target_prompt_logprobs in the request's layout, 0 where it had -1;
// prompt_alt_tokens as two dense [P - 1, k] tensors (INT64 ids, FLOAT32 logprobs).
void SampleResponseToTinker(const v1::SampleResponse& in, const SampleAnswer& asked,
                            tinker_public::SampleResponse* out);

// SDK 0.38's asample target_prompt_logprobs (a JSON TensorData of int64 ids [rows, K], dense or
// sparse CSR whose unlisted cells are -1) as tinkerd's INT64 [rows, K] with -1 where nothing is
// asked. rows in [1, max_rows] and K in [1, max_k] are checked before anything is allocated (the
// sampler checks rows = len(prompt) - 1 and the ids); *layout keeps what the answer needs.
absl::Status TargetPromptFromTinker(const nlohmann::json& t, int64_t max_rows, int64_t max_k,
                                    v1::Tensor* out, TargetLayout* layout);

// asample's JSON: Tinker's ModelInput (`prompt`: encoded_text chunks, concatenated into one chunk)
// and SamplingParams (`sampling_params`; stop strings are refused, since they need the tokenizer,
// which the server does not hold; stop token ids each stop on their own). Null or absent:
// required. Errors are INVALID_ARGUMENT naming the field path, e.g. `prompt.chunks[1].tokens:
// must be integers`. Ranges (vocabulary, context) are the sampler's to check.
absl::Status PromptFromTinker(const nlohmann::json* prompt, v1::ModelInput* out);
absl::Status SamplingParamsFromTinker(const nlohmann::json* params, v1::SamplingParams* out);

// A checkpoint's lifetime, `ttl_seconds` of save_weights, save_weights_for_sampler, copy_weights
// and the checkpoint's ttl endpoint: null or absent is forever; else an integer from 3600 (one
// hour) to 315,360,000 (ten years), as Tinker bounds it; else INVALID_ARGUMENT naming the field.
absl::StatusOr<std::optional<absl::Duration>> TtlFromTinker(const nlohmann::json& body);

// Fields of SDK 0.38's asample that tinkerd does not serve (record_stability_info): a value
// other than the field's "off" value (absent, null, 0, false) is refused, INVALID_ARGUMENT naming
// the field, rather than silently ignored (docs/http.md lists them).
absl::Status RefuseUnservedSampleFields(const nlohmann::json& body);

// save_weights_for_sampler's `kind`: whether "inflight" (absent, null and "snapshot" are not);
// anything else is INVALID_ARGUMENT naming `kind`.
absl::StatusOr<bool> InflightFromTinker(const nlohmann::json& body);

// A listing's page from its query string (`limit=20&offset=40&access_scope=owned`, as the
// RestClient sends it). Other parameters are ignored; each of these at most once: limit a decimal
// integer in [1, kMaxPageLimit], offset one >= 0, access_scope "owned" or "accessible" (the same
// here: a tenant reaches only its own). No limit: every item. Errors are INVALID_ARGUMENT naming
// the parameter, e.g. `limit: must be an integer in [1, 1000], not 'x'`.
struct Page {
  int64_t offset = 0;
  std::optional<int64_t> limit;
};
inline constexpr int64_t kMaxPageLimit = 1000;
absl::StatusOr<Page> PageFromQuery(absl::string_view query);

}  // namespace tinkerd::http
