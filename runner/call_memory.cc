#include "runner/call_memory.h"

#include <algorithm>

namespace tinkerd {

int64_t CallBytes(const ModelConfig& c, const CallShape& call) {
  const int64_t D = c.hidden_size, L = c.num_hidden_layers;
  // A routed layer holds each token's k experts' intermediates, its k gathered inputs and outputs
  // (counted as intermediates too, D ≤ I in published models), its router's probabilities and a
  // shared expert's intermediates (Qwen2-MoE). Under expert parallelism its own k slots are sent
  // away and returned (their inputs and outputs), and it may receive and run up to group · min(k,
  // its experts) slots per token of its own (every rank of the group sending all of its tokens'
  // choices of its experts).
  const int64_t group = std::max<int64_t>(call.expert_group, 1);
  int64_t routed = 0;
  if (c.moe.num_experts > 0) {
    const int64_t expert_rows = c.moe.expert_intermediate_size + 2 * D;
    routed =
        c.moe.num_experts + c.moe.shared_expert_intermediate_size +
        (group == 1 ? c.moe.top_k * expert_rows
                    : c.moe.top_k * 2 * D +
                          group * std::min(c.moe.top_k, c.moe.num_experts / group) * expert_rows);
  }
  const int64_t I = std::max(c.intermediate_size, routed);
  const int64_t Hd = c.num_attention_heads * c.head_dim, Kd = c.num_key_value_heads * c.head_dim;
  const int64_t layer = 2 * (6 * D + 3 * Hd + 3 * Kd + 3 * I);
  const int64_t kept = !call.backward ? layer : call.checkpointing ? L * D + layer : L * layer;
  const int64_t activations = call.tokens * (kept + 3 * D) * call.compute_bytes;
  const int64_t head = 3 * std::min<int64_t>(call.tokens, 1024) *
                       std::min<int64_t>(c.vocab_size, 8192) *
                       std::max<int64_t>(call.compute_bytes, 4);
  const int64_t gradients = call.backward ? 2 * call.trainable_values * call.train_bytes : 0;
  const int64_t gathered =
      call.gathered_values *
      (call.gathered_bytes + (call.backward && !call.gathered_frozen ? call.train_bytes : 0));
  return (activations + head) / 4 * 5 + gradients + gathered;
}

}  // namespace tinkerd
