#include "runner/dist/collectives.h"

namespace tinkerd {
namespace {

class LocalCollectives final : public Collectives {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  absl::Status AllReduceSumGradients(std::vector<at::Tensor>&) override { return absl::OkStatus(); }
  absl::Status ReduceScatterSum(const at::Tensor& in_WK, at::Tensor& out_K) override {
    out_K.copy_(in_WK[0]);
    return absl::OkStatus();
  }
  absl::Status AllGather(const at::Tensor& in_K, at::Tensor& out_WK) override {
    out_WK[0].copy_(in_K);
    return absl::OkStatus();
  }
  absl::Status AllReduceSumCounts(std::vector<int64_t>&) override { return absl::OkStatus(); }
  absl::Status AllAgree(bool&) override { return absl::OkStatus(); }
  absl::Status AllReduceSumDoubles(std::vector<double>&) override { return absl::OkStatus(); }
  absl::StatusOr<std::vector<std::string>> AllGatherBytes(const std::string& mine) override {
    return std::vector<std::string>{mine};
  }
  absl::Status BroadcastBytes(std::string&, int) override { return absl::OkStatus(); }
  absl::StatusOr<at::Tensor> AllToAll(const at::Tensor& in_ND, const std::vector<int64_t>&,
                                      const std::vector<int64_t>&) override {
    return in_ND.clone();
  }
  absl::StatusOr<std::shared_ptr<Collectives>> Subgroup(const std::vector<int>&) override {
    return MakeLocalCollectives();
  }
};

}  // namespace

std::shared_ptr<Collectives> MakeLocalCollectives() {
  return std::make_shared<LocalCollectives>();
}

}  // namespace tinkerd
