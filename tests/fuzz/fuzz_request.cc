// Fuzzes the server's one decoding of forward / forward_backward requests (BatchFromProto:
// loss and config, wire decoding, ValidateData) on arbitrary bytes parsed as the protobuf.
// Properties, besides no crash and no sanitizer report:
//   - a refusal is always INVALID_ARGUMENT (a client error, never an internal one);
//   - an accepted request meets every precondition the runner's forward relies on, checked here
//     independently of validate.cc: tokens and targets in [0, vocab), lengths within the context
//     and equal to every loss input's, finite floats, 0/1 masks.
#include <cmath>
#include <cstddef>
#include <cstdint>

#include <google/protobuf/stubs/logging.h>

#include "runner/loss/loss_spec.h"
#include "server/core/convert.h"
#include "tests/fuzz/fuzz_check.h"
#include "tinkerd/v1/tinkerd.pb.h"

namespace {

constexpr tinkerd::ModelLimits kLimits{/*vocab_size=*/128, /*max_context_length=*/256};

bool InVocab(int64_t t) {
  return t >= 0 && t < kLimits.vocab_size;
}

void CheckAccepted(const tinkerd::v1::ForwardBackwardRequest& req, const tinkerd::Batch& batch) {
  const std::vector<tinkerd::Datum>& data = batch.data();
  FUZZ_CHECK(data.size() == static_cast<size_t>(req.data_size()), "datums lost in decoding");
  FUZZ_CHECK(!data.empty(), "an empty batch was accepted");
  const tinkerd::LossSpec* spec = tinkerd::FindLossSpec(req.loss_fn().name());
  FUZZ_CHECK(spec != nullptr, "an unknown loss was accepted");
  FUZZ_CHECK(batch.loss().spec == spec, "the batch carries another loss than the request's");
  for (const tinkerd::Datum& d : data) {
    const size_t n = d.tokens.size();
    FUZZ_CHECK(n > 0 && static_cast<int64_t>(n) <= kLimits.max_context_length,
               "sequence length outside (0, context]");
    for (int64_t t : d.tokens) FUZZ_CHECK(InVocab(t), "token id outside the vocabulary");
    auto targets = d.loss_fn_inputs.find("target_tokens");
    FUZZ_CHECK(targets != d.loss_fn_inputs.end(), "accepted without target_tokens");
    FUZZ_CHECK(targets->second.int64_data.size() == n, "target_tokens length differs");
    for (int64_t t : targets->second.int64_data) FUZZ_CHECK(InVocab(t), "target outside vocab");
    for (const std::string& key : spec->required_inputs) {
      FUZZ_CHECK(d.loss_fn_inputs.count(key) == 1, "a required loss input is missing");
    }
    for (const auto& [key, t] : d.loss_fn_inputs) {
      if (key == "target_tokens") continue;
      FUZZ_CHECK(t.float32_data.size() == n, "a float loss input's length differs");
      for (float v : t.float32_data) {
        FUZZ_CHECK(std::isfinite(v), "a non-finite loss input was accepted");
        if (key == "mask") FUZZ_CHECK(v == 0.0f || v == 1.0f, "a mask value other than 0/1");
      }
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Invalid UTF-8 in string fields makes parsing fail, which is expected; do not log each one.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  tinkerd::v1::ForwardBackwardRequest req;
  if (!req.ParseFromArray(bytes, static_cast<int>(size))) return 0;
  const absl::StatusOr<tinkerd::Batch> batch =
      tinkerd::BatchFromProto(req.data(), req.loss_fn(), kLimits);
  const absl::Status s = batch.status();
  if (s.ok()) {
    CheckAccepted(req, *batch);
  } else {
    FUZZ_CHECK(s.code() == absl::StatusCode::kInvalidArgument,
               "a refusal that is not a client error");
    FUZZ_CHECK(!s.message().empty(), "a refusal without a reason");
  }
  return 0;
}
