#include "server/grpc/stream_reactor.h"

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "runner/batch.h"
#include "runner/loss/loss_spec.h"
#include "server/common/status_map.h"
#include "server/core/convert.h"
#include "server/ops/stream_job.h"

namespace tinkerd {
namespace {

// StreamForwardBackward: the header opens a job in the model's seq_id order; datums are
// validated on arrival and queued; the job feeds them to the runner's stream (which runs full
// micro-batches as they fill) and commits only when the client half-closed cleanly. Anything
// else (a bad or unparsable message, a cancel, a disconnect) discards the whole stream.
//
// A stream for a seq_id already used is a retry (or a conflict): its payload is known only once
// it is complete, so it is read to the end first and submitted then, with its digest, to be
// compared with the earlier request's.
class StreamReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  StreamReactor(TinkerdService* svc, grpc::CallbackServerContext* ctx, grpc::ByteBuffer* resp,
                absl::StatusOr<std::string> tenant)
      : svc_(svc), ctx_(ctx), resp_(resp), tenant_(std::move(tenant)) {
    if (!tenant_.ok()) {
      FinishOnce(tenant_.status());
      return;
    }
    StartRead(&buf_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client half-closed, or the call failed: told apart in OnReadsEnded
      OnReadsEnded();
      return;
    }
    const size_t index = messages_++;
    v1::StreamForwardBackwardMessage msg;
    if (!grpc::SerializationTraits<v1::StreamForwardBackwardMessage>::Deserialize(&buf_, &msg)
             .ok()) {
      const absl::Status st = absl::InvalidArgumentError(absl::StrCat(
          "stream message ", index, ": does not parse as a StreamForwardBackwardMessage"));
      if (!opened_) {
        FinishOnce(st);
      } else {
        Fail(st);
      }
      return;
    }
    if (!opened_) {
      if (!msg.has_header()) {
        FinishOnce(absl::InvalidArgumentError("stream: the first message must be a header"));
        return;
      }
      if (!Open(msg.header())) return;
    } else if (!msg.has_datum()) {
      Fail(absl::InvalidArgumentError(
          absl::StrCat("stream message ", index, ": after the header, only datums may follow")));
      return;
    } else {
      absl::StatusOr<Datum> d = DatumFromProto(msg.datum(), received_);
      absl::StatusOr<Batch> batch =
          d.ok() ? Batch::Check({*std::move(d)}, loss_, limits_) : d.status();
      const absl::Status st = batch.status();
      {
        absl::MutexLock lock(&state_->mu);
        state_->digest = PayloadHash(msg, state_->digest);
      }
      if (!st.ok()) {
        Fail(absl::InvalidArgumentError(
            absl::StrCat("stream datum ", received_, ": ", st.message())));
        return;
      }
      ++received_;
      absl::MutexLock lock(&state_->mu);
      state_->queue.push_back({std::move(*msg.mutable_datum()), *std::move(batch)});
    }
    svc_->ops()->WakeStreams();
    StartRead(&buf_);
  }

  // A read fails alike for a half-close and for a cancel or a disconnect, and OnCancel may come
  // later still. Sending the initial metadata tells them apart: it fails once the client's side
  // of the call is gone, and succeeds on a call the client only half-closed.
  void OnSendInitialMetadataDone(bool ok) override {
    if (!ok || ctx_->IsCancelled()) {
      Fail(absl::CancelledError(
          "stream: the client cancelled or went away before closing it; nothing was applied"));
      return;
    }
    if (received_ == 0) {  // as for a unary call with an empty batch
      Fail(absl::InvalidArgumentError("data: the stream closed without datums"));
      return;
    }
    {
      absl::MutexLock lock(&state_->mu);
      state_->closed = true;
    }
    if (replay_) Submit();
    svc_->ops()->WakeStreams();
  }

  void OnCancel() override {
    {
      absl::MutexLock lock(&state_->mu);
      if (state_->error.ok()) state_->error = absl::CancelledError("stream: client cancelled");
    }
    svc_->ops()->WakeStreams();
  }

  void OnDone() override { delete this; }

 private:
  void OnReadsEnded() {
    if (!opened_) {
      FinishOnce(absl::InvalidArgumentError("stream: closed before its header"));
      return;
    }
    {
      absl::MutexLock lock(&finish_mu_);
      if (finished_) return;  // answered already (say, the seq_id was refused)
    }
    StartSendInitialMetadata();
  }

  // Whether to read on: false once the stream has its answer.
  bool Open(const v1::StreamHeader& h) {
    if (absl::Status own = svc_->ops()->CheckOwner(h.model_id(), *tenant_); !own.ok()) {
      FinishOnce(own);
      return false;
    }
    auto loss = ResolveLoss(h.loss_fn().name(), ConfigFromProto(h.loss_fn()));
    header_ = h;
    {
      absl::MutexLock lock(&state_->mu);
      state_->digest = PayloadHash(h);
      // An invalid header still takes its seq_id, answered with the error, as an invalid unary
      // request does: the model's later requests are not held up behind it.
      if (!loss.ok()) state_->error = loss.status();
    }
    opened_ = true;
    replay_ = svc_->ops()->SeqIdUsed(h.model_id(), h.seq_id());
    if (!loss.ok()) {
      Submit();
      return false;
    }
    loss_ = *std::move(loss);
    limits_ = svc_->ops()->BaseOf(h.model_id()).limits;
    if (!replay_) Submit();
    return true;
  }

  // Queues the stream's job (Ops::StreamForwardBackward): at once for a new seq_id (it runs
  // while datums arrive, its digest taken when it finishes), or for a retry once the stream is
  // complete.
  void Submit() {
    svc_->ops()->StreamForwardBackward(*tenant_, header_.model_id(), header_.seq_id(),
                                       header_.loss_fn(), state_, replay_,
                                       [this](const absl::StatusOr<v1::ForwardBackwardOutput>& r) {
                                         if (r.ok()) {
                                           const std::string bytes = r->SerializeAsString();
                                           grpc::Slice slice(bytes);
                                           *resp_ = grpc::ByteBuffer(&slice, 1);
                                         }
                                         FinishOnce(r.status());
                                       });
  }

  // The stream failed after its header: the job sees the error and answers with it, keeping the
  // seq_id order intact. No read is started again.
  void Fail(absl::Status st) {
    Ops* ops = svc_->ops();  // read before the job can finish and free us
    const bool submit = replay_;
    {
      absl::MutexLock lock(&state_->mu);
      if (state_->error.ok()) state_->error = st;
    }
    if (submit) Submit();
    ops->WakeStreams();
  }

  void FinishOnce(const absl::Status& st) {
    {
      absl::MutexLock lock(&finish_mu_);
      if (finished_) return;
      finished_ = true;
    }
    // Outside the lock: Finish may lead gRPC to call OnDone, which deletes this reactor (and its
    // mutex) on another thread before a lock guard here could release it.
    Finish(ToGrpcStatus(st));
  }

  TinkerdService* svc_;
  grpc::CallbackServerContext* ctx_;
  grpc::ByteBuffer* resp_;
  absl::StatusOr<std::string> tenant_;
  grpc::ByteBuffer buf_;
  // Created up front: OnCancel may run on another thread at any time.
  const std::shared_ptr<StreamState> state_ = std::make_shared<StreamState>();
  v1::StreamHeader header_;
  ResolvedLoss loss_;    // the header's
  ModelLimits limits_;   // its model's base's
  bool opened_ = false;  // the header was valid
  bool replay_ = false;  // a retry: submitted once complete
  size_t messages_ = 0;
  size_t received_ = 0;
  absl::Mutex finish_mu_;
  bool finished_ = false;
};

}  // namespace

grpc::ServerReadReactor<grpc::ByteBuffer>* NewStreamReactor(TinkerdService* service,
                                                            grpc::CallbackServerContext* ctx,
                                                            grpc::ByteBuffer* resp,
                                                            absl::StatusOr<std::string> tenant) {
  return new StreamReactor(service, ctx, resp, std::move(tenant));
}

}  // namespace tinkerd
