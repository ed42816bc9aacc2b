#include "runner/dist/c10d_collectives.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "runner/util/log.h"

namespace tinkerd {
namespace {

// Shape suffix: N elements of one flattened bucket.
class C10dCollectives final : public Collectives {
 public:
  C10dCollectives(const DistConfig& config, C10dOptions options,
                  c10::intrusive_ptr<c10d::Store> store,
                  c10::intrusive_ptr<c10d::ProcessGroupGloo::Options> gloo,
                  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg)
      : config_(config),
        options_(options),
        store_(std::move(store)),
        devices_(gloo->devices),
        pg_(std::move(pg)) {}

  int rank() const override { return config_.rank; }
  int world_size() const override { return config_.world_size; }

  absl::Status AllReduceSumGradients(std::vector<at::Tensor>& grads) override {
    return Guard("gradient all-reduce", [&] {
      const double ws = static_cast<double>(config_.world_size);
      size_t i = 0;
      while (i < grads.size()) {
        // One bucket: consecutive tensors of one dtype up to bucket_bytes, flattened together.
        size_t j = i;
        int64_t bytes = 0;
        std::vector<at::Tensor> members;
        while (j < grads.size() && grads[j].scalar_type() == grads[i].scalar_type() &&
               (members.empty() ||
                bytes + static_cast<int64_t>(grads[j].nbytes()) <= config_.bucket_bytes)) {
          bytes += static_cast<int64_t>(grads[j].nbytes());
          members.push_back(grads[j].reshape(-1));
          ++j;
        }
        at::Tensor bucket_N = at::cat(members).div_(ws);  // DDP's mean: divide, then SUM
        ReduceBucket(bucket_N);
        bucket_N.mul_(ws);  // the multiplication that turns DDP's mean back into our sum
        int64_t offset = 0;
        for (size_t k = i; k < j; ++k) {
          const int64_t n = grads[k].numel();
          grads[k].copy_(bucket_N.narrow(0, offset, n).view(grads[k].sizes()));
          offset += n;
        }
        i = j;
      }
    });
  }

  // Gloo in LibTorch 1.13 has no reduce_scatter: the bucket is all-reduced and this rank keeps its
  // row (twice the traffic of a ring reduce-scatter, and the same as today's all-reduce). NCCL
  // builds reduce-scatter natively.
  absl::Status ReduceScatterSum(const at::Tensor& in_WK, at::Tensor& out_K) override {
    return Guard("reduce-scatter", [&] {
      at::Tensor input_WK = in_WK.contiguous();
#ifdef USE_C10D_NCCL
      if (input_WK.is_cuda() && nccl_) {
        nccl_->_reduce_scatter_base(out_K, input_WK)->wait();
        return;
      }
#endif
      at::Tensor host_WK = input_WK.is_cuda() ? input_WK.cpu() : input_WK.clone();
      std::vector<at::Tensor> io{host_WK};
      pg_->allreduce(io, c10d::AllreduceOptions{})->wait();
      out_K.copy_(host_WK[config_.rank]);
    });
  }

  absl::Status AllGather(const at::Tensor& in_K, at::Tensor& out_WK) override {
    return Guard("all-gather", [&] {
#ifdef USE_C10D_NCCL
      if (in_K.is_cuda() && nccl_) {
        at::Tensor input_K = in_K.contiguous();
        nccl_->_allgather_base(out_WK, input_K)->wait();
        return;
      }
#endif
      std::vector<at::Tensor> input{in_K.to(at::kCPU).contiguous()};
      std::vector<std::vector<at::Tensor>> outputs(1);
      // A host result takes the rows straight into its own rows (Gloo stages a flat copy of its
      // own): one bucket fewer held, and no copy after.
      const bool into = out_WK.device().is_cpu() && out_WK.is_contiguous() &&
                        out_WK.scalar_type() == input[0].scalar_type();
      for (int r = 0; r < config_.world_size; ++r) {
        outputs[0].push_back(into ? out_WK[r] : at::empty_like(input[0]));
      }
      pg_->allgather(outputs, input)->wait();
      if (into) return;
      for (int r = 0; r < config_.world_size; ++r) out_WK[r].copy_(outputs[0][r]);
    });
  }

  absl::Status AllReduceSumCounts(std::vector<int64_t>& counts) override {
    return Guard("count all-reduce", [&] {
      at::Tensor t =
          at::from_blob(counts.data(), {static_cast<int64_t>(counts.size())}, at::kLong).clone();
      std::vector<at::Tensor> io{t};
      pg_->allreduce(io, c10d::AllreduceOptions{})->wait();
      std::memcpy(counts.data(), t.data_ptr<int64_t>(), counts.size() * sizeof(int64_t));
    });
  }

  absl::Status AllReduceSumDoubles(std::vector<double>& values) override {
    return Guard("value all-reduce", [&] {
      at::Tensor t =
          at::from_blob(values.data(), {static_cast<int64_t>(values.size())}, at::kDouble).clone();
      std::vector<at::Tensor> io{t};
      pg_->allreduce(io, c10d::AllreduceOptions{})->wait();
      std::memcpy(values.data(), t.data_ptr<double>(), values.size() * sizeof(double));
    });
  }

  absl::Status AllAgree(bool& ok) override {
    return Guard("agreement", [&] {
      at::Tensor t = at::full({1}, ok ? 1 : 0, at::kLong);
      std::vector<at::Tensor> io{t};
      c10d::AllreduceOptions o;
      o.reduceOp = c10d::ReduceOp::MIN;
      pg_->allreduce(io, o)->wait();
      ok = t.item<int64_t>() == 1;
    });
  }

  absl::StatusOr<std::vector<std::string>> AllGatherBytes(const std::string& mine) override {
    std::vector<std::string> out;
    absl::Status st = Guard("byte all-gather", [&] {
      const int ws = config_.world_size;
      // Gloo gathers equal sizes: share the lengths first, then pad to the longest.
      std::vector<int64_t> lengths(ws, 0);
      lengths[config_.rank] = static_cast<int64_t>(mine.size());
      at::Tensor len = at::from_blob(lengths.data(), {ws}, at::kLong).clone();
      std::vector<at::Tensor> io{len};
      pg_->allreduce(io, c10d::AllreduceOptions{})->wait();
      const int64_t longest = std::max<int64_t>(1, len.max().item<int64_t>());
      at::Tensor buf = at::zeros({longest}, at::kByte);
      std::memcpy(buf.data_ptr(), mine.data(), mine.size());
      std::vector<std::vector<at::Tensor>> outputs(1);
      for (int r = 0; r < ws; ++r) outputs[0].push_back(at::empty({longest}, at::kByte));
      std::vector<at::Tensor> input{buf};
      pg_->allgather(outputs, input)->wait();
      for (int r = 0; r < ws; ++r) {
        out.emplace_back(static_cast<const char*>(outputs[0][r].data_ptr()),
                         static_cast<size_t>(len[r].item<int64_t>()));
      }
    });
    if (!st.ok()) return st;
    return out;
  }

  // Over Gloo, through host memory, reinterpreted as integers of the element's width: Gloo moves
  // them as they are, whatever the dtype (bfloat16 included).
  absl::StatusOr<at::Tensor> AllToAll(const at::Tensor& in_ND,
                                      const std::vector<int64_t>& send_rows,
                                      const std::vector<int64_t>& recv_rows) override {
    at::Tensor out_ND;
    absl::Status st = Guard("all-to-all", [&] {
      const int ws = config_.world_size;
      TORCH_CHECK(
          static_cast<int>(send_rows.size()) == ws && static_cast<int>(recv_rows.size()) == ws,
          "all-to-all: one row count per rank");
      const int64_t received = std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t{0});
      std::vector<int64_t> shape = in_ND.sizes().vec();
      shape[0] = received;
      out_ND = at::empty(shape, in_ND.options());
      const at::ScalarType bits = Bits(in_ND.scalar_type());
      at::Tensor send = in_ND.contiguous().cpu().view(bits);
      at::Tensor recv = at::empty(shape, in_ND.options().device(at::kCPU)).view(bits);
      // Gloo cannot address an empty buffer: a rank with nothing to send or nothing to receive
      // sends itself one extra row, which lands at the end of its own part and is dropped.
      std::vector<int64_t> s = send_rows, r = recv_rows;
      const int me = config_.rank;
      const bool pad = send.size(0) == 0 || received == 0;
      const int64_t at_send = std::accumulate(s.begin(), s.begin() + me + 1, int64_t{0});
      const int64_t at_recv = std::accumulate(r.begin(), r.begin() + me + 1, int64_t{0});
      if (pad) {
        std::vector<int64_t> one_row = shape;
        one_row[0] = 1;
        send = at::cat({send.narrow(0, 0, at_send), at::zeros(one_row, send.options()),
                        send.narrow(0, at_send, send.size(0) - at_send)});
        shape[0] = received + 1;
        recv = at::empty(shape, send.options());
        ++s[me];
        ++r[me];
      }
      pg_->alltoall_base(recv, send, r, s, c10d::AllToAllOptions{})->wait();
      if (pad) {
        recv =
            at::cat({recv.narrow(0, 0, at_recv), recv.narrow(0, at_recv + 1, received - at_recv)});
      }
      if (received > 0) out_ND.copy_(recv.view(in_ND.scalar_type()));
    });
    if (!st.ok()) return st;
    return out_ND;
  }

  absl::StatusOr<std::shared_ptr<Collectives>> Subgroup(const std::vector<int>& ranks) override {
    std::shared_ptr<Collectives> out;
    absl::Status st = Guard("subgroup", [&] {
      const auto me = std::find(ranks.begin(), ranks.end(), config_.rank);
      TORCH_CHECK(me != ranks.end() && std::is_sorted(ranks.begin(), ranks.end()),
                  "subgroup: the ranks must be ascending and include this rank");
      DistConfig config = config_;
      config.rank = static_cast<int>(me - ranks.begin());
      config.world_size = static_cast<int>(ranks.size());
      const int made = made_[ranks]++;
      auto store = c10::make_intrusive<c10d::PrefixStore>(
          absl::StrCat("group[", absl::StrJoin(ranks, ","), "]",
                       made > 0 ? absl::StrCat("#", made) : "", "/"),
          store_);
      auto opts = c10d::ProcessGroupGloo::Options::create(config.timeout);
      opts->devices = devices_;
      auto pg =
          c10::make_intrusive<c10d::ProcessGroupGloo>(store, config.rank, config.world_size, opts);
      out = std::make_shared<C10dCollectives>(config, C10dOptions{}, store, opts, pg);
    });
    if (!st.ok()) return st;
    return out;
  }

  absl::Status BroadcastBytes(std::string& bytes, int root) override {
    return Guard("byte broadcast", [&] {
      at::Tensor n = at::full({1}, static_cast<int64_t>(bytes.size()), at::kLong);
      std::vector<at::Tensor> io{n};
      c10d::BroadcastOptions o;
      o.rootRank = root;
      pg_->broadcast(io, o)->wait();
      const int64_t size = n.item<int64_t>();
      at::Tensor buf = at::empty({std::max<int64_t>(size, 1)}, at::kByte);
      if (config_.rank == root) std::memcpy(buf.data_ptr(), bytes.data(), bytes.size());
      std::vector<at::Tensor> payload{buf};
      pg_->broadcast(payload, o)->wait();
      bytes.assign(static_cast<const char*>(buf.data_ptr()), static_cast<size_t>(size));
    });
  }

 private:
  // A failed or timed-out collective (a rank died or hangs) becomes UNAVAILABLE, never a crash.
  template <typename F>
  absl::Status Guard(const char* what, F&& f) {
    try {
      f();
      return absl::OkStatus();
    } catch (const std::exception& e) {
      return absl::UnavailableError(
          absl::StrCat(what, " failed on rank ", config_.rank, ": ", e.what()));
    }
  }

  // Sums one bucket over ranks in place. CUDA buckets go over NCCL when this build has it;
  // otherwise (and always for CPU buckets) over Gloo, staged through host memory for CUDA.
  void ReduceBucket(at::Tensor& bucket_N) {
#ifdef USE_C10D_NCCL
    if (bucket_N.is_cuda() && nccl_) {
      std::vector<at::Tensor> io{bucket_N};
      nccl_->allreduce(io, c10d::AllreduceOptions{})->wait();
      return;
    }
#endif
    at::Tensor host_N = bucket_N.is_cuda() ? bucket_N.cpu() : bucket_N;
    std::vector<at::Tensor> io{host_N};
    pg_->allreduce(io, c10d::AllreduceOptions{})->wait();
    if (bucket_N.is_cuda()) bucket_N.copy_(host_N);
  }

  // The integer type of a dtype's width, for moving its bits.
  static at::ScalarType Bits(at::ScalarType t) {
    switch (c10::elementSize(t)) {
      case 1:
        return at::kByte;
      case 2:
        return at::kHalf;  // Gloo has no int16; nothing is computed, so any 2-byte type moves bits
      case 4:
        return at::kInt;
      default:
        TORCH_CHECK(c10::elementSize(t) == 8, "all-to-all: unsupported dtype ", t);
        return at::kLong;
    }
  }

  DistConfig config_;
  C10dOptions options_;
  c10::intrusive_ptr<c10d::Store> store_;  // the rendezvous, for subgroups
  std::vector<std::shared_ptr<::gloo::transport::Device>> devices_;  // the interface, likewise
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
  std::map<std::vector<int>, int> made_;  // groups made of each list of ranks so far
#ifdef USE_C10D_NCCL
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> nccl_;  // gradients of CUDA runs; null on CPU runs

 public:
  void set_nccl(c10::intrusive_ptr<c10d::ProcessGroupNCCL> pg) {
    nccl_ = std::move(pg);
  }
#endif
};

}  // namespace

absl::StatusOr<std::shared_ptr<Collectives>> MakeC10dCollectives(const DistConfig& config,
                                                                 C10dOptions options) {
  try {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(config.master_port);
    so.isServer = config.rank == 0;
    so.numWorkers = config.world_size;
    so.waitWorkers = true;
    so.timeout = config.timeout;
    auto store = c10::make_intrusive<c10d::TCPStore>(config.master_addr, so);
    auto opts = c10d::ProcessGroupGloo::Options::create(config.timeout);
    // Loopback for single-host runs; otherwise the interface that reaches the master.
    opts->devices.push_back(config.master_addr == "127.0.0.1" || config.master_addr == "localhost"
                                ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                                : c10d::ProcessGroupGloo::createDefaultDevice());
    auto pg =
        c10::make_intrusive<c10d::ProcessGroupGloo>(store, config.rank, config.world_size, opts);
    auto collectives = std::make_shared<C10dCollectives>(config, options, store, opts, pg);
    if (options.cuda_gradients) {
#ifdef USE_C10D_NCCL
      // NCCL creates its communicator for the device of the first tensor it reduces (this
      // rank's cuda:LOCAL_RANK).
      auto nccl_opts = c10d::ProcessGroupNCCL::Options::create();
      nccl_opts->timeout = config.timeout;
      collectives->set_nccl(c10::make_intrusive<c10d::ProcessGroupNCCL>(
          c10::make_intrusive<c10d::PrefixStore>("nccl/", store), config.rank, config.world_size,
          nccl_opts));
      TLOG_INFO("c10d: gradients over NCCL");
#else
      TLOG_WARN(
          "c10d: this build has no NCCL; CUDA gradients are reduced over Gloo via host memory");
#endif
    }
    TLOG_INFO("c10d: joined {}", config.DebugString());
    return std::shared_ptr<Collectives>(std::move(collectives));
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("c10d rendezvous (", config.DebugString(), "): ", e.what()));
  }
}

}  // namespace tinkerd
