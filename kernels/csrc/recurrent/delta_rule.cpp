// The gated delta rule of Qwen3.5's Gated DeltaNet layers over a pool of fp32 states, one slot
// per sequence (contract: kernels/reference.py gated_delta_rule_prefill / _decode). Per token
// and value head, with q and k l2-normalised (optionally) and q scaled by 1/sqrt(Dk):
//   S = S exp(g);  S += k (x) beta (v - S^T k);  o = S^T q
//
// The state S [Dk, Dv] of a head is worked on in blocks of 16 columns: a column's update and
// output depend on that column alone. For each block, one read of its rows gives S^T k and
// S^T q at once; then o = exp(g) S^T q + (k.q) delta, with delta = beta (v - exp(g) S^T k),
// needs no second read, and the write of the decayed, updated rows finds the block (8 KiB at
// Dk 128) still in L1. So a decode moves each state byte from memory once in and once out.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_common.h"
#include "cpu_ops.h"
#include "vec.hpp"
#include "work_pool.h"

namespace {

using kvscope::vec::FP32Vec16;

constexpr float kL2NormEps = 1e-6f;  // reference.L2NORM_EPS
// Tokens a prefill works through per pass over a head's column blocks: their normalised q and
// k (64 KiB at Dk 128) stay in L2 while each block takes them in turn.
constexpr int64_t kTokenTile = 64;

// One fp32 lane with FP32Vec16's interface, for the columns past the last 16.
struct Lane {
  float reg;

  Lane() : reg(0.f) {}
  explicit Lane(float x) : reg(x) {}
  template <typename T>
  static Lane load(const T* p) {
    return Lane(kvscope::load(*p));
  }
  template <typename T>
  void store(T* p) const {
    kvscope::store(*p, reg);
  }
  Lane operator+(Lane other) const { return Lane(reg + other.reg); }
  Lane operator-(Lane other) const { return Lane(reg - other.reg); }
  Lane operator*(float x) const { return Lane(reg * x); }
};

inline Lane fma(Lane a, Lane b, Lane c) { return Lane(a.reg * b.reg + c.reg); }
using kvscope::vec::fma;

// A token's q and k (one key head) as fp32 into qn, kn: l2-normalised if asked, q scaled by
// 1/sqrt(dk). Returns k.q of the results.
template <typename T>
float prepare_qk(const T* q, const T* k, int64_t dk, bool l2norm, float* qn, float* kn) {
  float qq = 0.f, kk = 0.f;
#pragma omp simd reduction(+ : qq, kk)
  for (int64_t i = 0; i < dk; ++i) {
    qn[i] = kvscope::load(q[i]);
    kn[i] = kvscope::load(k[i]);
    qq += qn[i] * qn[i];
    kk += kn[i] * kn[i];
  }
  const float root = std::sqrt(static_cast<float>(dk));
  const float q_scale = l2norm ? 1.f / (std::sqrt(qq + kL2NormEps) * root) : 1.f / root;
  const float k_scale = l2norm ? 1.f / std::sqrt(kk + kL2NormEps) : 1.f;
  float kq = 0.f;
#pragma omp simd reduction(+ : kq)
  for (int64_t i = 0; i < dk; ++i) {
    qn[i] *= q_scale;
    kn[i] *= k_scale;
    kq += qn[i] * kn[i];
  }
  return kq;
}

// One token's step on the state columns [0, width of V) at s (rows of stride dv): reads the
// token's v there and writes its output there.
template <typename V, typename T>
inline void step_columns(float* __restrict s, int64_t dk, int64_t dv, const float* qn,
                         const float* kn, float kq, float decay, float beta, const T* v, T* out) {
  V read_k[2] = {V(0.f), V(0.f)}, read_q[2] = {V(0.f), V(0.f)};
  int64_t i = 0;
  for (; i + 2 <= dk; i += 2)  // two chains each: one would wait on every FMA's latency
    for (int u = 0; u < 2; ++u) {
      const V row = V::load(s + (i + u) * dv);
      read_k[u] = fma(row, V(kn[i + u]), read_k[u]);
      read_q[u] = fma(row, V(qn[i + u]), read_q[u]);
    }
  if (i < dk) {
    const V row = V::load(s + i * dv);
    read_k[0] = fma(row, V(kn[i]), read_k[0]);
    read_q[0] = fma(row, V(qn[i]), read_q[0]);
  }
  const V delta = (V::load(v) - (read_k[0] + read_k[1]) * decay) * beta;
  fma(delta, V(kq), (read_q[0] + read_q[1]) * decay).store(out);
  for (int64_t r = 0; r < dk; ++r) {
    float* row = s + r * dv;
    fma(delta, V(kn[r]), V::load(row) * decay).store(row);
  }
}

// body(V{}, column) for each block of 16 columns of [0, dv), then each column after them.
template <typename Body>
inline void for_column_blocks(int64_t dv, Body&& body) {
  int64_t j = 0;
  for (; j + 16 <= dv; j += 16) body(FP32Vec16(), j);
  for (; j < dv; ++j) body(Lane(), j);
}

// Rows of q/k/v: [rows, heads, dim] with any row and head strides, dims contiguous.
template <typename T>
struct Rows {
  const T* data;
  int64_t row_stride, head_stride;

  const T* at(int64_t row, int64_t head) const {
    return data + row * row_stride + head * head_stride;
  }
};

template <typename T>
Rows<T> rows_of(const at::Tensor& t) {
  return {kvscope::elements<const T>(t), t.stride(0), t.stride(1)};
}

struct Shape {
  int64_t key_heads, value_heads, dk, dv;

  int64_t group() const { return value_heads / key_heads; }
  int64_t state_size() const { return dk * dv; }
};

template <typename T>
void decode(Rows<T> q, Rows<T> k, Rows<T> v, const float* g, const float* beta, float* state,
            const int64_t* slots, int64_t batch, Shape shape, bool l2norm, T* out) {
  kvscope::parallel_for(0, batch * shape.value_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qn(shape.dk), kn(shape.dk);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / shape.value_heads, h = item % shape.value_heads;
      const int64_t key_head = h / shape.group();
      const float kq =
          prepare_qk(q.at(b, key_head), k.at(b, key_head), shape.dk, l2norm, qn.data(), kn.data());
      const float decay = std::exp(g[item]);
      float* s = state + (slots[b] * shape.value_heads + h) * shape.state_size();
      const T* v_row = v.at(b, h);
      T* o = out + item * shape.dv;
      for_column_blocks(shape.dv, [&](auto lanes, int64_t j) {
        step_columns<decltype(lanes)>(s + j, shape.dk, shape.dv, qn.data(), kn.data(), kq, decay,
                                      beta[item], v_row + j, o + j);
      });
    }
  });
}

template <typename T>
void prefill(Rows<T> q, Rows<T> k, Rows<T> v, const float* g, const float* beta, float* s_pool,
             int64_t slot, int64_t tokens, Shape shape, bool l2norm, T* out) {
  const int64_t heads = shape.value_heads;
  kvscope::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qn(kTokenTile * shape.dk), kn(kTokenTile * shape.dk);
    float kq[kTokenTile], decay[kTokenTile];
    for (int64_t h = begin; h < end; ++h) {
      const int64_t key_head = h / shape.group();
      float* s = s_pool + (slot * heads + h) * shape.state_size();
      for (int64_t first = 0; first < tokens; first += kTokenTile) {
        const int64_t count = std::min(kTokenTile, tokens - first);
        for (int64_t t = 0; t < count; ++t) {
          kq[t] = prepare_qk(q.at(first + t, key_head), k.at(first + t, key_head), shape.dk, l2norm,
                             qn.data() + t * shape.dk, kn.data() + t * shape.dk);
          decay[t] = std::exp(g[(first + t) * heads + h]);
        }
        for_column_blocks(shape.dv, [&](auto lanes, int64_t j) {
          for (int64_t t = 0; t < count; ++t) {
            const int64_t row = first + t;
            step_columns<decltype(lanes)>(s + j, shape.dk, shape.dv, qn.data() + t * shape.dk,
                                          kn.data() + t * shape.dk, kq[t], decay[t],
                                          beta[row * heads + h], v.at(row, h) + j,
                                          out + (row * heads + h) * shape.dv + j);
          }
        });
      }
    }
  });
}

// The checks both ops share; returns the shape.
Shape check(const char* name, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
            const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state,
            const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0) &&
                  q.size(1) > 0 && v.size(1) % q.size(1) == 0,
              name, ": q, k [rows, key_heads, Dk], v [rows, value_heads (a multiple), Dv]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, name,
              ": q, k and v need contiguous last dims");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              name, ": q, k, v and out in one dtype, float32 or bfloat16");
  const Shape shape{q.size(1), v.size(1), q.size(2), v.size(2)};
  TORCH_CHECK(g.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat &&
                  g.is_contiguous() && beta.is_contiguous() &&
                  g.numel() == q.size(0) * shape.value_heads && beta.numel() == g.numel(),
              name, ": g and beta contiguous float32 [rows, value_heads]");
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() && state.dim() == 4 &&
                  state.size(1) == shape.value_heads && state.size(2) == shape.dk &&
                  state.size(3) == shape.dv,
              name, ": state contiguous float32 [slots, value_heads, Dk, Dv]");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == v.sizes(), name, ": out contiguous, v's shape");
  return shape;
}

}  // namespace

void gated_delta_rule_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& g, const at::Tensor& beta, at::Tensor state,
                             const at::Tensor& slots, bool use_qk_l2norm, at::Tensor out) {
  const Shape shape = check("gated_delta_rule_decode", q, k, v, g, beta, state, out);
  TORCH_CHECK(
      slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == q.size(0),
      "gated_delta_rule_decode: slots contiguous int64, one per row");
  const int64_t* slot_ids = kvscope::elements<const int64_t>(slots);
  for (int64_t b = 0; b < slots.numel(); ++b)
    TORCH_CHECK(slot_ids[b] >= 0 && slot_ids[b] < state.size(0), "gated_delta_rule_decode: slots[",
                b, "] = ", slot_ids[b], " outside the pool's ", state.size(0), " slots");
  const float *decay = kvscope::elements<const float>(g),
              *rate = kvscope::elements<const float>(beta);
  if (q.scalar_type() == at::kFloat)
    decode<float>(rows_of<float>(q), rows_of<float>(k), rows_of<float>(v), decay, rate,
                  kvscope::elements<float>(state), slot_ids, q.size(0), shape, use_qk_l2norm,
                  kvscope::elements<float>(out));
  else
    decode<kvscope::bf16>(rows_of<kvscope::bf16>(q), rows_of<kvscope::bf16>(k),
                          rows_of<kvscope::bf16>(v), decay, rate, kvscope::elements<float>(state),
                          slot_ids, q.size(0), shape, use_qk_l2norm,
                          kvscope::elements<kvscope::bf16>(out));
}

void gated_delta_rule_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& g, const at::Tensor& beta, at::Tensor state,
                              int64_t slot, bool use_qk_l2norm, at::Tensor out) {
  const Shape shape = check("gated_delta_rule_prefill", q, k, v, g, beta, state, out);
  TORCH_CHECK(slot >= 0 && slot < state.size(0), "gated_delta_rule_prefill: slot ", slot,
              " outside the pool's ", state.size(0), " slots");
  const float *decay = kvscope::elements<const float>(g),
              *rate = kvscope::elements<const float>(beta);
  if (q.scalar_type() == at::kFloat)
    prefill<float>(rows_of<float>(q), rows_of<float>(k), rows_of<float>(v), decay, rate,
                   kvscope::elements<float>(state), slot, q.size(0), shape, use_qk_l2norm,
                   kvscope::elements<float>(out));
  else
    prefill<kvscope::bf16>(rows_of<kvscope::bf16>(q), rows_of<kvscope::bf16>(k),
                           rows_of<kvscope::bf16>(v), decay, rate, kvscope::elements<float>(state),
                           slot, q.size(0), shape, use_qk_l2norm,
                           kvscope::elements<kvscope::bf16>(out));
}
