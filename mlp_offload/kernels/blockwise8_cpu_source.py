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
#include <cstring>
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

// every code's value, by its bits (a table: c10's float8 -> float conversion is branchy bit work per element)
struct Table {
  float v[256];
  explicit Table(int code) {
    for (int b = 0; b < 256; ++b) {
      switch (code) {
        case E4M3: v[b] = static_cast<float>(c10::Float8_e4m3fn(uint8_t(b), c10::Float8_e4m3fn::from_bits())); break;
        case E5M2: v[b] = static_cast<float>(c10::Float8_e5m2(uint8_t(b), c10::Float8_e5m2::from_bits())); break;
        case INT8: v[b] = static_cast<float>(static_cast<int8_t>(uint8_t(b))); break;
        default: v[b] = static_cast<float>(uint8_t(b));
      }
    }
  }
};

template <int CODE>
inline uint8_t encode_one(float q) {  // q already clamped to [-qmax, qmax]
  if constexpr (CODE == E4M3) return c10::Float8_e4m3fn(q).x;
  else if constexpr (CODE == E5M2) return c10::Float8_e5m2(q).x;
  else if constexpr (CODE == INT8) return static_cast<uint8_t>(int8_t((q + ROUNDER) - ROUNDER));
  else return uint8_t((q + ROUNDER) - ROUNDER);
}

// codes of x[0..n) under scale (blockwise8.encode): clamp the quotient, round to nearest even
template <int CODE>
void encode(const float* x, int64_t n, float scale, float qmax, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    float q = scale > 0.0f ? x[i] / scale : 0.0f;
    out[i] = encode_one<CODE>(std::min(std::max(q, -qmax), qmax));
  }
}

void encode_any(int code, const float* x, int64_t n, float scale, float qmax, uint8_t* out) {
  switch (code) {
    case E4M3: encode<E4M3>(x, n, scale, qmax, out); break;
    case E5M2: encode<E5M2>(x, n, scale, qmax, out); break;
    case INT8: encode<INT8>(x, n, scale, qmax, out); break;
    default: encode<UINT8>(x, n, scale, qmax, out);
  }
}

// one block: decode, the fp32 AdamW, the new moments into M and V (V: the root where ROOT), their absmax
// The master's fp32 bits from a bf16 high half and an int16 remainder (remainders.merge), and back
// (remainders.split_: the high half rounded half away from zero in magnitude, the rest as the remainder).
inline float merge_one(uint16_t high, int16_t rem) {
  int32_t bits = (int32_t(int16_t(high)) << 16) + int32_t(rem);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline void split_one(float p, uint16_t& high, int16_t& rem) {
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  const int32_t h = int32_t(uint32_t(bits) + 0x8000u) >> 16;  // arithmetic shift keeps the sign
  high = uint16_t(int16_t(h));
  rem = int16_t(uint32_t(bits) - (uint32_t(h) << 16));
}

// one block: decode, the fp32 AdamW, the new moments into M and V (V: the root where ROOT), their absmax.
// REM: the master is int16 remainders R beside the bf16 bits H (both updated), else fp32 in P.
template <bool ROOT, bool SMALL, bool DECAY, bool REM>
void adam_block(const Scalars& s, const float* tm, const float* tv, const uint8_t* mc, const uint8_t* vc, float sm,
                float sv, float* P, int16_t* R, uint16_t* H, const float* G, int64_t len, float* M, float* V,
                float& amax_m, float& amax_v) {
  float am = 0.0f, av = 0.0f;
  for (int64_t k = 0; k < len; ++k) {
    float m = tm[mc[k]] * sm;
    float v = tv[vc[k]] * sv;
    if (ROOT) v = v * v;
    float p = REM ? merge_one(H[k], R[k]) : P[k];
    float g = G[k];
    if (DECAY) p = p * s.decay;
    float d = g - m;
    m = SMALL ? m + d * s.w1 : g - d * s.one_minus_w1;
    v = v * s.beta2 + (g * g) * s.w2;
    float r = std::sqrt(v);
    float denom = r * s.inv_bc2 + s.eps;
    p = p + (m / denom) * s.neg_step;
    if (REM) split_one(p, H[k], R[k]); else P[k] = p;
    M[k] = m;
    V[k] = ROOT ? r : v;
    am = std::max(am, std::fabs(m));
    av = std::max(av, std::fabs(V[k]));
  }
  amax_m = am;
  amax_v = av;
}

using BlockFn = void (*)(const Scalars&, const float*, const float*, const uint8_t*, const uint8_t*, float, float,
                         float*, int16_t*, uint16_t*, const float*, int64_t, float*, float*, float&, float&);

template <bool REM>
BlockFn block_fn(bool root, bool small, bool decay) {
  static const BlockFn fns[8] = {adam_block<false, false, false, REM>, adam_block<false, false, true, REM>,
                                 adam_block<false, true, false, REM>, adam_block<false, true, true, REM>,
                                 adam_block<true, false, false, REM>, adam_block<true, false, true, REM>,
                                 adam_block<true, true, false, REM>, adam_block<true, true, true, REM>};
  return fns[root * 4 + small * 2 + decay];
}

}  // namespace

// flags: 1 small lerp weight, 2 weight decay, 4 the second moment's codes hold its root, 8 write param_out,
// 16 the master is int16 remainders and param_out the bf16 high halves (both read and written)
void adamw8(at::Tensor master, at::Tensor grad, at::Tensor mc, at::Tensor ms, at::Tensor vc, at::Tensor vs,
            at::Tensor starts, at::Tensor param_out, std::vector<double> scalars, int64_t flags) {
  const int64_t n = master.numel(), blocks = starts.numel() - 1;
  const bool rem = flags & 16;
  TORCH_CHECK((rem ? master.scalar_type() == at::kShort && param_out.scalar_type() == at::kBFloat16 &&
               param_out.numel() == n && param_out.is_contiguous() : master.scalar_type() == at::kFloat) &&
              grad.scalar_type() == at::kFloat, "8-bit AdamW: an fp32 master (or int16 remainders and bf16 params) and fp32 grads");
  TORCH_CHECK(grad.numel() == n && mc.numel() == n && vc.numel() == n, "8-bit AdamW: sizes differ");
  TORCH_CHECK(ms.numel() == blocks && vs.numel() == blocks && ms.scalar_type() == at::kFloat &&
              vs.scalar_type() == at::kFloat, "8-bit AdamW: one fp32 scale per block");
  TORCH_CHECK(starts.scalar_type() == at::kLong && starts[blocks].item<int64_t>() == n, "8-bit AdamW: block starts");
  TORCH_CHECK(master.is_contiguous() && grad.is_contiguous() && mc.is_contiguous() && vc.is_contiguous() &&
              ms.is_contiguous() && vs.is_contiguous() && starts.is_contiguous(), "8-bit AdamW: contiguous tensors");
  TORCH_CHECK(scalars.size() == 10, "8-bit AdamW: 10 scalars");
  const bool small = flags & 1, decay = flags & 2, root = flags & 4, out = (flags & 8) && !rem;
  TORCH_CHECK(!out || (param_out.numel() == n && param_out.is_contiguous()), "8-bit AdamW: param_out");
  Scalars s{float(scalars[0]), float(scalars[1]), float(scalars[2]), float(scalars[3]), float(scalars[4]),
            float(scalars[5]), float(scalars[6]), float(scalars[7]), float(scalars[8]), float(scalars[9])};
  const int cm = code_of(mc), cv = code_of(vc);
  float* P = rem ? nullptr : master.data_ptr<float>();
  int16_t* R = rem ? master.data_ptr<int16_t>() : nullptr;
  uint16_t* H = rem ? reinterpret_cast<uint16_t*>(param_out.data_ptr<at::BFloat16>()) : nullptr;
  const float* G = grad.data_ptr<float>();
  uint8_t* MC = static_cast<uint8_t*>(mc.data_ptr());
  uint8_t* VC = static_cast<uint8_t*>(vc.data_ptr());
  float* MS = ms.data_ptr<float>();
  float* VS = vs.data_ptr<float>();
  const int64_t* S = starts.data_ptr<int64_t>();
  const Table tm(cm), tv(cv);
  const BlockFn adam = rem ? block_fn<true>(root, small, decay) : block_fn<false>(root, small, decay);
  int64_t widest = 0;
  for (int64_t b = 0; b < blocks; ++b) widest = std::max(widest, S[b + 1] - S[b]);
  at::parallel_for(0, blocks, 64, [&](int64_t b0, int64_t b1) {
    std::vector<float> scratch(2 * widest);
    float* M = scratch.data();
    float* V = M + widest;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = S[b], len = S[b + 1] - lo;
      float amax_m, amax_v;
      adam(s, tm.v, tv.v, MC + lo, VC + lo, MS[b], VS[b], rem ? nullptr : P + lo, rem ? R + lo : nullptr,
           rem ? H + lo : nullptr, G + lo, len, M, V, amax_m, amax_v);
      MS[b] = amax_m / s.qmax_m;
      VS[b] = amax_v / s.qmax_v;
      encode_any(cm, M, len, MS[b], s.qmax_m, MC + lo);
      encode_any(cv, V, len, VS[b], s.qmax_v, VC + lo);
    }
  });
  if (out) param_out.copy_(master);
}
"""
