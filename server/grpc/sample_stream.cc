#include "server/grpc/sample_stream.h"

#include <deque>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/common/status_map.h"
#include "server/core/convert.h"
#include "tinkerd/v1/tinkerd.grpc.pb.h"  // SerializationTraits for protobuf messages

namespace tinkerd {
namespace {

grpc::ByteBuffer Serialize(const v1::SampleStreamResponse& message) {
  const std::string bytes = message.SerializeAsString();
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

v1::StopReason ToProto(StopReason r) {
  return r == StopReason::kStop ? v1::STOP_REASON_STOP : v1::STOP_REASON_LENGTH;
}

// The engine produces on the scheduler thread; gRPC allows one write in flight. Messages wait in
// an outbox, written one at a time from OnWriteDone, and the status is sent once the outbox has
// drained. The outbox is shared with the engine's callbacks, which may outlive the reactor: once
// the call is cancelled or finished they are told nobody listens, and the engine drops the
// request at its next step. A slow reader holds at most its own request's tokens here.
//
// Locking: whoever sets `writing` issues that StartWrite, and whoever sees the outbox drained
// with `status` set issues the one Finish, both outside the mutex (gRPC may run a reaction
// inline). The reactor is deleted in OnDone, which gRPC calls only after Finish.
class SampleStreamReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  struct Outbox {
    absl::Mutex mu;
    SampleStreamReactor* reactor;
    std::deque<grpc::ByteBuffer> queue ABSL_GUARDED_BY(mu);
    bool writing ABSL_GUARDED_BY(mu) = false;
    bool cancelled ABSL_GUARDED_BY(mu) = false;
    std::optional<grpc::Status> status ABSL_GUARDED_BY(mu);  // set once; Finish follows

    // False once the call is over: the engine stops the request.
    bool Push(grpc::ByteBuffer message) {
      grpc::ByteBuffer* first = nullptr;
      {
        absl::MutexLock lock(&mu);
        if (cancelled || status) return false;
        queue.push_back(std::move(message));
        if (writing) return true;
        writing = true;
        first = &queue.front();
      }
      reactor->StartWrite(first);
      return true;
    }

    void Close(const grpc::Status& s) {
      {
        absl::MutexLock lock(&mu);
        if (status) return;
        status = s;
        if (writing) return;  // OnWriteDone finishes once the outbox drains
      }
      reactor->Finish(s);
    }

    void WriteDone(bool ok) {
      grpc::ByteBuffer* next = nullptr;
      std::optional<grpc::Status> finish;
      {
        absl::MutexLock lock(&mu);
        queue.pop_front();
        if (!ok) {  // the client has gone: what is queued can never be written
          cancelled = true;
          queue.clear();
        }
        if (!queue.empty()) {
          next = &queue.front();
        } else {
          writing = false;
          finish = status;  // set: Close found a write in flight and left Finish to us
        }
      }
      if (next != nullptr) reactor->StartWrite(next);
      if (finish) reactor->Finish(*finish);
    }

    void Cancel() {
      absl::MutexLock lock(&mu);
      cancelled = true;
    }
  };

  SampleStreamReactor() : outbox_(std::make_shared<Outbox>()) { outbox_->reactor = this; }

  void Start(Sampling* sampling, const std::string& tenant, const v1::SampleRequest& request) {
    std::shared_ptr<Outbox> outbox = outbox_;
    const bool prompt_logprobs = request.prompt_logprobs();
    const bool topk = request.topk_prompt_logprobs() > 0 || request.has_target_prompt_logprobs() ||
                      request.prompt_alt_tokens_k() > 0;
    auto progress = [outbox](std::vector<SampleDelta> deltas) {
      v1::SampleStreamResponse message;
      for (SampleDelta& d : deltas) {
        v1::SampleDelta* out = message.add_deltas();
        out->set_index(static_cast<int32_t>(d.index));
        out->mutable_tokens()->Add(d.tokens.begin(), d.tokens.end());
        out->mutable_logprobs()->Add(d.logprobs.begin(), d.logprobs.end());
        for (const TopLogprobs& row : d.topk_logprobs) {
          TopLogprobsToProto(row, out->add_topk_logprobs());
        }
        if (d.stop) out->set_stop_reason(ToProto(*d.stop));
      }
      return outbox->Push(Serialize(message));
    };
    auto done = [outbox, prompt_logprobs, topk](absl::StatusOr<v1::SampleResponse> r) {
      if (!r.ok()) return outbox->Close(ToGrpcStatus(r.status()));
      if (prompt_logprobs || topk) {  // the tokens went out with progress; the prompt's now
        v1::SampleStreamResponse last;
        *last.mutable_prompt_logprobs() = std::move(*r->mutable_prompt_logprobs());
        *last.mutable_topk_prompt_logprobs() = std::move(*r->mutable_topk_prompt_logprobs());
        *last.mutable_target_prompt_logprobs() = std::move(*r->mutable_target_prompt_logprobs());
        *last.mutable_prompt_alt_tokens() = std::move(*r->mutable_prompt_alt_tokens());
        *last.mutable_prompt_alt_logprobs() = std::move(*r->mutable_prompt_alt_logprobs());
        outbox->Push(Serialize(last));
      }
      outbox->Close(grpc::Status::OK);
    };
    sampling->Sample(tenant, request, std::move(done), std::move(progress));
  }

  void Fail(const absl::Status& status) { outbox_->Close(ToGrpcStatus(status)); }

  void OnWriteDone(bool ok) override { outbox_->WriteDone(ok); }
  void OnCancel() override { outbox_->Cancel(); }
  void OnDone() override { delete this; }

 private:
  std::shared_ptr<Outbox> outbox_;
};

}  // namespace

grpc::ServerWriteReactor<grpc::ByteBuffer>* NewSampleStreamReactor(
    Sampling* sampling, const grpc::ByteBuffer* request, absl::StatusOr<std::string> tenant) {
  auto* reactor = new SampleStreamReactor();
  if (!tenant.ok()) {
    reactor->Fail(tenant.status());
    return reactor;
  }
  v1::SampleRequest req;
  grpc::ByteBuffer bytes(*request);  // shares the slices; Deserialize clears the buffer it reads
  if (!grpc::SerializationTraits<v1::SampleRequest>::Deserialize(&bytes, &req).ok()) {
    reactor->Fail(absl::InvalidArgumentError(
        "request: does not parse as tinkerd.v1.SampleRequest (malformed bytes, or a string field "
        "that is not valid UTF-8)"));
    return reactor;
  }
  if (req.routed_experts()) {
    reactor->Fail(absl::InvalidArgumentError(
        "routed_experts: SampleStream does not return routes; ask Sample for them"));
    return reactor;
  }
  reactor->Start(sampling, *tenant, req);
  return reactor;
}

}  // namespace tinkerd
