#include "runner/dist/expert_parallel.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <numeric>
#include <stdexcept>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "runner/util/exception_status.h"
#include "runner/util/status_macros.h"

namespace tinkerd {
namespace {

at::Tensor OrThrow(absl::StatusOr<at::Tensor> t) {
  if (!t.ok()) ThrowStatus(t.status());
  return *std::move(t);
}

// The all-to-all as an autograd op: its backward is the all-to-all of the gradients the other way
// (what a rank received, it sends back to where it came from).
struct AllToAllFn : public torch::autograd::Function<AllToAllFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x_ND,
                            Collectives* c, const std::vector<int64_t>& send,
                            const std::vector<int64_t>& recv) {
    ctx->saved_data["c"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(c));
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    at::Tensor out = OrThrow(c->AllToAll(x_ND, send, recv));
    ctx->saved_data["out"] = at::empty({1}, out.options()).expand(out.sizes());  // its shape
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* c = reinterpret_cast<Collectives*>(static_cast<intptr_t>(ctx->saved_data["c"].toInt()));
    const std::vector<int64_t> send = ctx->saved_data["send"].toIntVector();
    const std::vector<int64_t> recv = ctx->saved_data["recv"].toIntVector();
    // Every rank sends back, whether or not its outputs were used.
    const at::Tensor g =
        grads[0].defined() ? grads[0] : at::zeros_like(ctx->saved_data["out"].toTensor());
    return {OrThrow(c->AllToAll(g, recv, send)), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

constexpr absl::string_view kExperts = ".experts.";

// `name` with its expert number replaced by `e` (ExpertOf(name) >= 0).
std::string WithExpert(absl::string_view name, int64_t e) {
  const size_t at = name.find(kExperts) + kExperts.size();
  const size_t end = name.find('.', at);
  return absl::StrCat(name.substr(0, at), e, name.substr(end));
}

}  // namespace

int64_t ExpertParallel::ExpertOf(absl::string_view name) {
  const size_t at = name.find(kExperts);
  if (at == absl::string_view::npos) return -1;
  const size_t begin = at + kExperts.size();
  const size_t end = name.find('.', begin);
  int64_t e = -1;
  if (end == absl::string_view::npos || !absl::SimpleAtoi(name.substr(begin, end - begin), &e)) {
    return -1;
  }
  return e;
}

absl::StatusOr<ExpertParallel::Block> ExpertParallel::BlockOf(int rank, int world, int size,
                                                              int64_t num_experts) {
  if (size < 1 || world % size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--expert_parallel=", size, " must divide the world size ", world, " (WORLD_SIZE)"));
  }
  if (num_experts < 1 || num_experts % size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--expert_parallel=", size,
                                                   " must divide the model's ", num_experts,
                                                   " experts per layer"));
  }
  const int64_t count = num_experts / size;
  return Block{(rank % size) * count, count};
}

absl::StatusOr<std::unique_ptr<ExpertParallel>> ExpertParallel::Create(Collectives& world, int size,
                                                                       int64_t num_experts) {
  const int W = world.world_size();
  ASSIGN_OR_RETURN(const Block held, BlockOf(world.rank(), W, size, num_experts));
  const int r = world.rank(), block = r % size;
  std::vector<int> group(static_cast<size_t>(size));
  std::iota(group.begin(), group.end(), r - block);
  std::vector<int> replicas;
  for (int q = block; q < W; q += size) replicas.push_back(q);
  auto g = world.Subgroup(group);
  if (!g.ok()) return g.status();
  std::shared_ptr<Collectives> same;
  if (replicas.size() > 1) {
    auto s = world.Subgroup(replicas);
    if (!s.ok()) return s.status();
    same = *std::move(s);
  }
  return std::unique_ptr<ExpertParallel>(
      new ExpertParallel(*std::move(g), std::move(same), held.first, held.count));
}

kernels::SlotsFn ExpertParallel::Slots() const {
  return [this](const at::Tensor& x_SD, const std::vector<int64_t>& rows_E,
                const kernels::ExpertFn& expert) {
    return Exchange(x_SD, rows_E, Counts(rows_E, {}), expert);
  };
}

at::Tensor ExpertParallel::Counts(const std::vector<int64_t>& rows_E, const Head& head) const {
  const auto E = static_cast<int64_t>(rows_E.size());
  TORCH_CHECK(E == size() * count_, "expert parallelism: ", E, " experts over ", size(),
              " ranks of ", count_);
  std::vector<int64_t> mine = rows_E;
  if (head.on) mine.insert(mine.end(), {head.op, head.layer, head.key});
  at::Tensor all_GC = at::empty({size(), static_cast<int64_t>(mine.size())}, at::kLong);
  if (auto st = group_->AllGather(at::tensor(mine, at::kLong), all_GC); !st.ok()) ThrowStatus(st);
  return all_GC;
}

at::Tensor ExpertParallel::Exchange(const at::Tensor& x_SD, const std::vector<int64_t>& rows_E,
                                    const at::Tensor& all_GC, const kernels::ExpertFn& expert,
                                    bool led) const {
  const int G = size();
  // Every rank's slots per expert (a row of all_GC each, the head's columns after them), so that
  // each knows what it sends, receives, and from whom.
  const int64_t* all = all_GC.data_ptr<int64_t>();
  const int64_t stride = all_GC.size(1);
  auto rows = [&](int64_t g, int64_t e) { return all[g * stride + e]; };
  std::vector<int64_t> send(G, 0), recv(G, 0);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t j = 0; j < count_; ++j) {
      send[g] += rows_E[g * count_ + j];
      recv[g] += rows(g, first_ + j);
    }
  }
  const at::Tensor x_RD = AllToAllFn::apply(x_SD, group_.get(), send, recv);
  // Received source by source, each source's rows by expert; regrouped expert by expert (sources
  // in rank order within an expert) to run each expert once.
  std::vector<int64_t> by_expert, rows_n(count_, 0);
  std::vector<int64_t> next(G, 0);  // where source g's rows for the next expert begin in x_RD
  for (int64_t g = 1; g < G; ++g) next[g] = next[g - 1] + recv[g - 1];
  for (int64_t j = 0; j < count_; ++j) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t n = rows(g, first_ + j);
      for (int64_t i = 0; i < n; ++i) by_expert.push_back(next[g] + i);
      next[g] += n;
      rows_n[j] += n;
    }
  }
  const auto R = static_cast<int64_t>(by_expert.size());
  const at::Tensor order_R = at::tensor(by_expert, at::kLong).to(x_SD.device());
  const at::Tensor inverse_R = at::empty_like(order_R);
  inverse_R.index_put_({order_R}, at::arange(R, order_R.options()));
  // Under autograd every held expert runs, rows or none: the return exchange's backward is then
  // in every rank's graph whenever the experts train (LoRA on them, or full fine-tuning), whatever
  // the routing sent where; a rank that received nothing would otherwise skip the collective its
  // group waits in.
  auto run = [&] {
    return kernels::RunSlots(
               x_RD.index_select(0, order_R), rows_n,
               [&](int64_t j, const at::Tensor& x_ND) { return expert(first_ + j, x_ND); },
               /*every_expert=*/at::GradMode::is_enabled())
        .index_select(0, inverse_R);
  };
  if (!led) return AllToAllFn::apply(run(), group_.get(), recv, send);
  // A led exchange (sampling) fails without leaving its group behind: the outputs that could
  // not be made go back as zeros, the return exchange completes, and then the error is thrown.
  std::exception_ptr failed;
  at::Tensor y_RD;
  try {
    y_RD = run();
  } catch (...) {
    failed = std::current_exception();
    y_RD = at::zeros({R, x_RD.size(1)}, x_RD.options());
  }
  at::Tensor out = AllToAllFn::apply(y_RD, group_.get(), recv, send);
  if (failed) std::rethrow_exception(failed);
  return out;
}

kernels::SlotsFn ExpertParallel::Leading(int64_t layer, int64_t key) const {
  return [this, layer, key](const at::Tensor& x_SD, const std::vector<int64_t>& rows_E,
                            const kernels::ExpertFn& expert) {
    TORCH_CHECK(group_->rank() == 0, "expert parallelism: only a group's first rank leads");
    return Exchange(x_SD, rows_E, Counts(rows_E, {true, kExchange, layer, key}), expert,
                    /*led=*/true);
  };
}

absl::Status ExpertParallel::EndLead() const {
  try {
    (void)Counts(std::vector<int64_t>(static_cast<size_t>(size() * count_), 0), {true, kEnd, 0, 0});
  } catch (...) {
    return ExceptionStatus("sample", std::current_exception());
  }
  return absl::OkStatus();
}

absl::Status ExpertParallel::Serve(const ServedExperts& experts, const at::TensorOptions& options,
                                   int64_t hidden) const {
  const std::vector<int64_t> none(static_cast<size_t>(size() * count_), 0);
  const at::Tensor nothing_SD = at::empty({0, hidden}, options);
  absl::Status failed;  // the first error here; the rows it touched were answered with zeros
  while (true) {
    try {
      const at::Tensor all_GC = Counts(none, {true, kEnd, 0, 0});
      const int64_t* head = all_GC.data_ptr<int64_t>() + static_cast<int64_t>(none.size());
      if (head[0] == kEnd) return failed;
      absl::StatusOr<kernels::ExpertFn> expert;
      try {
        expert = experts(head[1], head[2]);
      } catch (...) {
        expert = ExceptionStatus("sample: serving experts", std::current_exception());
      }
      if (!expert.ok() && failed.ok()) failed = expert.status();
      // Once something failed here every expert answers zeros, so that the group's exchanges
      // complete; the forward then fails on every rank (ModelRunner::ForwardSpreadExperts).
      (void)Exchange(
          nothing_SD, none, all_GC,
          [&](int64_t e, const at::Tensor& x_ND) {
            return failed.ok() ? (*expert)(e, x_ND) : at::zeros_like(x_ND);
          },
          /*led=*/true);
    } catch (...) {
      // A failed collective leaves the group out of step (UNAVAILABLE); anything else was thrown
      // after the exchange completed.
      absl::Status st = ExceptionStatus("sample: serving experts", std::current_exception());
      if (st.code() == absl::StatusCode::kUnavailable) return st;
      if (failed.ok()) failed = std::move(st);
    }
  }
}

absl::StatusOr<std::map<std::string, at::Tensor>> ExpertParallel::GatherExperts(
    const std::map<std::string, at::Tensor>& kept) const {
  // By name with the expert numbered within its block: the same order on every rank of the group.
  std::map<std::string, const at::Tensor*> by_slot;
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, t] : kept) {
    const int64_t e = ExpertOf(name);
    if (e < 0) {
      out[name] = t;
    } else {
      by_slot[WithExpert(name, e - first_)] = &t;
    }
  }
  const int G = group_->world_size();
  for (const auto& [slot, t] : by_slot) {
    const at::Tensor flat_K = t->detach().contiguous().view(-1);
    at::Tensor all_GK = at::empty({G, flat_K.numel()}, flat_K.options());
    if (auto st = group_->AllGather(flat_K, all_GK); !st.ok()) return st;
    const int64_t j = ExpertOf(slot);
    for (int g = 0; g < G; ++g) {
      out[WithExpert(slot, g * count_ + j)] = all_GK[g].view(t->sizes());
    }
  }
  return out;
}

}  // namespace tinkerd
