// The memory a training call takes beyond its model's state, estimated before it runs so that it
// is reserved in the process's account (runner/util/memory_account.h): the activations of its
// largest micro-batch, the logprob head's chunk, and under backward the staged gradient beside
// autograd's result. An upper bound for tinkerd's own kernels, derived below and checked against
// bench/RESULTS.md's measured peaks on the CPU; not a promise about other code in the process.
// CUDA's kernels keep far less: the ~1.1B bench row peaks at 25 GB on an H100, its 17.6 GB of
// state and 4.4 GB staged gradient included, where this estimates 73 GB for its call alone; so
// calls on a GPU are not reserved (ModelRunner).
#pragma once

#include <cstdint>

#include "runner/model/config.h"

namespace tinkerd {

struct CallShape {
  int64_t tokens = 0;            // of the largest micro-batch the call can form
  bool backward = true;          // forward_backward (false: forward)
  bool checkpointing = false;    // --activation_checkpointing
  int64_t compute_bytes = 4;     // element size of the activations
  int64_t trainable_values = 0;  // of the model's trainable tensors
  int64_t train_bytes = 4;       // element size of their gradients
  // --shard=full: values gathered whole at once (the rest of the model and its largest layer),
  // held as weights of gathered_bytes each and, in a backward of a full fine-tune, as their
  // gradients in the training dtype. A sharded base's (--shard_base) are frozen, in the compute
  // dtype (bf16: 2 bytes), and make no gradient.
  int64_t gathered_values = 0;
  int64_t gathered_bytes = 4;
  bool gathered_frozen = false;
  // Expert parallelism: the ranks of a group (runner/dist/expert_parallel.h). A rank may receive
  // every slot of theirs that routes to its experts, so its routed layers hold up to this many
  // times its own slots' rows more.
  int64_t expert_group = 1;
};

// Per token and decoder layer a backward keeps the layer's inputs to each op: two norms' outputs,
// q, k, v and their RoPE'd copies, the attention output, o_proj's, gate, up and SwiGLU's, down's
// and the residual sums, about 6D + 3Hd + 3Kd + 3I values; gradients of the same size are alive
// while the layer's backward runs, so 2x. Without checkpointing every layer's are kept; with it,
// each layer's input (D) and one layer's 2x. A forward without gradients holds one layer's at a
// time. The head forms 3 · 1,024 tokens · 8,192 vocabulary entries (kernels/logprob_head.h) in at
// least float32. A quarter is added for the allocator's rounding and LibTorch's temporaries
// (bench/RESULTS.md, "Memory against tokens": 4,096 tokens of the bench model peak 2.0 GB above
// the weights without checkpointing, 0.5 GB with; this gives 2.5 and 0.6 GB). Backward adds the
// staged gradient and autograd's result, each of the trainable values (under --shard=full, the
// staged slices; the gathered units and their gradients are counted apart).
int64_t CallBytes(const ModelConfig& config, const CallShape& call);

}  // namespace tinkerd
