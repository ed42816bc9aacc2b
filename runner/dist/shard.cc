#include "runner/dist/shard.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>

#include "runner/util/status_macros.h"

namespace tinkerd {
namespace {

// Elements per rank in one bucket: a [W, K] staging tensor of at most 64 MiB, so that a large
// model's reduction is a few big collectives without a second copy of its whole gradient.
int64_t BucketElements(int world_size, const at::Tensor& like) {
  constexpr int64_t kBucketBytes = int64_t{64} << 20;
  return std::max<int64_t>(1, kBucketBytes / (world_size * static_cast<int64_t>(like.itemsize())));
}

at::Tensor Flat(const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), "a sharded tensor must be contiguous");
  return t.view(-1);
}

}  // namespace

ShardLayout::ShardLayout(std::vector<int64_t> numels, int world_size, int rank)
    : world_size_(world_size), rank_(rank) {
  offsets_.push_back(0);
  for (int64_t n : numels) offsets_.push_back(offsets_.back() + n);
  chunk_ = std::max<int64_t>(1, (total() + world_size - 1) / world_size);
}

int64_t ShardLayout::begin(int r) const {
  return std::min(total(), r * chunk_);
}

int64_t ShardLayout::end(int r) const {
  return std::min(total(), (r + 1) * chunk_);
}

std::vector<ShardLayout::Piece> ShardLayout::Pieces(int64_t begin, int64_t end) const {
  std::vector<Piece> out;
  // The first tensor whose range ends after `begin`.
  size_t i = static_cast<size_t>(std::upper_bound(offsets_.begin(), offsets_.end(), begin) -
                                 offsets_.begin());
  for (i = i == 0 ? 0 : i - 1; i + 1 < offsets_.size() && offsets_[i] < end; ++i) {
    const int64_t lo = std::max(begin, offsets_[i]), hi = std::min(end, offsets_[i + 1]);
    if (lo < hi) out.push_back({i, lo - offsets_[i], lo - begin, hi - lo});
  }
  return out;
}

void ReadFlat(const ShardLayout& layout, const std::vector<at::Tensor>& tensors, int64_t begin,
              int64_t end, at::Tensor out_K) {
  for (const auto& p : layout.Pieces(begin, end)) {
    if (!tensors[p.tensor].defined()) continue;
    out_K.narrow(0, p.offset, p.length)
        .copy_(tensors[p.tensor].reshape(-1).narrow(0, p.tensor_offset, p.length));
  }
}

void WriteFlat(const ShardLayout& layout, const std::vector<at::Tensor>& tensors, int64_t begin,
               int64_t end, const at::Tensor& in_K) {
  for (const auto& p : layout.Pieces(begin, end)) {
    Flat(tensors[p.tensor])
        .narrow(0, p.tensor_offset, p.length)
        .copy_(in_K.narrow(0, p.offset, p.length));
  }
}

OptimizerShard::OptimizerShard(ShardLayout l, const at::TensorOptions& options)
    : layout(std::move(l)),
      grad_sum_C(at::zeros({layout.owned()}, options)),
      exp_avg_C(at::zeros({layout.owned()}, options)),
      exp_avg_sq_C(at::zeros({layout.owned()}, options)) {}

absl::Status OptimizerShard::ReduceScatter(Collectives& c, const std::vector<at::Tensor>& staged,
                                           at::Tensor& out_C) const {
  at::NoGradGuard no_grad;
  const int W = layout.world_size();
  const int64_t C = layout.chunk(), N = layout.total();
  out_C = at::zeros_like(grad_sum_C);
  const int64_t K_max = BucketElements(W, grad_sum_C);
  for (int64_t o = 0; o < C; o += K_max) {
    const int64_t K = std::min(K_max, C - o);
    // Row r: this rank's gradient for elements [r·C + o, r·C + o + K), zero past N.
    at::Tensor in_WK = at::zeros({W, K}, grad_sum_C.options());
    for (int r = 0; r < W; ++r) {
      const int64_t b = r * C + o, e = std::min(b + K, N);
      if (b < e) ReadFlat(layout, staged, b, e, in_WK[r].narrow(0, 0, e - b));
    }
    at::Tensor sum_K = at::empty({K}, grad_sum_C.options());
    RETURN_IF_ERROR(c.ReduceScatterSum(in_WK, sum_K));
    if (o < layout.owned()) {
      const int64_t n = std::min(K, layout.owned() - o);
      out_C.narrow(0, o, n).copy_(sum_K.narrow(0, 0, n));
    }
  }
  return absl::OkStatus();
}

absl::Status OptimizerShard::AllGather(Collectives& c,
                                       const std::vector<at::Tensor>& tensors) const {
  at::NoGradGuard no_grad;
  const int W = layout.world_size();
  const int64_t C = layout.chunk(), N = layout.total();
  // The buffers take the tensors' dtype (a bf16 base is gathered in bf16).
  const auto like =
      std::find_if(tensors.begin(), tensors.end(), [](const at::Tensor& t) { return t.defined(); });
  if (like == tensors.end()) return absl::OkStatus();
  const at::TensorOptions options = like->options();
  const int64_t K_max = BucketElements(W, *like);
  for (int64_t o = 0; o < C; o += K_max) {
    const int64_t K = std::min(K_max, C - o);
    at::Tensor mine_K = at::zeros({K}, options);
    const int64_t b = layout.begin(layout.rank()) + o;
    const int64_t e = std::min(b + K, layout.end(layout.rank()));
    if (b < e) ReadFlat(layout, tensors, b, e, mine_K.narrow(0, 0, e - b));
    at::Tensor all_WK = at::empty({W, K}, options);
    RETURN_IF_ERROR(c.AllGather(mine_K, all_WK));
    for (int r = 0; r < W; ++r) {
      const int64_t rb = r * C + o, re = std::min(rb + K, N);
      if (r != layout.rank() && rb < re)
        WriteFlat(layout, tensors, rb, re, all_WK[r].narrow(0, 0, re - rb));
    }
  }
  return absl::OkStatus();
}

void OptimizerShard::Scatter(const std::vector<at::Tensor>& whole, at::Tensor& flat_C) const {
  at::NoGradGuard no_grad;
  ReadFlat(layout, whole, layout.begin(layout.rank()), layout.end(layout.rank()), flat_C);
}

std::vector<at::Tensor> OptimizerShard::Views(const std::vector<at::Tensor>& tensors) const {
  std::vector<at::Tensor> out;
  for (const auto& p : layout.Pieces(layout.begin(layout.rank()), layout.end(layout.rank()))) {
    out.push_back(Flat(tensors[p.tensor]).narrow(0, p.tensor_offset, p.length));
  }
  return out;
}

std::vector<at::Tensor> OptimizerShard::Cut(const at::Tensor& flat_C) const {
  std::vector<at::Tensor> out;
  for (const auto& p : layout.Pieces(layout.begin(layout.rank()), layout.end(layout.rank()))) {
    out.push_back(flat_C.narrow(0, p.offset, p.length));
  }
  return out;
}

}  // namespace tinkerd
