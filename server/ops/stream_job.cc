// Ops::StreamForwardBackward: the job that consumes a stream's datums on the scheduler thread
// (ops/stream_job.h says what the edge and the job share).
#include <optional>
#include <vector>

#include "server/core/convert.h"
#include "server/core/replicated_runner.h"
#include "server/core/scheduler.h"
#include "server/ops/ops.h"
#include "server/ops/stream_job.h"

namespace tinkerd {

void Ops::StreamForwardBackward(const std::string& tenant, const std::string& model_id,
                                int64_t seq_id, v1::LossFn loss_fn,
                                std::shared_ptr<StreamState> state, bool replay,
                                Done<v1::ForwardBackwardOutput> done) {
  if (auto st = CheckOwner(model_id, tenant); !st.ok()) return done(st);
  ReplicatedRunner* runner = bases_->Of(model_id).runner;
  Metrics* metrics = metrics_;
  auto stream_id = std::make_shared<int64_t>(0);
  JobSpec job;
  job.kind = "StreamForwardBackward";
  {
    absl::MutexLock lock(&state->mu);
    job.payload_hash = state->digest;
  }
  if (!replay) {
    job.final_hash = [state] {
      absl::MutexLock lock(&state->mu);
      return state->digest;
    };
  }
  job.ready = [state] {
    absl::MutexLock lock(&state->mu);
    return !state->queue.empty() || state->closed || !state->error.ok();
  };
  job.run = [state, runner, metrics, tenant, stream_id, model_id, loss_fn]() -> JobStep {
    std::vector<v1::Datum> wire;
    std::optional<Batch> batch;
    bool closed;
    absl::Status error;
    {
      absl::MutexLock lock(&state->mu);
      for (StreamState::Arrived& a : state->queue) {
        wire.push_back(std::move(a.wire));
        if (!batch.has_value()) {
          batch = std::move(a.batch);
        } else if (absl::Status st = batch->Append(std::move(a.batch)); !st.ok()) {
          error = st;  // not reached: every datum was checked against the header's loss
        }
      }
      state->queue.clear();
      closed = state->closed;
      if (error.ok()) error = state->error;
    }
    auto fail = [&](absl::Status st) -> JobStep {
      if (*stream_id) runner->AbortStream(*stream_id);
      return {true, st};
    };
    if (!error.ok()) return fail(error);
    if (*stream_id == 0) {
      auto sid = runner->BeginStream(model_id, loss_fn);
      if (!sid.ok()) return {true, sid.status()};
      *stream_id = *sid;
    }
    if (batch.has_value()) {
      if (auto st = runner->StreamAppend(*stream_id, loss_fn, std::move(wire), *std::move(batch));
          !st.ok())
        return fail(st);
    }
    if (!closed) return JobStep{/*done=*/false};  // more datums to come: yield
    auto r = runner->FinishStream(*stream_id);
    if (!r.ok()) return {true, r.status()};
    metrics->AddTokens(tenant, static_cast<int64_t>(r->metrics.at("num_tokens:sum")));
    v1::RetrieveResultResponse out;
    ResultToProto(*r, out.mutable_forward_backward());
    return {true, out};
  };
  job.on_drop = [runner, stream_id] {
    if (*stream_id) runner->AbortStream(*stream_id);
  };
  scheduler_->Submit(model_id, seq_id, std::move(job),
                     [done = std::move(done)](const JobResult& r) {
                       if (!r.ok()) return done(r.status());
                       done(r->forward_backward());
                     });
}

bool Ops::SeqIdUsed(const std::string& model_id, int64_t seq_id) const {
  return scheduler_->Used(model_id, seq_id);
}

void Ops::WakeStreams() {
  scheduler_->Wake();
}

}  // namespace tinkerd
