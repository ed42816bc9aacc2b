// Rotary position embeddings with the rope_scaling variants of Llama / Qwen / Mistral configs.
//
// For head dimension d and j in [0, d/2): inv_freq_j = θ^(-2j/d), modified by the scaling type;
// the angle of position p is p·inv_freq_j and cos/sin are multiplied by an attention factor
// (yarn only). Vectors are rotated in Hugging Face's "rotate_half" convention:
//   out = x·cos + [-x₂, x₁]·sin with x = [x₁, x₂] split into halves.
//
// Shape suffixes: T tokens, H heads, d head_dim, R = d/2 rotary frequencies.
#pragma once

#include <ATen/ATen.h>

#include <mutex>
#include <vector>

#include "runner/model/config.h"

namespace tinkerd {

struct RopeTables {
  at::Tensor cos_Td;  // [T, d], already scaled by the attention factor
  at::Tensor sin_Td;
};

// Frequencies for a sequence of `seq_len` tokens (only "dynamic" scaling depends on it).
std::vector<double> RopeInvFreq(const ModelConfig& config, int64_t seq_len);
double RopeAttentionFactor(const ModelConfig& config);

// cos/sin for a packed micro-batch: sequence s's tokens sit at positions past[s], past[s] + 1, ...
// (past empty: every sequence starts at 0; a decode step continuing a KV cache passes the cached
// lengths). Each sequence uses the frequencies it would use if run alone at its full length
// (matters only for "dynamic"). `to` gives the tables' dtype and device (the weights'); they are
// computed on the host in double.
RopeTables BuildRopeTables(const ModelConfig& config, const std::vector<int64_t>& cu_seqlens,
                           const at::TensorOptions& to, const std::vector<int64_t>& past = {});

// cos/sin rows by position, computed once on the host in double and kept in the compute dtype on
// the weights' device; a micro-batch gathers its rows (the same values BuildRopeTables gives)
// instead of rebuilding them. "dynamic" scaling, whose frequencies depend on each sequence's
// length, still builds per micro-batch. Thread-safe.
class RopeCache {
 public:
  RopeCache(const ModelConfig& config, const at::TensorOptions& to) : config_(config), to_(to) {}
  RopeTables Tables(const std::vector<int64_t>& cu_seqlens, const std::vector<int64_t>& past = {});

 private:
  std::mutex mu_;
  const ModelConfig config_;
  const at::TensorOptions to_;
  RopeTables rows_;  // [P, d] for positions 0..P-1; grown by doubling
};

// Applies the rotation to x_THd with cos/sin [T, d].
at::Tensor ApplyRope(const at::Tensor& x_THd, const RopeTables& tables);

}  // namespace tinkerd
