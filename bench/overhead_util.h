// What the front-end overhead benches (grpc_overhead_bench, http_overhead_bench) share: the batch
// both sides train on, the embedded model's runner, and the median.
#pragma once

#include <algorithm>
#include <memory>
#include <vector>

#include "runner/model_runner.h"
#include "runner/util/rng.h"

namespace tinkerd::bench {

// `seqs` sequences of `len` random tokens (seeded: the same batch every run), every target
// weighted 1.
inline std::vector<Datum> MakeBatch(int seqs, int len, int64_t vocab) {
  SplitMix64 g(7);
  std::vector<Datum> out;
  for (int i = 0; i < seqs; ++i) {
    Datum d;
    std::vector<int64_t> targets;
    for (int t = 0; t < len; ++t) {
      d.tokens.push_back(static_cast<int64_t>(g.Next() % vocab));
      targets.push_back(static_cast<int64_t>(g.Next() % vocab));
    }
    d.loss_fn_inputs["target_tokens"] = TensorData::Int64(targets);
    d.loss_fn_inputs["weights"] = TensorData::Float32(std::vector<float>(len, 1.0f));
    out.push_back(std::move(d));
  }
  return out;
}

inline std::unique_ptr<ModelRunner> EmbeddedRunner(int threads) {
  RunnerConfig rc;
  rc.base_model_path = kEmbeddedDefaultModel;
  rc.num_threads = threads;
  return std::move(*ModelRunner::Create(rc));
}

inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace tinkerd::bench
