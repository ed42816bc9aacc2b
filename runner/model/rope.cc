#include "runner/model/rope.h"

#include <algorithm>
#include <cmath>

#include "kernels/parallel.h"

namespace tinkerd {

std::vector<double> RopeInvFreq(const ModelConfig& c, int64_t seq_len) {
  const int64_t d = c.head_dim;
  const int64_t R = d / 2;
  const RopeScaling& s = c.rope_scaling;
  double base = c.rope_theta;
  if (s.type == RopeScaling::Type::kDynamic) {
    // Measured against max_position_embeddings, never the config's
    // original_max_position_embeddings: transformers' dynamic NTK reads only the former
    // (tests/reference checks it there). So within the context tinkerd serves (at most
    // max_position_embeddings tokens: runner/validate.cc, runner/sample/sample_types.cc) the
    // frequencies are the plain ones.
    const double orig = static_cast<double>(c.max_position_embeddings);
    if (seq_len > orig) {
      base *= std::pow(s.factor * seq_len / orig - (s.factor - 1.0),
                       static_cast<double>(d) / static_cast<double>(d - 2));
    }
  }
  std::vector<double> inv(R);
  for (int64_t j = 0; j < R; ++j) inv[j] = 1.0 / std::pow(base, 2.0 * j / static_cast<double>(d));

  switch (s.type) {
    case RopeScaling::Type::kNone:
    case RopeScaling::Type::kDynamic:
      break;
    case RopeScaling::Type::kLinear:
      for (double& f : inv) f /= s.factor;
      break;
    case RopeScaling::Type::kLlama3: {
      const double orig = static_cast<double>(s.original_max_position_embeddings);
      const double low_wavelen = orig / s.low_freq_factor;
      const double high_wavelen = orig / s.high_freq_factor;
      for (double& f : inv) {
        const double wavelen = 2.0 * M_PI / f;
        if (wavelen < high_wavelen) continue;  // high frequencies: untouched
        if (wavelen > low_wavelen) {           // low frequencies: fully interpolated
          f /= s.factor;
          continue;
        }
        const double smooth =
            (orig / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        f = (1.0 - smooth) * f / s.factor + smooth * f;
      }
      break;
    }
    case RopeScaling::Type::kYarn: {
      const double orig = static_cast<double>(s.original_max_position_embeddings);
      // Dimension index whose wavelength completes `rotations` turns over the original context.
      auto correction_dim = [&](double rotations) {
        return d * std::log(orig / (rotations * 2.0 * M_PI)) / (2.0 * std::log(c.rope_theta));
      };
      double low = std::max(0.0, std::floor(correction_dim(s.beta_fast)));
      double high = std::min(static_cast<double>(d - 1), std::ceil(correction_dim(s.beta_slow)));
      if (low == high) high += 0.001;  // avoid a zero-width ramp
      for (int64_t j = 0; j < R; ++j) {
        const double ramp = std::clamp((j - low) / (high - low), 0.0, 1.0);
        const double extrapolation_weight = 1.0 - ramp;
        const double extrapolated = inv[j];
        const double interpolated = inv[j] / s.factor;
        inv[j] = interpolated * (1.0 - extrapolation_weight) + extrapolated * extrapolation_weight;
      }
      break;
    }
  }
  return inv;
}

double RopeAttentionFactor(const ModelConfig& c) {
  const RopeScaling& s = c.rope_scaling;
  if (s.type != RopeScaling::Type::kYarn) return 1.0;
  if (s.attention_factor > 0) return s.attention_factor;
  return s.factor <= 1.0 ? 1.0 : 0.1 * std::log(s.factor) + 1.0;
}

RopeTables BuildRopeTables(const ModelConfig& c, const std::vector<int64_t>& cu_seqlens,
                           const at::TensorOptions& to, const std::vector<int64_t>& past) {
  const int64_t T = cu_seqlens.back();
  const int64_t d = c.head_dim;
  const int64_t R = d / 2;
  const double scale = RopeAttentionFactor(c);
  // Computed in double on the host: the tables are small (T·d) and exactness tests run in f64.
  at::Tensor cos_Td = at::empty({T, d}, at::kDouble);
  at::Tensor sin_Td = at::empty({T, d}, at::kDouble);
  double* pc = cos_Td.data_ptr<double>();
  double* ps = sin_Td.data_ptr<double>();
  std::vector<double> inv;
  int64_t inv_len = -1;
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    const int64_t len = cu_seqlens[s + 1] - cu_seqlens[s];
    const int64_t start = past.empty() ? 0 : past[s];
    const int64_t key = c.rope_scaling.type == RopeScaling::Type::kDynamic ? start + len : 0;
    if (key != inv_len) {
      inv = RopeInvFreq(c, start + len);
      inv_len = key;
    }
    for (int64_t p = 0; p < len; ++p) {
      const int64_t row = (cu_seqlens[s] + p) * d;
      for (int64_t j = 0; j < R; ++j) {
        const double angle = static_cast<double>(start + p) * inv[j];
        pc[row + j] = pc[row + j + R] = std::cos(angle) * scale;
        ps[row + j] = ps[row + j + R] = std::sin(angle) * scale;
      }
    }
  }
  return {cos_Td.to(to), sin_Td.to(to)};
}

RopeTables RopeCache::Tables(const std::vector<int64_t>& cu_seqlens,
                             const std::vector<int64_t>& past) {
  if (config_.rope_scaling.type == RopeScaling::Type::kDynamic) {
    return BuildRopeTables(config_, cu_seqlens, to_, past);
  }
  int64_t longest = 0;
  std::vector<int64_t> positions;
  positions.reserve(cu_seqlens.back());
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    const int64_t len = cu_seqlens[s + 1] - cu_seqlens[s];
    const int64_t start = past.empty() ? 0 : past[s];
    longest = std::max(longest, start + len);
    for (int64_t p = start; p < start + len; ++p) positions.push_back(p);
  }
  RopeTables rows;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t have = rows_.cos_Td.defined() ? rows_.cos_Td.size(0) : 0;
    if (longest > have) {
      const int64_t want = std::max<int64_t>(longest, 2 * have);
      rows_ = BuildRopeTables(config_, {0, want}, to_);
    }
    rows = rows_;
  }
  const at::Tensor index =
      at::from_blob(positions.data(), {static_cast<int64_t>(positions.size())}, at::kLong)
          .to(to_.device(), at::kLong, /*non_blocking=*/false, /*copy=*/true);
  return {rows.cos_Td.index_select(0, index), rows.sin_Td.index_select(0, index)};
}

namespace {

// x·cos + rotate_half(x)·sin for rotate_half(x) = (−x₂, x₁), rounded as the ATen expression in
// ApplyRope rounds it (each product, then their sum: never one FMA), so the two are bitwise equal.
template <typename T>
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
void RopeRows(const T* x, const T* cos, const T* sin, T* out, int64_t rows, int64_t H, int64_t d) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  const int64_t R = d / 2;
  for (int64_t t = 0; t < rows; ++t) {
    const T* c = cos + t * d;
    const T* s = sin + t * d;
    for (int64_t h = 0; h < H; ++h) {
      const T* xr = x + (t * H + h) * d;
      T* o = out + (t * H + h) * d;
      for (int64_t j = 0; j < R; ++j) o[j] = xr[j] * c[j] + (-xr[j + R]) * s[j];
      for (int64_t j = 0; j < R; ++j) o[j + R] = xr[j + R] * c[j + R] + xr[j] * s[j + R];
    }
  }
}

// Outside autograd, on the host, in float or double: one pass, where the ATen expression makes five
// tensors (a decode step's RoPE on the batch's queries and keys was a tenth of its serial time).
bool OnePass(const at::Tensor& x_THd, const RopeTables& tables) {
  const at::ScalarType dt = x_THd.scalar_type();
  for (const at::Tensor* t : {&x_THd, &tables.cos_Td, &tables.sin_Td}) {
    if (t->requires_grad() || !t->is_cpu() || t->scalar_type() != dt) return false;
  }
  return (dt == at::kFloat || dt == at::kDouble) && x_THd.dim() == 3 && x_THd.size(2) % 2 == 0 &&
         tables.cos_Td.sizes() == at::IntArrayRef{x_THd.size(0), x_THd.size(2)} &&
         tables.sin_Td.sizes() == tables.cos_Td.sizes();
}

}  // namespace

at::Tensor ApplyRope(const at::Tensor& x_THd, const RopeTables& tables) {
  if (OnePass(x_THd, tables)) {
    const at::Tensor x = x_THd.contiguous(), c = tables.cos_Td.contiguous();
    const at::Tensor s = tables.sin_Td.contiguous();
    at::Tensor out = at::empty_like(x);
    const int64_t T = x.size(0), H = x.size(1), d = x.size(2);
    // Rows of at least 16 Ki elements per task: a decode step's queries split across threads.
    kernels::ParallelFor(
        0, T, std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(H * d, 1)),
        [&](int64_t t0, int64_t t1) {
          const int64_t offset = t0 * H * d, rows = t1 - t0;
          if (x.scalar_type() == at::kFloat) {
            RopeRows(x.data_ptr<float>() + offset, c.data_ptr<float>() + t0 * d,
                     s.data_ptr<float>() + t0 * d, out.data_ptr<float>() + offset, rows, H, d);
          } else {
            RopeRows(x.data_ptr<double>() + offset, c.data_ptr<double>() + t0 * d,
                     s.data_ptr<double>() + t0 * d, out.data_ptr<double>() + offset, rows, H, d);
          }
        });
    return out;
  }
  const int64_t R = x_THd.size(2) / 2;
  at::Tensor x1 = x_THd.narrow(2, 0, R);
  at::Tensor x2 = x_THd.narrow(2, R, R);
  at::Tensor rotated = at::cat({-x2, x1}, 2);
  return x_THd * tables.cos_Td.unsqueeze(1) + rotated * tables.sin_Td.unsqueeze(1);
}

}  // namespace tinkerd
