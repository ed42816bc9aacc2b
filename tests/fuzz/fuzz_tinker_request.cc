// Fuzzes the Tinker HTTP API's forward_backward body: arbitrary bytes parsed as Tinker's protobuf
// (tinker_public.ForwardBackwardRequest), converted to tinkerd's request (FwdBwdFromTinker), then
// decoded and checked as every front end does (BatchFromProto). Properties, besides no crash and
// no sanitizer report:
//   - every refusal, of either step, is INVALID_ARGUMENT with a reason;
//   - an accepted conversion keeps every datum and every token (int32 in, int64 out, same values)
//     and the loss name.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include <google/protobuf/stubs/logging.h>

#include "server/core/convert.h"
#include "server/http/tinker_convert.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

constexpr tinkerd::ModelLimits kLimits{/*vocab_size=*/128, /*max_context_length=*/256};

void CheckRefusal(const absl::Status& s) {
  FUZZ_CHECK(s.code() == absl::StatusCode::kInvalidArgument,
             "a refusal that is not a client error");
  FUZZ_CHECK(!s.message().empty(), "a refusal without a reason");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  tinker_public::ForwardBackwardRequest in;
  if (!in.ParseFromArray(bytes, static_cast<int>(size))) return 0;
  const tinker_public::ForwardBackwardRequest original = in;  // the conversion consumes `in`
  auto converted = tinkerd::http::FwdBwdFromTinker(&in);
  if (!converted.ok()) {
    CheckRefusal(converted.status());
    return 0;
  }
  const tinkerd::v1::ForwardBackwardRequest& req = converted->request;
  FUZZ_CHECK(req.data_size() == original.data_size(), "datums lost in conversion");
  FUZZ_CHECK(req.loss_fn().name() == original.loss_fn(), "the loss changed in conversion");
  FUZZ_CHECK(converted->forward_only == original.forward_only(), "forward_only changed");
  for (int i = 0; i < original.data_size(); ++i) {
    std::vector<int64_t> want;
    for (const auto& chunk : original.data(i).model_input()) {
      const std::string& t = chunk.encoded_text().tokens();
      for (size_t k = 0; k + 4 <= t.size(); k += 4) {
        int32_t v;
        std::memcpy(&v, t.data() + k, 4);
        want.push_back(v);
      }
    }
    std::vector<int64_t> got;
    for (const auto& chunk : req.data(i).model_input().chunks()) {
      got.insert(got.end(), chunk.encoded_text().tokens().begin(),
                 chunk.encoded_text().tokens().end());
    }
    FUZZ_CHECK(got == want, "tokens changed in conversion");
  }
  const absl::StatusOr<tinkerd::Batch> batch =
      tinkerd::BatchFromProto(req.data(), req.loss_fn(), kLimits);
  if (!batch.ok()) CheckRefusal(batch.status());
  return 0;
}
