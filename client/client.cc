#include "client/client.h"

#include <algorithm>
#include <bit>
#include <fstream>
#include <iterator>
#include <random>
#include <thread>
#include <type_traits>
#include <utility>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/channel_arguments.h>

#include "absl/strings/str_cat.h"

namespace tinkerd::client {
namespace {

using tinkerd::v1::Tinkerd;

// gRPC reports an over-limit message as RESOURCE_EXHAUSTED; resending it cannot help.
bool Retryable(const grpc::Status& status) {
  switch (status.error_code()) {
    case grpc::StatusCode::UNAVAILABLE:
      return true;
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return status.error_message().find("larger than max") == std::string::npos;
    default:
      return false;
  }
}

// Jitter spreads out clients that all lost the server at the same moment.
std::chrono::milliseconds Jittered(std::chrono::milliseconds backoff) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  const int64_t hi = std::max<int64_t>(1, backoff.count());
  std::uniform_int_distribution<int64_t> dist(hi / 2, hi);
  return std::chrono::milliseconds(dist(rng));
}

// One retried unary call. The request is built once by the caller and resent untouched, which is
// what makes a retried mutating call exactly-once on the server.
template <typename Request, typename Response>
absl::StatusOr<Response> Unary(const ClientOptions& options, Tinkerd::Stub& stub,
                               grpc::Status (Tinkerd::Stub::*method)(grpc::ClientContext*,
                                                                     const Request&, Response*),
                               const Request& request) {
  Response response;
  absl::Status status = CallWithRetry(options, [&](grpc::ClientContext& context) {
    response.Clear();  // a failed attempt may have left a partial message behind
    return (stub.*method)(&context, request, &response);
  });
  if (!status.ok()) return status;
  return response;
}

// A retried unary call on a thread of its own: the future of `convert(response)`. Each call gets a
// thread, so a pipelined caller never waits behind a pool; its requests are few and long.
template <typename Request, typename Response, typename Convert>
auto Async(std::shared_ptr<Connection> connection,
           grpc::Status (Tinkerd::Stub::*method)(grpc::ClientContext*, const Request&, Response*),
           Request request, Convert convert) {
  using Out = std::invoke_result_t<Convert, Response&&>;
  return std::async(std::launch::async,
                    [connection = std::move(connection), method, request = std::move(request),
                     convert = std::move(convert)]() -> absl::StatusOr<Out> {
                      absl::StatusOr<Response> response =
                          Unary(connection->options(), connection->stub(), method, request);
                      if (!response.ok()) return response.status();
                      return convert(*std::move(response));
                    });
}

template <typename Response>
Response Identity(Response&& response) {
  return std::move(response);
}

// A delete retried like any call. NOT_FOUND on a retry is success: an earlier attempt deleted
// the thing and its reply was lost.
absl::Status DeleteWithRetry(const ClientOptions& options,
                             const std::function<grpc::Status(grpc::ClientContext&)>& attempt) {
  int attempts = 0;
  absl::Status status = CallWithRetry(options, [&](grpc::ClientContext& context) {
    ++attempts;
    return attempt(context);
  });
  if (absl::IsNotFound(status) && attempts > 1) return absl::OkStatus();
  return status;
}

tinkerd::v1::ModelInput TokensInput(const std::vector<int64_t>& tokens) {
  tinkerd::v1::ModelInput input;
  input.add_chunks()->mutable_encoded_text()->mutable_tokens()->Add(tokens.begin(), tokens.end());
  return input;
}

// Adds a SampleStream message's deltas to the answer they assemble.
absl::Status Append(const tinkerd::v1::SampleStreamResponse& message,
                    tinkerd::v1::SampleResponse& out) {
  for (const tinkerd::v1::SampleDelta& delta : message.deltas()) {
    if (delta.index() < 0 || delta.index() >= out.sequences_size()) {
      return absl::InternalError(absl::StrCat("SampleStream: a delta for sample ", delta.index(),
                                              " of ", out.sequences_size()));
    }
    tinkerd::v1::SampledSequence& seq = *out.mutable_sequences(delta.index());
    seq.mutable_tokens()->Add(delta.tokens().begin(), delta.tokens().end());
    seq.mutable_logprobs()->Add(delta.logprobs().begin(), delta.logprobs().end());
    if (delta.stop_reason() != tinkerd::v1::STOP_REASON_UNSPECIFIED) {
      seq.set_stop_reason(delta.stop_reason());
    }
  }
  if (message.prompt_logprobs_size() > 0)
    *out.mutable_prompt_logprobs() = message.prompt_logprobs();
  if (message.topk_prompt_logprobs_size() > 0) {
    *out.mutable_topk_prompt_logprobs() = message.topk_prompt_logprobs();
  }
  return absl::OkStatus();
}

void PrepareContext(const ClientOptions& options, grpc::ClientContext& context) {
  context.set_deadline(std::chrono::system_clock::now() + options.deadline);
  if (!options.api_key.empty()) context.AddMetadata("x-api-key", options.api_key);
}

constexpr char kHealthCheckMethod[] = "/grpc.health.v1.Health/Check";
constexpr int kHealthServing = 1;  // grpc.health.v1.HealthCheckResponse.ServingStatus.SERVING

// HealthCheckResponse is { ServingStatus status = 1; }: read field 1, skip anything else.
absl::StatusOr<int> ParseHealthStatus(const grpc::ByteBuffer& buffer) {
  grpc::Slice slice;
  if (!buffer.Valid() || !buffer.DumpToSingleSlice(&slice).ok()) {
    return absl::InternalError("health check: unreadable response");
  }
  namespace wire = google::protobuf::internal;
  google::protobuf::io::CodedInputStream in(slice.begin(), static_cast<int>(slice.size()));
  int serving_status = 0;  // UNKNOWN when absent, as proto3 omits a zero enum
  while (uint32_t tag = in.ReadTag()) {
    if (wire::WireFormatLite::GetTagFieldNumber(tag) == 1 &&
        wire::WireFormatLite::GetTagWireType(tag) == wire::WireFormatLite::WIRETYPE_VARINT) {
      uint32_t value = 0;
      if (!in.ReadVarint32(&value)) return absl::InternalError("health check: malformed response");
      serving_status = static_cast<int>(value);
    } else if (!wire::WireFormatLite::SkipField(&in, tag)) {
      return absl::InternalError("health check: malformed response");
    }
  }
  return serving_status;
}

// Both enums use the canonical numbering (0..16), so a cast is the mapping; checked here once.
constexpr bool SameNumbering() {
  using G = grpc::StatusCode;
  using A = absl::StatusCode;
  constexpr std::pair<G, A> kPairs[] = {
      {G::CANCELLED, A::kCancelled},
      {G::UNKNOWN, A::kUnknown},
      {G::INVALID_ARGUMENT, A::kInvalidArgument},
      {G::DEADLINE_EXCEEDED, A::kDeadlineExceeded},
      {G::NOT_FOUND, A::kNotFound},
      {G::ALREADY_EXISTS, A::kAlreadyExists},
      {G::PERMISSION_DENIED, A::kPermissionDenied},
      {G::RESOURCE_EXHAUSTED, A::kResourceExhausted},
      {G::FAILED_PRECONDITION, A::kFailedPrecondition},
      {G::ABORTED, A::kAborted},
      {G::OUT_OF_RANGE, A::kOutOfRange},
      {G::UNIMPLEMENTED, A::kUnimplemented},
      {G::INTERNAL, A::kInternal},
      {G::UNAVAILABLE, A::kUnavailable},
      {G::DATA_LOSS, A::kDataLoss},
      {G::UNAUTHENTICATED, A::kUnauthenticated},
  };
  for (const auto& [g, a] : kPairs) {
    if (static_cast<int>(g) != static_cast<int>(a)) return false;
  }
  return true;
}
static_assert(SameNumbering());

}  // namespace

absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  const int code = static_cast<int>(status.error_code());
  // Anything outside the canonical range (e.g. DO_NOT_USE) becomes UNKNOWN, not garbage.
  const auto absl_code =
      code >= 1 && code <= 16 ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown;
  return absl::Status(absl_code, status.error_message());
}

absl::Status CallWithRetry(const ClientOptions& options,
                           const std::function<grpc::Status(grpc::ClientContext&)>& attempt) {
  const int max_attempts = std::max(1, options.max_attempts);
  std::chrono::milliseconds backoff = options.initial_backoff;
  for (int n = 1;; ++n) {
    grpc::ClientContext context;  // a context serves one call only
    PrepareContext(options, context);
    const grpc::Status status = attempt(context);
    if (status.ok() || !Retryable(status)) return FromGrpc(status);
    if (n >= max_attempts) {
      absl::Status last = FromGrpc(status);
      if (n == 1) return last;
      return absl::Status(last.code(),
                          absl::StrCat(last.message(), " (gave up after ", n, " attempts)"));
    }
    std::this_thread::sleep_for(Jittered(backoff));
    backoff = std::min(backoff * 2, options.max_backoff);
  }
}

absl::Status LoadTlsFiles(const std::string& root_certs_path, const std::string& client_cert_path,
                          const std::string& client_key_path, ClientOptions& options) {
  if (client_cert_path.empty() != client_key_path.empty()) {
    return absl::InvalidArgumentError(
        "tls: a client certificate needs its key and a key needs its certificate");
  }
  auto read = [](const std::string& path, std::string& out) -> absl::Status {
    if (path.empty()) return absl::OkStatus();
    std::ifstream f(path, std::ios::binary);
    if (!f) return absl::InvalidArgumentError(absl::StrCat("tls: cannot read ", path));
    out.assign(std::istreambuf_iterator<char>(f), {});
    return absl::OkStatus();
  };
  options.tls = true;
  if (auto s = read(root_certs_path, options.tls_root_certs); !s.ok()) return s;
  if (auto s = read(client_cert_path, options.tls_client_cert); !s.ok()) return s;
  return read(client_key_path, options.tls_client_key);
}

// ---- Connection ----

Connection::Connection(ClientOptions options, std::shared_ptr<grpc::Channel> channel)
    : options_(std::move(options)),
      channel_(std::move(channel)),
      stub_(Tinkerd::NewStub(channel_)),
      generic_stub_(channel_) {}

std::shared_ptr<Connection> Connection::Create(ClientOptions options) {
  grpc::ChannelArguments args;
  // gRPC's 4 MiB receive default is far below a large batch's logprobs.
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (options.tls) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_root_certs;
    ssl.pem_cert_chain = options.tls_client_cert;
    ssl.pem_private_key = options.tls_client_key;
    creds = grpc::SslCredentials(ssl);
  }
  auto channel = grpc::CreateCustomChannel(options.target, creds, args);
  return CreateWithChannel(std::move(options), std::move(channel));
}

std::shared_ptr<Connection> Connection::CreateWithChannel(ClientOptions options,
                                                          std::shared_ptr<grpc::Channel> channel) {
  // Not make_shared: the constructor is private so every Connection is owned by a shared_ptr,
  // which Attach (shared_from_this) relies on.
  return std::shared_ptr<Connection>(new Connection(std::move(options), std::move(channel)));
}

absl::StatusOr<tinkerd::v1::ModelInfo> Connection::CreateModel(
    const tinkerd::v1::CreateModelRequest& request) {
  return Unary(options_, *stub_, &Tinkerd::Stub::CreateModel, request);
}

absl::StatusOr<tinkerd::v1::ModelInfo> Connection::GetInfo(const std::string& model_id) {
  tinkerd::v1::ModelRef ref;
  ref.set_model_id(model_id);
  return Unary(options_, *stub_, &Tinkerd::Stub::GetInfo, ref);
}

absl::StatusOr<std::vector<tinkerd::v1::ModelInfo>> Connection::ListModels() {
  auto response =
      Unary(options_, *stub_, &Tinkerd::Stub::ListModels, tinkerd::v1::ListModelsRequest());
  if (!response.ok()) return response.status();
  return std::vector<tinkerd::v1::ModelInfo>(response->models().begin(), response->models().end());
}

absl::Status Connection::DeleteModel(const std::string& model_id) {
  tinkerd::v1::ModelRef ref;
  ref.set_model_id(model_id);
  tinkerd::v1::DeleteModelResponse response;
  return DeleteWithRetry(options_, [&](grpc::ClientContext& context) {
    return stub_->DeleteModel(&context, ref, &response);
  });
}

absl::StatusOr<tinkerd::v1::SamplerInfo> Connection::CreateSampler(
    const tinkerd::v1::CreateSamplerRequest& request) {
  return Unary(options_, *stub_, &Tinkerd::Stub::CreateSampler, request);
}

SamplingClient Connection::Sampler(const std::string& sampler_id, const std::string& model_id) {
  return SamplingClient(shared_from_this(), sampler_id, model_id);
}

absl::StatusOr<bool> Connection::Health() {
  // HealthCheckRequest{service: ""} serializes to zero bytes, so there is nothing to encode.
  grpc::Slice empty;
  const grpc::ByteBuffer request(&empty, 1);
  grpc::ByteBuffer response;
  absl::Status status = CallWithRetry(options_, [&](grpc::ClientContext& context) {
    // GenericStub has no blocking unary call in gRPC 1.51; wait on the callback instead. The
    // callback owns the promise so it stays alive until set_value has fully returned.
    auto done = std::make_shared<std::promise<grpc::Status>>();
    std::future<grpc::Status> result = done->get_future();
    generic_stub_.UnaryCall(&context, kHealthCheckMethod, grpc::StubOptions(), &request, &response,
                            [done](grpc::Status s) { done->set_value(std::move(s)); });
    return result.get();
  });
  if (!status.ok()) return status;
  auto serving = ParseHealthStatus(response);
  if (!serving.ok()) return serving.status();
  return *serving == kHealthServing;
}

std::unique_ptr<TrainingClient> Connection::Attach(const std::string& model_id,
                                                   int64_t next_seq_id) {
  return std::make_unique<TrainingClient>(shared_from_this(), model_id, next_seq_id);
}

// ---- TrajectoryStream ----

TrajectoryStream::TrajectoryStream(std::shared_ptr<Connection> connection, int64_t seq_id)
    : connection_(std::move(connection)), seq_id_(seq_id) {
  PrepareContext(connection_->options(), context_);
  writer_ = connection_->stub().StreamForwardBackward(&context_, &response_);
}

TrajectoryStream::~TrajectoryStream() {
  if (finished_) return;
  // Cancel rather than half-close: a half-close would ask the server to apply a partial stream.
  context_.TryCancel();
  writer_->Finish();
}

void TrajectoryStream::Close(absl::Status status) {
  finished_ = true;
  status_ = std::move(status);
}

absl::Status TrajectoryStream::Write(const tinkerd::v1::Datum& datum) {
  if (finished_) {
    return status_.ok() ? absl::FailedPreconditionError("Write on a finished TrajectoryStream")
                        : status_;
  }
  tinkerd::v1::StreamForwardBackwardMessage message;
  *message.mutable_datum() = datum;
  if (writer_->Write(message)) return absl::OkStatus();
  // A failed write only says the stream is gone; Finish has the server's reason.
  absl::Status status = FromGrpc(writer_->Finish());
  if (status.ok()) status = absl::UnknownError("stream closed before the client finished it");
  Close(status);
  return status;
}

absl::StatusOr<tinkerd::v1::ForwardBackwardOutput> TrajectoryStream::Finish() {
  if (!finished_) {
    writer_->WritesDone();
    Close(FromGrpc(writer_->Finish()));
  }
  if (!status_.ok()) return status_;
  return response_;
}

// ---- TrainingClient ----

template <typename Request>
Request TrainingClient::Ordered() {
  Request request;
  request.set_model_id(model_id_);
  request.set_seq_id(next_seq_id_.fetch_add(1));  // now, in the caller's thread: call order
  return request;
}

TrainingClient::TrainingClient(std::shared_ptr<Connection> connection, std::string model_id,
                               int64_t next_seq_id)
    : connection_(std::move(connection)),
      model_id_(std::move(model_id)),
      next_seq_id_(next_seq_id) {}

std::future<absl::StatusOr<tinkerd::v1::ForwardBackwardOutput>> TrainingClient::SendForwardBackward(
    std::vector<tinkerd::v1::Datum> data, tinkerd::v1::LossFn loss, bool backward) {
  auto request = Ordered<tinkerd::v1::ForwardBackwardRequest>();
  request.mutable_data()->Reserve(static_cast<int>(data.size()));
  for (auto& datum : data) *request.add_data() = std::move(datum);
  *request.mutable_loss_fn() = std::move(loss);
  return Async(connection_, backward ? &Tinkerd::Stub::ForwardBackward : &Tinkerd::Stub::Forward,
               std::move(request), Identity<tinkerd::v1::ForwardBackwardOutput>);
}

std::future<absl::StatusOr<tinkerd::v1::ForwardBackwardOutput>> TrainingClient::ForwardBackward(
    std::vector<tinkerd::v1::Datum> data, tinkerd::v1::LossFn loss) {
  return SendForwardBackward(std::move(data), std::move(loss), /*backward=*/true);
}

std::future<absl::StatusOr<tinkerd::v1::ForwardBackwardOutput>> TrainingClient::Forward(
    std::vector<tinkerd::v1::Datum> data, tinkerd::v1::LossFn loss) {
  return SendForwardBackward(std::move(data), std::move(loss), /*backward=*/false);
}

std::future<absl::StatusOr<tinkerd::v1::OptimStepResponse>> TrainingClient::OptimStep(
    tinkerd::v1::AdamParams adam) {
  auto request = Ordered<tinkerd::v1::OptimStepRequest>();
  *request.mutable_adam_params() = std::move(adam);
  return Async(connection_, &Tinkerd::Stub::OptimStep, std::move(request),
               Identity<tinkerd::v1::OptimStepResponse>);
}

std::unique_ptr<TrajectoryStream> TrainingClient::StreamForwardBackward(tinkerd::v1::LossFn loss) {
  std::unique_ptr<TrajectoryStream> stream(
      new TrajectoryStream(connection_, next_seq_id_.fetch_add(1)));
  tinkerd::v1::StreamForwardBackwardMessage header;
  header.mutable_header()->set_model_id(model_id_);
  header.mutable_header()->set_seq_id(stream->seq_id());
  *header.mutable_header()->mutable_loss_fn() = std::move(loss);
  if (!stream->writer_->Write(header)) {
    absl::Status status = FromGrpc(stream->writer_->Finish());
    if (status.ok()) status = absl::UnknownError("stream closed before its header was sent");
    stream->Close(status);
  }
  return stream;
}

std::future<absl::StatusOr<std::string>> TrainingClient::SaveState(std::string name,
                                                                   bool overwrite) {
  auto request = Ordered<tinkerd::v1::SaveStateRequest>();
  request.set_name(std::move(name));
  request.set_overwrite(overwrite);
  return Async(connection_, &Tinkerd::Stub::SaveState, std::move(request),
               [](const tinkerd::v1::SaveStateResponse& r) { return r.path(); });
}

std::future<absl::StatusOr<std::string>> TrainingClient::LoadState(std::string path,
                                                                   bool with_optimizer) {
  auto request = Ordered<tinkerd::v1::LoadStateRequest>();
  request.set_path(std::move(path));
  request.set_with_optimizer(with_optimizer);
  return Async(connection_, &Tinkerd::Stub::LoadState, std::move(request),
               [](const tinkerd::v1::LoadStateResponse& r) { return r.path(); });
}

std::future<absl::StatusOr<std::string>> TrainingClient::SaveWeightsForSampler(std::string name,
                                                                               bool merged,
                                                                               bool overwrite) {
  auto request = Ordered<tinkerd::v1::SaveWeightsForSamplerRequest>();
  request.set_name(std::move(name));
  request.set_merged(merged);
  request.set_overwrite(overwrite);
  return Async(connection_, &Tinkerd::Stub::SaveWeightsForSampler, std::move(request),
               [](const tinkerd::v1::SaveWeightsForSamplerResponse& r) { return r.path(); });
}

std::future<absl::StatusOr<SamplingClient>> TrainingClient::SaveWeightsAndGetSamplingClient() {
  auto request = Ordered<tinkerd::v1::CreateSamplerRequest>();
  return Async(connection_, &Tinkerd::Stub::CreateSampler, std::move(request),
               [connection = connection_](const tinkerd::v1::SamplerInfo& info) {
                 return SamplingClient(connection, info.sampler_id(), "");
               });
}

absl::StatusOr<tinkerd::v1::RetrieveResultResponse> TrainingClient::RetrieveResult(int64_t seq_id) {
  tinkerd::v1::RetrieveResultRequest request;
  request.set_model_id(model_id_);
  request.set_seq_id(seq_id);
  return Unary(connection_->options(), connection_->stub(), &Tinkerd::Stub::RetrieveResult,
               request);
}

absl::StatusOr<tinkerd::v1::ModelInfo> TrainingClient::GetInfo() {
  return connection_->GetInfo(model_id_);
}

// ---- SamplingClient ----

SamplingClient::SamplingClient(std::shared_ptr<Connection> connection, std::string sampler_id,
                               std::string model_id)
    : connection_(std::move(connection)),
      sampler_id_(std::move(sampler_id)),
      model_id_(std::move(model_id)) {}

tinkerd::v1::SampleRequest SamplingClient::Request(const std::vector<int64_t>& prompt,
                                                   tinkerd::v1::SamplingParams params,
                                                   const SampleOptions& options) const {
  tinkerd::v1::SampleRequest request;
  request.set_sampler_id(sampler_id_);
  request.set_model_id(model_id_);
  *request.mutable_prompt() = TokensInput(prompt);
  request.set_num_samples(options.num_samples);
  *request.mutable_sampling_params() = std::move(params);
  request.set_prompt_logprobs(options.prompt_logprobs);
  request.set_topk_prompt_logprobs(options.topk_prompt_logprobs);
  return request;
}

std::future<absl::StatusOr<tinkerd::v1::SampleResponse>> SamplingClient::Sample(
    std::vector<int64_t> prompt, tinkerd::v1::SamplingParams params, SampleOptions options) const {
  return Async(connection_, &Tinkerd::Stub::Sample, Request(prompt, std::move(params), options),
               Identity<tinkerd::v1::SampleResponse>);
}

absl::StatusOr<tinkerd::v1::SampleResponse> SamplingClient::SampleStream(
    std::vector<int64_t> prompt, tinkerd::v1::SamplingParams params,
    const std::function<bool(const tinkerd::v1::SampleStreamResponse&)>& on_message,
    SampleOptions options) const {
  const tinkerd::v1::SampleRequest request = Request(prompt, std::move(params), options);
  grpc::ClientContext context;
  PrepareContext(connection_->options(), context);
  std::unique_ptr<grpc::ClientReader<tinkerd::v1::SampleStreamResponse>> reader =
      connection_->stub().SampleStream(&context, request);
  tinkerd::v1::SampleResponse out;
  for (int i = 0; i < std::max(1, request.num_samples()); ++i) out.add_sequences();
  tinkerd::v1::SampleStreamResponse message;
  absl::Status stopped;
  while (stopped.ok() && reader->Read(&message)) {
    stopped = Append(message, out);
    if (stopped.ok() && !on_message(message)) {
      stopped = absl::CancelledError("SampleStream: cancelled by the caller");
    }
  }
  if (!stopped.ok()) {
    context.TryCancel();
    while (reader->Read(&message)) {
    }
  }
  const absl::Status status = FromGrpc(reader->Finish());
  if (!stopped.ok()) return stopped;
  if (!status.ok()) return status;
  return out;
}

std::future<absl::StatusOr<std::vector<double>>> SamplingClient::ComputeLogprobs(
    std::vector<int64_t> prompt) const {
  tinkerd::v1::ComputeLogprobsRequest request;
  request.set_sampler_id(sampler_id_);
  request.set_model_id(model_id_);
  *request.mutable_prompt() = TokensInput(prompt);
  return Async(connection_, &Tinkerd::Stub::ComputeLogprobs, std::move(request),
               [](const tinkerd::v1::ComputeLogprobsResponse& r) {
                 return std::vector<double>(r.logprobs().begin(), r.logprobs().end());
               });
}

absl::Status SamplingClient::Delete() const {
  tinkerd::v1::SamplerRef ref;
  ref.set_sampler_id(sampler_id_);
  tinkerd::v1::DeleteSamplerResponse response;
  return DeleteWithRetry(connection_->options(), [&](grpc::ClientContext& context) {
    return connection_->stub().DeleteSampler(&context, ref, &response);
  });
}

// ---- Builders ----

tinkerd::v1::Tensor Int64Tensor(const std::vector<int64_t>& values) {
  tinkerd::v1::Tensor tensor;
  tensor.set_dtype(tinkerd::v1::INT64);
  tensor.add_shape(static_cast<int64_t>(values.size()));
  std::string* data = tensor.mutable_data();
  data->reserve(values.size() * 8);
  for (int64_t v : values) {
    const auto u = static_cast<uint64_t>(v);
    for (int b = 0; b < 8; ++b) data->push_back(static_cast<char>(u >> (8 * b)));
  }
  return tensor;
}

tinkerd::v1::Tensor Float32Tensor(const std::vector<float>& values) {
  tinkerd::v1::Tensor tensor;
  tensor.set_dtype(tinkerd::v1::FLOAT32);
  tensor.add_shape(static_cast<int64_t>(values.size()));
  std::string* data = tensor.mutable_data();
  data->reserve(values.size() * 4);
  for (float v : values) {
    const auto u = std::bit_cast<uint32_t>(v);
    for (int b = 0; b < 4; ++b) data->push_back(static_cast<char>(u >> (8 * b)));
  }
  return tensor;
}

namespace {
template <typename U>
U LoadLittleEndian(const char* p) {
  U u = 0;
  for (size_t b = 0; b < sizeof(U); ++b)
    u |= static_cast<U>(static_cast<unsigned char>(p[b])) << (8 * b);
  return u;
}
}  // namespace

std::vector<float> ToFloats(const tinkerd::v1::Tensor& tensor) {
  std::vector<float> out;
  if (tensor.dtype() != tinkerd::v1::FLOAT32) return out;
  const std::string& data = tensor.data();
  out.reserve(data.size() / 4);
  for (size_t i = 0; i + 4 <= data.size(); i += 4) {
    out.push_back(std::bit_cast<float>(LoadLittleEndian<uint32_t>(data.data() + i)));
  }
  return out;
}

std::vector<int64_t> ToInt64s(const tinkerd::v1::Tensor& tensor) {
  std::vector<int64_t> out;
  if (tensor.dtype() != tinkerd::v1::INT64) return out;
  const std::string& data = tensor.data();
  out.reserve(data.size() / 8);
  for (size_t i = 0; i + 8 <= data.size(); i += 8) {
    out.push_back(static_cast<int64_t>(LoadLittleEndian<uint64_t>(data.data() + i)));
  }
  return out;
}

tinkerd::v1::Datum MakeDatum(const std::vector<int64_t>& tokens,
                             const std::map<std::string, tinkerd::v1::Tensor>& inputs) {
  tinkerd::v1::Datum datum;
  auto* chunk = datum.mutable_model_input()->add_chunks()->mutable_encoded_text();
  chunk->mutable_tokens()->Add(tokens.begin(), tokens.end());
  for (const auto& [name, tensor] : inputs) (*datum.mutable_loss_fn_inputs())[name] = tensor;
  return datum;
}

}  // namespace tinkerd::client
