// StreamForwardBackward's server side: one reactor per stream, reading datums on gRPC threads
// while the model's job consumes them on the scheduler thread (see the class comment in
// stream_reactor.cc and docs/server.md).
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>

#include "absl/status/statusor.h"
#include "server/grpc/service.h"

namespace tinkerd {

// `tenant`: the caller's, or the authentication error the stream answers with.
grpc::ServerReadReactor<grpc::ByteBuffer>* NewStreamReactor(TinkerdService* service,
                                                            grpc::CallbackServerContext* ctx,
                                                            grpc::ByteBuffer* resp,
                                                            absl::StatusOr<std::string> tenant);

}  // namespace tinkerd
