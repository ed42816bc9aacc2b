// SampleStream's server side: the tokens of a Sample request written to the client as the engine
// decodes them (see the class comment in sample_stream.cc).
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>

#include "absl/status/statusor.h"
#include "server/ops/sampling.h"

namespace tinkerd {

// `tenant`: the caller's, or the authentication error the stream answers with.
grpc::ServerWriteReactor<grpc::ByteBuffer>* NewSampleStreamReactor(
    Sampling* sampling, const grpc::ByteBuffer* request, absl::StatusOr<std::string> tenant);

}  // namespace tinkerd
