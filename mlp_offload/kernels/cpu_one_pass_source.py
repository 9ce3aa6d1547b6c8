"""The C++ source of the CPU one-pass AdamW (``cpu_one_pass`` builds it with ``load_inline``): per
block of elements (``BLOCK``, filled in there), merge the master, AdamW in the chosen rounding variant, split back."""

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t BLOCK = %(block)d;
enum Kind : int { F32 = 0, BF16 = 1, F16 = 2, REM16 = 3 };

struct Scalars {
  float decay, w1, one_minus_w1, beta2, w2, div, eps, neg_step;
};

inline float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// fp32 -> bf16 round to nearest even, as c10::BFloat16 (Tensor.copy_) does; NaN -> 0x7fc0
inline uint16_t to_bf16(float f) {
  uint32_t u = to_bits(f);
  uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return f != f ? uint16_t(0x7fc0) : uint16_t(r);
}

template <int K> void widen(const void* src, const uint16_t* high, float* dst, int64_t n) {
  if constexpr (K == BF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = from_bits(uint32_t(s[i]) << 16);
  } else if constexpr (K == F16) {
    const c10::Half* s = static_cast<const c10::Half*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
  } else if constexpr (K == REM16) {  // remainders.merge: (high half << 16) + remainder, int32 wrapping
    const int16_t* s = static_cast<const int16_t*>(src);
    for (int64_t i = 0; i < n; ++i)
      dst[i] = from_bits((uint32_t(int32_t(int16_t(high[i]))) << 16) + uint32_t(int32_t(s[i])));
  }
}

template <int K> void narrow(const float* src, void* dst, uint16_t* high, int64_t n) {
  if constexpr (K == BF16) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = to_bf16(src[i]);
  } else if constexpr (K == F16) {
    c10::Half* d = static_cast<c10::Half*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = c10::Half(src[i]);
  } else if constexpr (K == REM16) {  // remainders.split_: high half rounded half away, low half kept
    int16_t* d = static_cast<int16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) {
      uint32_t u = to_bits(src[i]);
      high[i] = uint16_t((u + 0x8000u) >> 16);
      d[i] = int16_t(uint16_t(u));
    }
  }
}

// decoupled weight decay (decay is 1 without it: x * 1 is x), lerp, the second moment
template <bool SMALL, bool FMA_LERP, bool FMA_ADDCMUL, bool TORCH_ORDER>
void first_half(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v,
                int64_t n, Scalars s) {
  for (int64_t i = 0; i < n; ++i) {
    float gi = g[i], mi = m[i];
    p[i] = p[i] * s.decay;
    float d = gi - mi;
    if constexpr (SMALL) mi = FMA_LERP ? std::fma(s.w1, d, mi) : mi + s.w1 * d;
    else mi = FMA_LERP ? std::fma(-d, s.one_minus_w1, gi) : gi - d * s.one_minus_w1;
    m[i] = mi;
    float vi = v[i] * s.beta2;
    if constexpr (TORCH_ORDER) {
      float wg = s.w2 * gi;
      vi = FMA_ADDCMUL ? std::fma(wg, gi, vi) : vi + wg * gi;
    } else {
      float gg = gi * gi;
      vi = FMA_ADDCMUL ? std::fma(s.w2, gg, vi) : vi + s.w2 * gg;
    }
    v[i] = vi;
  }
}

// denominator and the parameter step; root: torch's sqrt of v, or nullptr for std::sqrt
template <bool INLINE_SQRT, bool RECIPROCAL, bool FMA_ADDCDIV, bool TORCH_ORDER>
void second_half(float* __restrict p, const float* __restrict m, const float* __restrict v,
                 const float* __restrict root, int64_t n, Scalars s) {
  for (int64_t i = 0; i < n; ++i) {
    float r = INLINE_SQRT ? std::sqrt(v[i]) : root[i];
    r = RECIPROCAL ? r * s.div : r / s.div;
    float denom = r + s.eps;
    float pi = p[i];
    if constexpr (TORCH_ORDER) {
      pi = pi + (s.neg_step * m[i]) / denom;
    } else {
      float q = m[i] / denom;
      pi = FMA_ADDCDIV ? std::fma(s.neg_step, q, pi) : pi + s.neg_step * q;
    }
    p[i] = pi;
  }
}

using FirstFn = void (*)(float*, const float*, float*, float*, int64_t, Scalars);
using SecondFn = void (*)(float*, const float*, const float*, const float*, int64_t, Scalars);
using WidenFn = void (*)(const void*, const uint16_t*, float*, int64_t);
using NarrowFn = void (*)(const float*, void*, uint16_t*, int64_t);

template <int B> FirstFn first_for(int bits) {
  if constexpr (B == 16) { return nullptr; } else {
    if (bits == B)
      return first_half<bool(B & 1), bool(B & 2), bool(B & 4), bool(B & 8)>;
    return first_for<B + 1>(bits);
  }
}
template <int B> SecondFn second_for(int bits) {
  if constexpr (B == 16) { return nullptr; } else {
    if (bits == B)
      return second_half<bool(B & 1), bool(B & 2), bool(B & 4), bool(B & 8)>;
    return second_for<B + 1>(bits);
  }
}
WidenFn widen_for(int kind) {
  switch (kind) { case BF16: return widen<BF16>; case F16: return widen<F16>; case REM16: return widen<REM16>; }
  return nullptr;
}
NarrowFn narrow_for(int kind) {
  switch (kind) { case BF16: return narrow<BF16>; case F16: return narrow<F16>; case REM16: return narrow<REM16>; }
  return nullptr;
}

int kind_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return F32;
    case at::kBFloat16: return BF16;
    case at::kHalf: return F16;
    case at::kShort: return REM16;
    default: TORCH_CHECK(false, "cpu one-pass AdamW: unsupported stored dtype ", t.scalar_type());
  }
  return F32;
}

}  // namespace

// flags: 1 small lerp weight, 2 fma lerp, 4 fma addcmul, 8 fma addcdiv, 16 reciprocal division,
// 32 torch's operand order, 64 torch's sqrt
void adamw(at::Tensor p, at::Tensor high, at::Tensor g, at::Tensor m, at::Tensor v, std::vector<double> scalars,
           int64_t flags) {
  const int64_t n = p.numel();
  TORCH_CHECK(g.numel() == n && m.numel() == n && v.numel() == n, "cpu one-pass AdamW: sizes differ");
  TORCH_CHECK(g.scalar_type() == at::kFloat, "cpu one-pass AdamW: gradients must be fp32");
  TORCH_CHECK(p.is_contiguous() && g.is_contiguous() && m.is_contiguous() && v.is_contiguous(),
              "cpu one-pass AdamW: tensors must be contiguous");
  TORCH_CHECK(scalars.size() == 8, "cpu one-pass AdamW: 8 scalars");
  if (n == 0) return;
  const int kp = kind_of(p), km = kind_of(m), kv = kind_of(v);
  TORCH_CHECK(km != REM16 && kv != REM16, "cpu one-pass AdamW: int16 moments");
  uint16_t* hp = nullptr;
  if (kp == REM16) {
    TORCH_CHECK(high.numel() == n && high.scalar_type() == at::kBFloat16 && high.is_contiguous(),
                "cpu one-pass AdamW: remainders need their bf16 high halves");
    hp = reinterpret_cast<uint16_t*>(high.data_ptr());
  }
  Scalars s{float(scalars[0]), float(scalars[1]), float(scalars[2]), float(scalars[3]), float(scalars[4]),
            float(scalars[5]), float(scalars[6]), float(scalars[7])};
  const bool torch_order = flags & 32, torch_sqrt = flags & 64;
  FirstFn first = first_for<0>(int((flags & 1) | (flags & 2) | (flags & 4) | (torch_order ? 8 : 0)));
  SecondFn second = second_for<0>(int((torch_sqrt ? 0 : 1) | ((flags & 16) ? 2 : 0) | ((flags & 8) ? 4 : 0) |
                                      (torch_order ? 8 : 0)));
  char* pp = static_cast<char*>(p.data_ptr());
  char* mp = static_cast<char*>(m.data_ptr());
  char* vp = static_cast<char*>(v.data_ptr());
  const float* gp = g.data_ptr<float>();
  const int64_t ps = p.element_size(), ms = m.element_size(), vs = v.element_size();
  WidenFn wp = widen_for(kp), wm = widen_for(km), wv = widen_for(kv);
  NarrowFn np_ = narrow_for(kp), nm = narrow_for(km), nv = narrow_for(kv);
  const int64_t blocks = (n + BLOCK - 1) / BLOCK;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> scratch(4 * BLOCK);
    float* bufp = scratch.data();
    float* bufm = bufp + BLOCK;
    float* bufv = bufm + BLOCK;
    float* bufr = bufv + BLOCK;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * BLOCK, len = std::min(BLOCK, n - lo);
      uint16_t* hb = hp ? hp + lo : nullptr;
      float* P = kp == F32 ? reinterpret_cast<float*>(pp) + lo : bufp;
      float* M = km == F32 ? reinterpret_cast<float*>(mp) + lo : bufm;
      float* V = kv == F32 ? reinterpret_cast<float*>(vp) + lo : bufv;
      if (wp) wp(pp + lo * ps, hb, P, len);
      if (wm) wm(mp + lo * ms, nullptr, M, len);
      if (wv) wv(vp + lo * vs, nullptr, V, len);
      first(P, gp + lo, M, V, len, s);
      if (torch_sqrt) {  // torch's own elementwise sqrt of this block (not correctly rounded everywhere)
        auto opts = at::TensorOptions().dtype(at::kFloat);
        at::Tensor out = at::from_blob(bufr, {len}, opts);
        at::sqrt_out(out, at::from_blob(V, {len}, opts));
      }
      second(P, M, V, bufr, len, s);
      if (np_) np_(P, pp + lo * ps, hb, len);
      if (nm) nm(M, mp + lo * ms, nullptr, len);
      if (nv) nv(V, vp + lo * vs, nullptr, len);
    }
  });
}
"""
