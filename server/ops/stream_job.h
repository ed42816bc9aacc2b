// StreamForwardBackward's shared state: the edge that reads the stream (gRPC threads) appends the
// datums as they arrive, and the stream's job (Ops::StreamForwardBackward, on the scheduler
// thread) feeds them to the runner, which runs full micro-batches as they fill. Only a clean
// half-close (`closed`) commits the stream; an error discards all of it.
#pragma once

#include <deque>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "runner/batch.h"
#include "runner/util/hash.h"
#include "tinkerd/v1/tinkerd.pb.h"

namespace tinkerd {

struct StreamState {
  absl::Mutex mu;
  // Each datum as it came (for the other ranks) and decoded and checked on arrival (for the
  // runner): the stream's one decoding.
  struct Arrived {
    v1::Datum wire;
    Batch batch;
  };
  std::deque<Arrived> queue ABSL_GUARDED_BY(mu);
  bool closed ABSL_GUARDED_BY(mu) = false;  // the client half-closed: every datum is here
  absl::Status error ABSL_GUARDED_BY(mu);   // a bad or unparsable message, or the client went away
  // Over the header and every datum in order (deterministic serializations): the payload part of
  // the stream's retry key, complete once `closed` or `error` is set.
  uint64_t digest ABSL_GUARDED_BY(mu) = kFnv64Basis;
};

}  // namespace tinkerd
