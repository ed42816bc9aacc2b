// Fuzzes the Tinker HTTP API's forward_backward body: arbitrary bytes parsed as Tinker's protobuf
// (tinker_public.ForwardBackwardRequest), converted to tinkerd's request (FwdBwdFromTinker), then
// decoded and checked as every front end does (BatchFromProto). Properties, besides no crash and
// no sanitizer report:
//   - every refusal, of either step, is INVALID_ARGUMENT with a reason;
//   - an accepted conversion keeps every datum and every token (int32 in, int64 out, same values)
//     and the loss name;
//   - sparse (CSR) inputs densify to no more bytes, all together, than the budget given.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include <google/protobuf/stubs/logging.h>

#include "server/core/convert.h"
#include "server/http/tinker_convert.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

constexpr tinkerd::ModelLimits kLimits{/*vocab_size=*/128, /*max_context_length=*/256};
// Small, so that inputs reach it: a CSR of a few bytes may name a shape of any size.
constexpr int64_t kDenseBudget = int64_t{1} << 20;

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
  auto converted = tinkerd::http::FwdBwdFromTinker(&in, kDenseBudget);
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
  int64_t densified = 0;
  for (int i = 0; i < original.data_size(); ++i) {
    for (const auto& [key, t] : original.data(i).loss_fn_inputs()) {
      if (!t.has_sparse_csr()) continue;
      const int64_t elements = t.shape(0) * t.shape(1);
      // The budget counts wire bytes; INT32 and BFLOAT16 then widen to 8 and 4 bytes.
      densified +=
          elements *
          (t.dtype() == tinker_public::DTYPE_INT64 || t.dtype() == tinker_public::DTYPE_INT32 ? 8
                                                                                              : 4);
      FUZZ_CHECK(
          req.data(i).loss_fn_inputs().at(key).data().size() ==
              static_cast<size_t>(elements) *
                  (req.data(i).loss_fn_inputs().at(key).dtype() == tinkerd::v1::INT64 ? 8 : 4),
          "a sparse input densified to the wrong size");
    }
  }
  FUZZ_CHECK(densified <= 2 * kDenseBudget, "sparse inputs densified past the budget");
  const absl::StatusOr<tinkerd::Batch> batch =
      tinkerd::BatchFromProto(req.data(), req.loss_fn(), kLimits);
  if (!batch.ok()) CheckRefusal(batch.status());
  return 0;
}
