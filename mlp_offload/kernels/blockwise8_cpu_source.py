"""The C++ source of the CPU one-pass AdamW with 8-bit block-scaled moments (``blockwise8_cpu``
builds it with ``load_inline``): per block of the layout, decode both moments, the fp32 AdamW,
each block's new absmax, encode. Every operation as ``blockwise8``'s torch path rounds it
(built with -ffp-contract=off: no fused multiply-adds; ``std::sqrt`` is the IEEE square root)."""

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

enum Code : int { E4M3 = 0, E5M2 = 1, INT8 = 2, UINT8 = 3 };
constexpr float ROUNDER = 12582912.0f;  // 1.5 * 2^23: (q + R) - R rounds q to an integer, to nearest even

struct Scalars {
  float decay, w1, one_minus_w1, beta2, w2, inv_bc2, eps, neg_step, qmax_m, qmax_v;
};

int code_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat8_e4m3fn: return E4M3;
    case at::kFloat8_e5m2: return E5M2;
    case at::kChar: return INT8;
    case at::kByte: return UINT8;
    default: TORCH_CHECK(false, "8-bit AdamW: unsupported code dtype ", t.scalar_type());
  }
  return E4M3;
}

inline float decode(int code, const void* p, int64_t i) {
  switch (code) {
    case E4M3: return static_cast<float>(static_cast<const c10::Float8_e4m3fn*>(p)[i]);
    case E5M2: return static_cast<float>(static_cast<const c10::Float8_e5m2*>(p)[i]);
    case INT8: return static_cast<float>(static_cast<const int8_t*>(p)[i]);
    default: return static_cast<float>(static_cast<const uint8_t*>(p)[i]);
  }
}

// codes of x[0..n) under scale (blockwise8.encode): clamp the quotient, round to nearest even
void encode(int code, const float* x, int64_t n, float scale, float qmax, void* out, int64_t lo) {
  for (int64_t i = 0; i < n; ++i) {
    float q = scale > 0.0f ? x[i] / scale : 0.0f;
    q = std::min(std::max(q, -qmax), qmax);
    switch (code) {
      case E4M3: static_cast<c10::Float8_e4m3fn*>(out)[lo + i] = c10::Float8_e4m3fn(q); break;
      case E5M2: static_cast<c10::Float8_e5m2*>(out)[lo + i] = c10::Float8_e5m2(q); break;
      case INT8: static_cast<int8_t*>(out)[lo + i] = int8_t((q + ROUNDER) - ROUNDER); break;
      default: static_cast<uint8_t*>(out)[lo + i] = uint8_t((q + ROUNDER) - ROUNDER);
    }
  }
}

}  // namespace

// flags: 1 small lerp weight, 2 weight decay, 4 the second moment's codes hold its root, 8 write param_out
void adamw8(at::Tensor master, at::Tensor grad, at::Tensor mc, at::Tensor ms, at::Tensor vc, at::Tensor vs,
            at::Tensor starts, at::Tensor param_out, std::vector<double> scalars, int64_t flags) {
  const int64_t n = master.numel(), blocks = starts.numel() - 1;
  TORCH_CHECK(master.scalar_type() == at::kFloat && grad.scalar_type() == at::kFloat, "8-bit AdamW: fp32 master and grads");
  TORCH_CHECK(grad.numel() == n && mc.numel() == n && vc.numel() == n, "8-bit AdamW: sizes differ");
  TORCH_CHECK(ms.numel() == blocks && vs.numel() == blocks && ms.scalar_type() == at::kFloat &&
              vs.scalar_type() == at::kFloat, "8-bit AdamW: one fp32 scale per block");
  TORCH_CHECK(starts.scalar_type() == at::kLong && starts[blocks].item<int64_t>() == n, "8-bit AdamW: block starts");
  TORCH_CHECK(master.is_contiguous() && grad.is_contiguous() && mc.is_contiguous() && vc.is_contiguous() &&
              ms.is_contiguous() && vs.is_contiguous() && starts.is_contiguous(), "8-bit AdamW: contiguous tensors");
  TORCH_CHECK(scalars.size() == 10, "8-bit AdamW: 10 scalars");
  const bool small = flags & 1, decay = flags & 2, root = flags & 4, out = flags & 8;
  TORCH_CHECK(!out || (param_out.numel() == n && param_out.is_contiguous()), "8-bit AdamW: param_out");
  Scalars s{float(scalars[0]), float(scalars[1]), float(scalars[2]), float(scalars[3]), float(scalars[4]),
            float(scalars[5]), float(scalars[6]), float(scalars[7]), float(scalars[8]), float(scalars[9])};
  const int cm = code_of(mc), cv = code_of(vc);
  float* P = master.data_ptr<float>();
  const float* G = grad.data_ptr<float>();
  void* MC = mc.data_ptr();
  void* VC = vc.data_ptr();
  float* MS = ms.data_ptr<float>();
  float* VS = vs.data_ptr<float>();
  const int64_t* S = starts.data_ptr<int64_t>();
  int64_t widest = 0;
  for (int64_t b = 0; b < blocks; ++b) widest = std::max(widest, S[b + 1] - S[b]);
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    std::vector<float> scratch(2 * widest);
    float* M = scratch.data();
    float* V = M + widest;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = S[b], len = S[b + 1] - lo;
      const float sm = MS[b], sv = VS[b];
      float amax_m = 0.0f, amax_v = 0.0f;
      for (int64_t k = 0; k < len; ++k) {
        const int64_t i = lo + k;
        float m = decode(cm, MC, i) * sm;
        float v = decode(cv, VC, i) * sv;
        if (root) v = v * v;
        float p = P[i], g = G[i];
        if (decay) p = p * s.decay;
        float d = g - m;
        m = small ? m + d * s.w1 : g - d * s.one_minus_w1;
        v = v * s.beta2 + (g * g) * s.w2;
        float r = std::sqrt(v);
        float denom = r * s.inv_bc2 + s.eps;
        p = p + (m / denom) * s.neg_step;
        P[i] = p;
        M[k] = m;
        V[k] = root ? r : v;
        amax_m = std::max(amax_m, std::fabs(m));
        amax_v = std::max(amax_v, std::fabs(V[k]));
      }
      MS[b] = amax_m / s.qmax_m;
      VS[b] = amax_v / s.qmax_v;
      encode(cm, M, len, MS[b], s.qmax_m, MC, lo);
      encode(cv, V, len, VS[b], s.qmax_v, VC, lo);
    }
  });
  if (out) param_out.copy_(master);
}
"""
