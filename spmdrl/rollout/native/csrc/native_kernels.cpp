// CPU kernels for the native rollout engine's decode step (see kernels.py for why and when).
//
//   rms_norm          x [N, h] -> [N, h]: two passes per row instead of ~8 ATen kernels.
//   decode_attention  per (row, kv head): q/k-norm, RoPE, K/V write at column `col`, scores, softmax,
//                     weighted V -- the ~12 ATen ops of an attention block's middle in one loop.
//   sample            per row: softmax(logits / T), the inverse-CDF draw of a given uniform and its
//                     log-prob (or the argmax) -- the ~15 ops of sampling.py's untruncated path.
//
// Numerics follow the Python path (model.py), which follows transformers: statistics and
// softmax in fp32, activations rounded to the model dtype where transformers rounds them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

using at::vec::Vectorized;
using fVec = Vectorized<float>;
constexpr int64_t kVec = fVec::size();

// kVec elements of T as one float vector (at::vec::convert has no vectorized bf16 -> float).
template <typename T>
inline fVec load_f(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return fVec::loadu(p);
  } else {
    fVec v;
    at::vec::load_to_float(p, v);
    return v;
  }
}

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  int64_t d = 0;
  for (; d + kVec <= n; d += kVec) load_f(src + d).store(dst + d);
  for (; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

template <typename T>
inline void from_float(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::copy(src, src + n, dst);
  } else {
    at::vec::convert(src, dst, n);
  }
}

// Round float values to T and back, in place: what storing an activation in T does.
template <typename T>
inline void round_to(float* x, T* tmp, int64_t n) {
  if constexpr (!std::is_same_v<T, float>) {
    from_float(x, tmp, n);
    to_float(tmp, x, n);
  }
}

// Call f with a value of the C++ type of `dtype` (float32 or bfloat16, the dtypes the engine serves).
template <typename F>
void for_dtype(at::ScalarType dtype, const char* op, F&& f) {
  if (dtype == at::kFloat) {
    f(float{});
  } else if (dtype == at::kBFloat16) {
    f(at::BFloat16{});
  } else {
    TORCH_CHECK(false, op, ": dtype ", dtype, " is not supported (float32 or bfloat16)");
  }
}

// Sum of squares of n values of T, accumulated in fp32.
template <typename T>
inline float sum_sq(const T* x, int64_t n) {
  fVec acc(0.f);
  int64_t d = 0;
  for (; d + kVec <= n; d += kVec) {
    const fVec v = load_f(x + d);
    acc = at::vec::fmadd(v, v, acc);
  }
  float s = at::vec::vec_reduce_all<float>([](fVec a, fVec b) { return a + b; }, acc);
  for (; d < n; ++d) s += static_cast<float>(x[d]) * static_cast<float>(x[d]);
  return s;
}

// transformers' RMSNorm on one row held in fp32: x * rsqrt(mean(x^2) + eps), rounded to T, times w, rounded.
template <typename T>
inline void rms_row(float* x, const float* w, T* tmp, int64_t n, float eps) {
  const float r = 1.f / std::sqrt(sum_sq(x, n) / n + eps);
  for (int64_t d = 0; d < n; ++d) x[d] *= r;
  round_to(x, tmp, n);
  for (int64_t d = 0; d < n; ++d) x[d] *= w[d];
  round_to(x, tmp, n);
}

// rms_row for a whole hidden row read from and written to T, in two passes (statistics, then
// scale-round-weight-round per vector) instead of rms_row's eight.
template <typename T>
void rms_norm_row(const T* x, const float* w, T* out, int64_t h, float eps) {
  const float r = 1.f / std::sqrt(sum_sq(x, h) / h + eps);
  const fVec vr(r);
  int64_t d = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; d + kVec <= h; d += kVec) (fVec::loadu(x + d) * vr * fVec::loadu(w + d)).store(out + d);
  } else {
    using bVec = Vectorized<T>;
    for (; d + 2 * kVec <= h; d += 2 * kVec) {
      auto [a, b] = at::vec::convert_to_float<T>(bVec::loadu(x + d));
      auto [ra, rb] = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(a * vr, b * vr));
      at::vec::convert_from_float<T>(ra * fVec::loadu(w + d), rb * fVec::loadu(w + d + kVec)).store(out + d);
    }
  }
  for (; d < h; ++d) out[d] = static_cast<T>(static_cast<float>(static_cast<T>(static_cast<float>(x[d]) * r)) * w[d]);
}

template <typename T>
void rms_norm_impl(const T* x, const T* w, T* out, int64_t rows, int64_t h, float eps) {
  std::vector<float> wf(h);
  to_float(w, wf.data(), h);
  const int64_t grain = std::max<int64_t>(1, 32768 / h);  // threads only pay off past ~32k elements
  at::parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) rms_norm_row(x + r * h, wf.data(), out + r * h, h, eps);
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "rms_norm: x and weight dtypes differ");
  const int64_t h = w.numel();
  TORCH_CHECK(x.size(-1) == h, "rms_norm: last dim ", x.size(-1), " != weight size ", h);
  auto xc = x.contiguous();
  auto out = at::empty_like(xc);
  for_dtype(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_impl<T>(xc.const_data_ptr<T>(), w.contiguous().const_data_ptr<T>(), out.mutable_data_ptr<T>(),
                     xc.numel() / h, h, (float)eps);
  });
  return out;
}

// One head's q or k from the fused qkv row: optional q/k-norm, then RoPE with the signed-sin table
// (rope(x) = x*cos + roll(x, D/2)*sin), rounded to T as the Python path stores it.
template <typename T>
inline void rope_head(const T* src, const float* norm_w, const float* cs, const float* sn, float* out,
                      float* x, T* tmp, int64_t D, float eps) {
  to_float(src, x, D);
  if (norm_w) rms_row(x, norm_w, tmp, D, eps);
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) out[d] = x[d] * cs[d] + x[d < half ? d + half : d - half] * sn[d];
  round_to(out, tmp, D);
}

// One KV head's attention for its G query heads, with the head's vectors held in registers
// (NV = head_dim / kVec is a compile-time constant): q [G, D] fp32 already scaled, K/V rows
// [n, D] of T, bias [n] (-inf on padding) -> o [G, D] fp32. p is [G, n] scratch.
template <typename T, int NV>
void attend(const float* q, const T* kb, const T* vb, const float* bias, int64_t n, int64_t G, float* p,
            float* o) {
  constexpr int64_t D = NV * kVec;
  const auto add = [](fVec u, fVec v) { return u + v; };
  for (int64_t g = 0; g < G; ++g) {
    fVec qv[NV];
    for (int i = 0; i < NV; ++i) qv[i] = fVec::loadu(q + g * D + i * kVec);
    float* pg = p + g * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t s = 0; s < n; ++s) {
      const T* ks = kb + s * D;
      fVec a = qv[0] * load_f(ks);
      for (int i = 1; i < NV; ++i) a = at::vec::fmadd(qv[i], load_f(ks + i * kVec), a);
      pg[s] = at::vec::vec_reduce_all<float>(add, a) + bias[s];
      mx = std::max(mx, pg[s]);
    }
    // Softmax in fp32; exp_u20 maps -inf (padding) to exactly 0.
    fVec vmx(mx), vsum(0.f);
    int64_t s = 0;
    for (; s + kVec <= n; s += kVec) {
      fVec e = (fVec::loadu(pg + s) - vmx).exp_u20();
      e.store(pg + s);
      vsum = vsum + e;
    }
    float sum = at::vec::vec_reduce_all<float>(add, vsum);
    for (; s < n; ++s) {
      pg[s] = std::exp(pg[s] - mx);
      sum += pg[s];
    }
    fVec acc[NV];
    for (int i = 0; i < NV; ++i) acc[i] = fVec(0.f);
    for (int64_t s = 0; s < n; ++s) {
      const fVec pv(pg[s]);
      const T* vs = vb + s * D;
      for (int i = 0; i < NV; ++i) acc[i] = at::vec::fmadd(pv, load_f(vs + i * kVec), acc[i]);
    }
    const fVec inv(1.f / sum);
    for (int i = 0; i < NV; ++i) (acc[i] * inv).store(o + g * D + i * kVec);
  }
}

template <typename T>
void attend_dispatch(const float* q, const T* kb, const T* vb, const float* bias, int64_t n, int64_t G, int64_t D,
                     float* p, float* o) {
  switch (D / kVec) {
    case 2: return attend<T, 2>(q, kb, vb, bias, n, G, p, o);
    case 4: return attend<T, 4>(q, kb, vb, bias, n, G, p, o);
    case 8: return attend<T, 8>(q, kb, vb, bias, n, G, p, o);
    case 16: return attend<T, 16>(q, kb, vb, bias, n, G, p, o);
    case 32: return attend<T, 32>(q, kb, vb, bias, n, G, p, o);
  }
  TORCH_CHECK(false, "decode_attention: head_dim ", D, " is not 2, 4, 8, 16 or 32 vectors of ", kVec);
}

template <typename T>
void decode_attention_impl(const T* qkv, int64_t qkv_stride, const float* qn, const float* kn, float eps,
                           const T* cos, const T* sin, const int64_t* pos, T* kc, T* vc,
                           const float* bias, int64_t bias_stride, T* out, int64_t B, int64_t H, int64_t K,
                           int64_t S, int64_t D, int64_t col, float scale) {
  const int64_t G = H / K, n = col + 1;  // columns past `col` are never attended in decode
  at::parallel_for(0, B * K, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> q(G * D), x(D), kf(D), cs(D), sn(D), acc(G * D), p(G * n);
    std::vector<T> tmp(D);
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t b = t / K, kh = t % K;
      const T* row = qkv + b * qkv_stride;
      to_float(cos + pos[b] * D, cs.data(), D);
      to_float(sin + pos[b] * D, sn.data(), D);
      // This step's K and V into the cache at `col`.
      T* kcol = kc + (t * S + col) * D;
      rope_head(row + (H + kh) * D, kn, cs.data(), sn.data(), kf.data(), x.data(), tmp.data(), D, eps);
      from_float(kf.data(), kcol, D);
      std::copy(row + (H + K + kh) * D, row + (H + K + kh + 1) * D, vc + (t * S + col) * D);
      for (int64_t g = 0; g < G; ++g) {
        float* qg = q.data() + g * D;
        rope_head(row + (kh * G + g) * D, qn, cs.data(), sn.data(), qg, x.data(), tmp.data(), D, eps);
        for (int64_t d = 0; d < D; ++d) qg[d] *= scale;
      }
      attend_dispatch<T>(q.data(), kc + t * S * D, vc + t * S * D, bias + b * bias_stride, n, G, D, p.data(),
                         acc.data());
      for (int64_t g = 0; g < G; ++g) from_float(acc.data() + g * D, out + b * H * D + (kh * G + g) * D, D);
    }
  });
}

at::Tensor decode_attention(const at::Tensor& qkv, const std::optional<at::Tensor>& q_norm,
                            const std::optional<at::Tensor>& k_norm, double eps, const at::Tensor& cos,
                            const at::Tensor& sin, const at::Tensor& pos, at::Tensor& k_cache, at::Tensor& v_cache,
                            const at::Tensor& bias, int64_t col, int64_t num_heads, double scale) {
  // qkv [B, (H+2K)*D]; k_cache, v_cache [B, K, S, D] contiguous; bias [B, >=S] fp32; cos/sin [>pos, D].
  const int64_t B = k_cache.size(0), K = k_cache.size(1), S = k_cache.size(2), D = k_cache.size(3);
  const int64_t H = num_heads;
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "decode_attention: cache not contiguous");
  TORCH_CHECK(qkv.size(0) >= B && qkv.size(1) == (H + 2 * K) * D && qkv.stride(1) == 1, "decode_attention: qkv shape");
  TORCH_CHECK(D % kVec == 0 && H % K == 0 && col < S, "decode_attention: head_dim / heads / col");
  TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.stride(1) == 1, "decode_attention: bias must be fp32 rows");
  auto out = at::empty({B, H * D}, qkv.options());
  auto posc = pos.contiguous();
  auto cosc = cos.contiguous(), sinc = sin.contiguous();
  std::vector<float> qn, kn;
  if (q_norm) { qn.resize(D); kn.resize(D); }
  for_dtype(qkv.scalar_type(), "decode_attention", [&](auto tag) {
    using T = decltype(tag);
    if (q_norm) {
      to_float(q_norm->contiguous().const_data_ptr<T>(), qn.data(), D);
      to_float(k_norm->contiguous().const_data_ptr<T>(), kn.data(), D);
    }
    decode_attention_impl<T>(qkv.const_data_ptr<T>(), qkv.stride(0), q_norm ? qn.data() : nullptr,
        q_norm ? kn.data() : nullptr, (float)eps, cosc.const_data_ptr<T>(), sinc.const_data_ptr<T>(),
        posc.const_data_ptr<int64_t>(), k_cache.mutable_data_ptr<T>(), v_cache.mutable_data_ptr<T>(),
        bias.const_data_ptr<float>(), bias.stride(0), out.mutable_data_ptr<T>(), B, H, K, S, D, col, (float)scale);
  });
  return out;
}

// Sampling from full-vocabulary softmax(logits / temperature) (no top-k / top-p), per row:
// the token at the inverse CDF of uniform u, and its log-prob. temperature 0: argmax.
// Same convention as sampling.py; the exps are kept in scratch, with sums per block of 64, so the
// CDF walk reads block sums first and one block after.
void sample_row(const float* x, int64_t V, float temperature, float u, float* e, float* blocks,
                int64_t* token, float* logprob) {
  constexpr int64_t kBlock = 64;
  const bool greedy = temperature == 0.f;
  const float inv_t = greedy ? 1.f : 1.f / temperature;
  float mx = -std::numeric_limits<float>::infinity();
  int64_t arg = 0;
  for (int64_t v = 0; v < V; ++v) {
    if (x[v] > mx) { mx = x[v]; arg = v; }  // first maximum, as torch.argmax
  }
  const fVec vmx(mx * inv_t), vt(inv_t);
  float z = 0.f;
  const int64_t nb = (V + kBlock - 1) / kBlock;
  for (int64_t blk = 0; blk < nb; ++blk) {
    const int64_t lo = blk * kBlock, hi = std::min(V, lo + kBlock);
    float bs = 0.f;
    int64_t v = lo;
    if (hi - lo == kBlock) {
      fVec acc(0.f);
      for (; v + kVec <= hi; v += kVec) {
        fVec ev = at::vec::fmsub(fVec::loadu(x + v), vt, vmx).exp_u20();
        ev.store(e + v);
        acc = acc + ev;
      }
      bs = at::vec::vec_reduce_all<float>([](fVec a, fVec b) { return a + b; }, acc);
    }
    for (; v < hi; ++v) {
      e[v] = std::exp(x[v] * inv_t - mx * inv_t);
      bs += e[v];
    }
    blocks[blk] = bs;
    z += bs;
  }
  int64_t tok = arg;
  if (!greedy) {
    float target = u * z, cum = 0.f;
    int64_t blk = 0;
    while (blk < nb - 1 && cum + blocks[blk] <= target) cum += blocks[blk++];
    const int64_t lo = blk * kBlock, hi = std::min(V, lo + kBlock);
    tok = -1;
    for (int64_t v = lo; v < hi; ++v) {
      if (e[v] > 0.f) tok = v;  // rounding can leave target past the block's sum: last nonzero entry
      cum += e[v];
      if (cum > target && e[v] > 0.f) break;
    }
    if (tok < 0) tok = arg;  // an empty block (all underflowed): the argmax is always a valid draw
  }
  *token = tok;
  *logprob = x[tok] * inv_t - mx * inv_t - std::log(z);
}

std::tuple<at::Tensor, at::Tensor> sample(const at::Tensor& logits, const at::Tensor& uniform, double temperature) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "sample: logits must be [B, V] float32");
  auto x = logits.contiguous();
  const int64_t B = x.size(0), V = x.size(1);
  TORCH_CHECK(temperature == 0 || (uniform.numel() == B && uniform.scalar_type() == at::kFloat),
              "sample: uniform must be [B] float32");
  auto u = uniform.contiguous();
  auto tokens = at::empty({B}, x.options().dtype(at::kLong));
  auto logprobs = at::empty({B}, x.options());
  const float* xp = x.const_data_ptr<float>();
  const float* up = temperature == 0 ? nullptr : u.const_data_ptr<float>();
  int64_t* tp = tokens.mutable_data_ptr<int64_t>();
  float* lp = logprobs.mutable_data_ptr<float>();
  at::parallel_for(0, B, std::max<int64_t>(1, 32768 / V), [&](int64_t lo, int64_t hi) {
    std::vector<float> e(V), blocks(V / 64 + 1);
    for (int64_t b = lo; b < hi; ++b)
      sample_row(xp + b * V, V, (float)temperature, up ? up[b] : 0.f, e.data(), blocks.data(), tp + b, lp + b);
  });
  return {tokens, logprobs};
}

}  // namespace

TORCH_LIBRARY(spmdrl_native, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("decode_attention(Tensor qkv, Tensor? q_norm, Tensor? k_norm, float eps, Tensor cos, Tensor sin, "
        "Tensor pos, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor bias, int col, int num_heads, "
        "float scale) -> Tensor");
  m.def("sample(Tensor logits, Tensor uniform, float temperature) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(spmdrl_native, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("decode_attention", &decode_attention);
  m.impl("sample", &sample);
}
