// Conversion between the wire types (tinkerd.v1) and the runner's types. Decoding checks the
// encoding (dtype set, byte length a whole number of elements, shape agreeing with the data);
// semantic checks (vocab, lengths, finiteness) are runner/validate.h's.
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "runner/batch.h"
#include "runner/sample/sample_types.h"
#include "runner/types.h"
#include "runner/validate.h"
#include "tinkerd/v1/tinkerd.pb.h"

namespace tinkerd {

absl::StatusOr<std::vector<Datum>> DatumsFromProto(
    const google::protobuf::RepeatedPtrField<v1::Datum>& data, size_t first_index = 0);
absl::StatusOr<Datum> DatumFromProto(const v1::Datum& d, size_t index);

// The one decoding of a batch of wire datums, with every check (the loss and its config, the
// encoding of every datum, ValidateData's semantic checks): at the edge on the rank that received
// the request, and from the command on the other ranks. INVALID_ARGUMENT naming the field.
absl::StatusOr<Batch> BatchFromProto(const google::protobuf::RepeatedPtrField<v1::Datum>& data,
                                     const v1::LossFn& loss, const ModelLimits& limits);

// One position's (token, logprob) rows, most likely first, as the wire's TopkLogprobs.
void TopLogprobsToProto(const TopLogprobs& row, v1::TopkLogprobs* out);

// shape: empty for 1-D [v.size()].
v1::Tensor Float32ToProto(const std::vector<float>& v, const std::vector<int64_t>& shape = {});
void ResultToProto(const ForwardBackwardResult& r, v1::ForwardBackwardOutput* out);
void OptimStepToProto(const OptimStepResult& r, v1::OptimStepResponse* out);
void InfoToProto(const ModelInfo& info, v1::ModelInfo* out);
AdamParams AdamFromProto(const v1::AdamParams& p);
absl::StatusOr<CreateModelOptions> CreateOptionsFromProto(const v1::CreateModelRequest& r);
std::map<std::string, double> ConfigFromProto(const v1::LossFn& loss);

}  // namespace tinkerd
