// C++ client for the tinkerd gRPC service, shaped like Tinker's Python client: a Connection for
// model management, one TrainingClient per model that numbers its calls and returns futures so a
// caller can keep several requests in flight.
//
// Exactly-once: every call that touches a model's training state carries (model_id, seq_id). The
// TrainingClient fixes a call's seq_id when the call is made and every retry of that call resends
// the same seq_id with the same payload, so the server applies it at most once and a retry after
// a lost reply gets the stored result instead of a second gradient or optimizer step.
//
// Errors: nothing here throws or aborts on a server or network error; failures come back as
// absl::Status with the gRPC code carried over unchanged (see FromGrpc).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tinkerd/v1/tinkerd.grpc.pb.h"

namespace tinkerd::client {

struct ClientOptions {
  std::string target = "127.0.0.1:50051";
  // Attempts per call, the first included. Only UNAVAILABLE and RESOURCE_EXHAUSTED are retried.
  int max_attempts = 8;
  std::chrono::milliseconds initial_backoff{50};
  std::chrono::milliseconds max_backoff{2000};
  // Per attempt, not per call: a call that is retried can take up to max_attempts deadlines.
  // Generous by default because a pipelined request waits on the server for its predecessors.
  std::chrono::milliseconds deadline{600000};
  std::string api_key;  // sent as metadata "x-api-key" when non-empty
  int max_message_bytes = 256 << 20;
  // TLS, as PEM text (not paths: Create never fails; LoadTlsFiles reads files). The channel uses
  // TLS when `tls` is set; an empty root set means the system's trust store. A client
  // certificate and key are sent when both are set (the server's mutual-TLS mode needs them).
  bool tls = false;
  std::string tls_root_certs;
  std::string tls_client_cert;
  std::string tls_client_key;
};

// Fills the TLS fields of `options` from PEM files (any path may be empty) and sets `tls`.
// INVALID_ARGUMENT naming the file when one cannot be read, or when only one of the client
// certificate and key is given.
absl::Status LoadTlsFiles(const std::string& root_certs_path, const std::string& client_cert_path,
                          const std::string& client_key_path, ClientOptions& options);

// Same code, same message (both use the canonical codes); a non-canonical value becomes UNKNOWN.
absl::Status FromGrpc(const grpc::Status& status);

// The retry policy behind every unary call in this library; exposed so tests can drive it.
// `attempt` is called with a fresh ClientContext (deadline and metadata already set) and must
// send the identical request each time — that is what keeps mutating calls exactly-once.
// Retries UNAVAILABLE and RESOURCE_EXHAUSTED (except a message-size refusal, which would fail
// the same way again) with jittered exponential backoff capped at max_backoff; any other code is
// returned at once. Blocks the calling thread, sleeps included.
absl::Status CallWithRetry(const ClientOptions& options,
                           const std::function<grpc::Status(grpc::ClientContext&)>& attempt);

class TrainingClient;
class SamplingClient;

// One channel to one server. Thread-safe: every method may be called from any thread at once
// (gRPC channels and stubs are). Shared so that TrainingClients and in-flight futures keep it
// alive; it is destroyed when the last of them lets go.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  // Connects lazily: this never fails, and an unreachable server shows up as UNAVAILABLE on the
  // first call (after its retries).
  static std::shared_ptr<Connection> Create(ClientOptions options);
  // For tests: use a channel made elsewhere, e.g. grpc::Server::InProcessChannel. The channel's
  // own message-size limits apply; options.max_message_bytes is ignored.
  static std::shared_ptr<Connection> CreateWithChannel(ClientOptions options,
                                                       std::shared_ptr<grpc::Channel> channel);

  // Retried like every call, but creation has no idempotency key: if a reply is lost after the
  // server created the model, the retry creates a second one and the first is orphaned.
  absl::StatusOr<tinkerd::v1::ModelInfo> CreateModel(
      const tinkerd::v1::CreateModelRequest& request);
  absl::StatusOr<tinkerd::v1::ModelInfo> GetInfo(const std::string& model_id);
  absl::StatusOr<std::vector<tinkerd::v1::ModelInfo>> ListModels();
  // NOT_FOUND on a retry counts as success: an earlier attempt deleted it and lost the reply.
  absl::Status DeleteModel(const std::string& model_id);
  // A sampler: a model's weights frozen (in its call order when seq_id > 0, which makes a retry
  // get the same sampler), or a sampler checkpoint's (request.path). Sample it with
  // Sampler(info.sampler_id()).
  absl::StatusOr<tinkerd::v1::SamplerInfo> CreateSampler(
      const tinkerd::v1::CreateSamplerRequest& request);
  // grpc.health.v1 Check for the whole server (service ""): true when SERVING. A server without
  // the health service answers UNIMPLEMENTED, returned as that error.
  absl::StatusOr<bool> Health();

  // A TrainingClient for an existing model. next_seq_id must be the seq_id the server expects
  // next for this model: 1 for a fresh model, else ModelInfo.next_seq_id. A wrong value makes
  // the server refuse (too low) or hold (too high) every call, so pass GetInfo's when resuming.
  std::unique_ptr<TrainingClient> Attach(const std::string& model_id, int64_t next_seq_id = 1);
  // What SamplingClient samples: a sampler; else a model's current weights, frozen per request;
  // both empty, the base model.
  SamplingClient Sampler(const std::string& sampler_id, const std::string& model_id = "");

  const ClientOptions& options() const { return options_; }
  tinkerd::v1::Tinkerd::Stub& stub() const { return *stub_; }

 private:
  Connection(ClientOptions options, std::shared_ptr<grpc::Channel> channel);

  const ClientOptions options_;
  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<tinkerd::v1::Tinkerd::Stub> stub_;
  grpc::GenericStub generic_stub_;  // for the health check, whose proto Debian lacks
};

// A StreamForwardBackward call: datums go to the server as they are produced and are applied as
// one forward_backward, atomically, when Finish closes the stream. Its seq_id is taken when the
// stream is opened, so calls made on the TrainingClient afterwards are applied after it.
//
// Not retried: the stream does not keep the caller's datums, so it cannot be replayed. After an
// UNAVAILABLE or DEADLINE_EXCEEDED from Finish, RetrieveResult(seq_id()) tells whether the server
// applied it; if not, its seq_id is a gap (see TrainingClient).
// Not thread-safe: one thread writes and finishes. The whole stream lives under one deadline
// (ClientOptions::deadline, counted from opening). Destroying an unfinished stream cancels it, so
// nothing of it is applied.
class TrajectoryStream {
 public:
  ~TrajectoryStream();
  TrajectoryStream(const TrajectoryStream&) = delete;
  TrajectoryStream& operator=(const TrajectoryStream&) = delete;

  // Sends one datum. On an error the stream is over: the returned status is the server's reason
  // (Finish returns it again).
  absl::Status Write(const tinkerd::v1::Datum& datum);
  // Half-closes the stream and waits for the server's result. Calling it again returns the same.
  absl::StatusOr<tinkerd::v1::ForwardBackwardOutput> Finish();

  int64_t seq_id() const { return seq_id_; }

 private:
  friend class TrainingClient;
  TrajectoryStream(std::shared_ptr<Connection> connection, int64_t seq_id);
  void Close(absl::Status status);

  const std::shared_ptr<Connection> connection_;
  const int64_t seq_id_;
  grpc::ClientContext context_;
  tinkerd::v1::ForwardBackwardOutput response_;
  std::unique_ptr<grpc::ClientWriter<tinkerd::v1::StreamForwardBackwardMessage>> writer_;
  bool finished_ = false;
  absl::Status status_;  // valid once finished_
};

// Drives one model. Thread-safe; seq_ids are handed out in the order calls are made (an atomic
// counter), so calls from several threads are applied in whatever order they won the counter.
//
// The futures come from std::async: each call runs its blocking retry loop on its own thread.
// Like any std::async future, destroying one waits for its call to end, so an ignored result
// still completes (and is still applied on the server). The futures do not depend on the
// TrainingClient, which may be destroyed while they are pending.
//
// A call that fails for good still used up its seq_id. A call the server answered (even with an
// error) has its place in the order; one that never reached it (UNAVAILABLE after every retry)
// leaves a gap that holds back every later call until the server gives up on it. Once every
// outstanding future has finished, Connection::Attach(model_id, GetInfo()->next_seq_id())
// resumes from wherever the server stands.
class TrainingClient {
 public:
  TrainingClient(std::shared_ptr<Connection> connection, std::string model_id, int64_t next_seq_id);

  std::future<absl::StatusOr<tinkerd::v1::ForwardBackwardOutput>> ForwardBackward(
      std::vector<tinkerd::v1::Datum> data, tinkerd::v1::LossFn loss);
  // Logprobs and loss without a gradient. Still takes a seq_id: the server orders it with the rest.
  std::future<absl::StatusOr<tinkerd::v1::ForwardBackwardOutput>> Forward(
      std::vector<tinkerd::v1::Datum> data, tinkerd::v1::LossFn loss);
  std::future<absl::StatusOr<tinkerd::v1::OptimStepResponse>> OptimStep(
      tinkerd::v1::AdamParams adam);
  // Opens the stream and sends its header before returning; a failure to do so is reported by
  // the first Write or by Finish.
  std::unique_ptr<TrajectoryStream> StreamForwardBackward(tinkerd::v1::LossFn loss);

  // Checkpoints, each in its place among the model's calls (a seq_id of its own): the training
  // state (weights and Adam moments) as tinker://<model>/weights/<name>, and the weights for
  // sampling (a PEFT adapter, or merged HF-layout weights) as .../sampler_weights/<name>. Futures
  // of the checkpoint's path.
  std::future<absl::StatusOr<std::string>> SaveState(std::string name, bool overwrite = false);
  std::future<absl::StatusOr<std::string>> LoadState(std::string path, bool with_optimizer = true);
  std::future<absl::StatusOr<std::string>> SaveWeightsForSampler(std::string name,
                                                                 bool merged = false,
                                                                 bool overwrite = false);
  // A sampler of the weights as they are after every call made before this one, whatever runs
  // after (no checkpoint is written): the on-policy step of an RL loop.
  std::future<absl::StatusOr<SamplingClient>> SaveWeightsAndGetSamplingClient();

  // A finished call's result again, while the server's bounded cache still has it. Read-only,
  // so it is retried like any call and takes no seq_id of its own.
  absl::StatusOr<tinkerd::v1::RetrieveResultResponse> RetrieveResult(int64_t seq_id);
  absl::StatusOr<tinkerd::v1::ModelInfo> GetInfo();

  const std::string& model_id() const { return model_id_; }
  // The seq_id the next call will get.
  int64_t next_seq_id() const { return next_seq_id_.load(); }

 private:
  // A request for this model with the next seq_id.
  template <typename Request>
  Request Ordered();
  std::future<absl::StatusOr<tinkerd::v1::ForwardBackwardOutput>> SendForwardBackward(
      std::vector<tinkerd::v1::Datum> data, tinkerd::v1::LossFn loss, bool backward);

  const std::shared_ptr<Connection> connection_;
  const std::string model_id_;
  std::atomic<int64_t> next_seq_id_;
};

struct SampleOptions {
  int num_samples = 1;  // they share the prompt's prefill
  bool prompt_logprobs = false;
  int topk_prompt_logprobs = 0;
};

// Samples one policy (see Connection::Sampler). A value: cheap to copy, thread-safe, and its
// futures do not depend on it. Sample and ComputeLogprobs change nothing on the server, so they
// are retried like any call; with params.seed set, a retry decodes the same tokens.
class SamplingClient {
 public:
  SamplingClient(std::shared_ptr<Connection> connection, std::string sampler_id,
                 std::string model_id);

  std::future<absl::StatusOr<tinkerd::v1::SampleResponse>> Sample(
      std::vector<int64_t> prompt, tinkerd::v1::SamplingParams params,
      SampleOptions options = {}) const;
  // The same answer, token by token: `on_message` gets each message as the server decodes it
  // (on the calling thread, which this blocks) and returns false to cancel, which ends the call
  // CANCELLED and frees its samples on the server. Returns the deltas assembled: what Sample
  // answers. Not retried: a stream cut short has already delivered part of its answer.
  absl::StatusOr<tinkerd::v1::SampleResponse> SampleStream(
      std::vector<int64_t> prompt, tinkerd::v1::SamplingParams params,
      const std::function<bool(const tinkerd::v1::SampleStreamResponse&)>& on_message,
      SampleOptions options = {}) const;
  // logp(prompt[t] | prompt[<t]) for every t, NaN at position 0.
  std::future<absl::StatusOr<std::vector<double>>> ComputeLogprobs(
      std::vector<int64_t> prompt) const;
  // Releases the sampler's frozen weights. NOT_FOUND on a retry counts as success.
  absl::Status Delete() const;

  const std::string& sampler_id() const { return sampler_id_; }
  const std::string& model_id() const { return model_id_; }

 private:
  tinkerd::v1::SampleRequest Request(const std::vector<int64_t>& prompt,
                                     tinkerd::v1::SamplingParams params,
                                     const SampleOptions& options) const;

  std::shared_ptr<Connection> connection_;
  std::string sampler_id_;
  std::string model_id_;
};

// Tensor and Datum builders. Tensors are 1-D ({n}), packed little-endian whatever the host order.
tinkerd::v1::Tensor Int64Tensor(const std::vector<int64_t>& values);
tinkerd::v1::Tensor Float32Tensor(const std::vector<float>& values);
// Empty unless dtype is FLOAT32 (resp. INT64); a trailing partial element is ignored.
std::vector<float> ToFloats(const tinkerd::v1::Tensor& tensor);
std::vector<int64_t> ToInt64s(const tinkerd::v1::Tensor& tensor);
// A datum whose model_input is one encoded_text chunk holding `tokens`.
tinkerd::v1::Datum MakeDatum(const std::vector<int64_t>& tokens,
                             const std::map<std::string, tinkerd::v1::Tensor>& inputs);

}  // namespace tinkerd::client
