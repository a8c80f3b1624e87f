// The tiled attention on a CUDA GPU: the forward with its log-sum-exp and
// the recomputing backward (src/forward.rs and src/backward.rs compose the
// same arithmetic from candle's operations, one launch per operation and
// block). Each thread owns one row (a query in the forward and in dQ's
// kernel, a key in dK's and dV's), holds it in registers (at D = 128 the
// backward's two rows of 128 floats spill to local memory), and walks the
// other side's rows through shared memory a tile at a time; its running sums
// live in shared memory, padded by one column so that a warp's threads hit
// 32 different banks. Nothing of size `n x n` exists anywhere.
//
// The kernels' bodies; flash_32.cu, flash_64.cu and flash_128.cu each
// instantiate them at one D (src/flash_cuda.rs launches them).
//
// Tensors are contiguous `(batch, heads, n, head_dim)`; query head h reads
// key/value head h / group. Head dimensions up to D (32, 64 or 128) are
// zero-padded to D, so the padding adds nothing to a dot product. Elements
// are read as f32 and every sum is f32; outputs are rounded once to the
// element type. The causal mask is top-left aligned: query i sees keys
// 0..=i.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stddef.h>

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void put(float *p, float x) { *p = x; }
__device__ __forceinline__ void put(__half *p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void put(__nv_bfloat16 *p, float x) { *p = __float2bfloat16_rn(x); }

// Threads (owned rows) per block: 64, or 32 at D = 128, where each row's
// sums take twice the room. A streamed tile holds a fixed number of
// elements, so that a block's shared memory stays under the 48 KiB every
// launch may have, and the fully unrolled loops over a tile (which keep
// each row's scores in registers) stay one size whatever D is.
template <int D> struct Tiles {
  static constexpr int ROWS = D <= 64 ? 64 : 32;
  static constexpr int STREAM = 1024 / D;  // forward and dQ: keys per tile
  static constexpr int STREAM_KV = 512 / D; // dK and dV: queries per tile
};

// The element `c` of row `row` of a `(rows, width)` matrix, or 0 past its
// end or its width (the padding).
template <typename T>
__device__ __forceinline__ float at(const T *m, int rows, int width, int row, int c) {
  return row < rows && c < width ? to_f32(m[(size_t)row * width + c]) : 0.0f;
}

// Rows `first..first + S` of two `(rows, width)` matrices (keys and values,
// or queries and their output's gradient) into shared tiles, padded; the
// block's R threads share the work, consecutive threads reading
// consecutive elements.
template <int D, int S, int R, typename T>
__device__ __forceinline__ void load_tiles(float (&a)[S][D], float (&b)[S][D], const T *ma,
                                           int width_a, const T *mb, int width_b, int rows,
                                           int first) {
  for (int e = threadIdx.x; e < S * D; e += R) {
    const int row = e / D, c = e % D;
    a[row][c] = at(ma, rows, width_a, first + row, c);
    b[row][c] = at(mb, rows, width_b, first + row, c);
  }
}

// The two dot products of the backward, `x . xs` (a score before its
// scale) and `y . ys` (an element of dO V^T), over the padded dimension.
template <int D>
__device__ __forceinline__ void two_dots(const float (&x)[D], const float (&xs)[D],
                                         const float (&y)[D], const float (&ys)[D], float &s,
                                         float &dp) {
  s = 0.0f;
  dp = 0.0f;
#pragma unroll
  for (int c = 0; c < D; ++c) {
    s = fmaf(x[c], xs[c], s);
    dp = fmaf(y[c], ys[c], dp);
  }
}

// out = softmax(q k^T * scale) v and lse = each row's log-sum-exp of its
// scaled scores. Grid: (query blocks, batch * q_heads).
template <typename T, int D>
__device__ void forward(const T *q, const T *k, const T *v, T *out, float *lse, int nq, int nk,
                        int d, int dv, int hq, int group, float scale, int causal) {
  constexpr int R = Tiles<D>::ROWS, S = Tiles<D>::STREAM;
  __shared__ float ks[S][D];
  __shared__ float vs[S][D];
  __shared__ float acc[R][D + 1];
  const int t = threadIdx.x, r = blockIdx.y, i0 = blockIdx.x * R, i = i0 + t;
  const int kv = (r / hq) * (hq / group) + (r % hq) / group;
  const T *qr = q + (size_t)r * nq * d;
  const T *kr = k + (size_t)kv * nk * d;
  const T *vr = v + (size_t)kv * nk * dv;
  float qi[D];
#pragma unroll
  for (int c = 0; c < D; ++c) {
    qi[c] = at(qr, nq, d, i, c);
    acc[t][c] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  // The keys any of the block's queries sees.
  const int k_end = causal ? min(nk, i0 + R) : nk;
  for (int j0 = 0; j0 < k_end; j0 += S) {
    __syncthreads(); // every thread is done with the previous tile
    load_tiles<D, S, R>(ks, vs, kr, d, vr, dv, nk, j0);
    __syncthreads();
    float p[S];
    float tile_max = -INFINITY;
#pragma unroll
    for (int j = 0; j < S; ++j) {
      float dot = 0.0f;
#pragma unroll
      for (int c = 0; c < D; ++c) dot = fmaf(qi[c], ks[j][c], dot);
      const int key = j0 + j;
      p[j] = key < nk && (!causal || key <= i) ? dot * scale : -INFINITY;
      tile_max = fmaxf(tile_max, p[j]);
    }
    const float m_new = fmaxf(m, tile_max);
    if (m_new == -INFINITY) continue; // no key of this tile is seen (rows past nq)
    // Earlier tiles were exponentiated against the old maximum.
    const float correction = expf(m - m_new);
    float tile_sum = 0.0f;
#pragma unroll
    for (int j = 0; j < S; ++j) {
      p[j] = expf(p[j] - m_new);
      tile_sum += p[j];
    }
    l = l * correction + tile_sum;
    m = m_new;
#pragma unroll 4
    for (int c = 0; c < D; ++c) {
      float a = acc[t][c] * correction;
#pragma unroll
      for (int j = 0; j < S; ++j) a = fmaf(p[j], vs[j][c], a);
      acc[t][c] = a;
    }
  }
  if (i < nq) {
    T *o = out + ((size_t)r * nq + i) * dv;
    for (int c = 0; c < dv; ++c) put(&o[c], acc[t][c] / l);
    lse[(size_t)r * nq + i] = m + logf(l);
  }
}

// delta = rowsum(d_out * out), the softmax backward's correction term, one
// thread per row of `rows`.
template <typename T>
__device__ void delta(const T *d_out, const T *out, float *dl, size_t rows, int dv) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < rows;
       i += (size_t)blockDim.x * gridDim.x) {
    float s = 0.0f;
    for (int c = 0; c < dv; ++c) s = fmaf(to_f32(d_out[i * dv + c]), to_f32(out[i * dv + c]), s);
    dl[i] = s;
  }
}

// dK and dV of a block of keys, summed over the query heads of their group:
//   p = exp(q k^T * scale - lse), dV += p^T dO,
//   dS = p * (dO v^T - delta), dK += dS^T q * scale.
// Grid: (key blocks, batch * kv_heads).
template <typename T, int D>
__device__ void backward_kv(const T *q, const T *k, const T *v, const T *d_out, const float *lse,
                            const float *dl, T *dk, T *dv_out, int nq, int nk, int d, int dv,
                            int hq, int group, float scale, int causal) {
  constexpr int R = Tiles<D>::ROWS, S = Tiles<D>::STREAM_KV;
  __shared__ float qs[S][D];
  __shared__ float dos[S][D];
  __shared__ float ls[S];
  __shared__ float dls[S];
  __shared__ float dk_acc[R][D + 1];
  __shared__ float dv_acc[R][D + 1];
  const int t = threadIdx.x, kv = blockIdx.y, j0 = blockIdx.x * R, j = j0 + t;
  const int hkv = hq / group, b = kv / hkv, h0 = (kv % hkv) * group;
  float kj[D], vj[D];
#pragma unroll
  for (int c = 0; c < D; ++c) {
    kj[c] = at(k + (size_t)kv * nk * d, nk, d, j, c);
    vj[c] = at(v + (size_t)kv * nk * dv, nk, dv, j, c);
    dk_acc[t][c] = 0.0f;
    dv_acc[t][c] = 0.0f;
  }
  for (int g = 0; g < group; ++g) {
    const size_t r = (size_t)b * hq + h0 + g;
    const T *qr = q + r * nq * d;
    const T *dor = d_out + r * nq * dv;
    // Queries before the block's first key see none of its keys.
    for (int i0 = causal ? j0 : 0; i0 < nq; i0 += S) {
      __syncthreads();
      load_tiles<D, S, R>(qs, dos, qr, d, dor, dv, nq, i0);
      for (int ii = t; ii < S; ii += R) {
        const bool in = i0 + ii < nq;
        ls[ii] = in ? lse[r * nq + i0 + ii] : 0.0f;
        dls[ii] = in ? dl[r * nq + i0 + ii] : 0.0f;
      }
      __syncthreads();
      float p[S], ds[S];
#pragma unroll
      for (int ii = 0; ii < S; ++ii) {
        float s, dp;
        two_dots<D>(kj, qs[ii], vj, dos[ii], s, dp);
        const int i = i0 + ii;
        const bool seen = j < nk && i < nq && (!causal || j <= i);
        p[ii] = seen ? expf(s * scale - ls[ii]) : 0.0f;
        ds[ii] = p[ii] * (dp - dls[ii]);
      }
#pragma unroll 4
      for (int c = 0; c < D; ++c) {
        float a = dv_acc[t][c], bk = dk_acc[t][c];
#pragma unroll
        for (int ii = 0; ii < S; ++ii) {
          a = fmaf(p[ii], dos[ii][c], a);
          bk = fmaf(ds[ii], qs[ii][c], bk);
        }
        dv_acc[t][c] = a;
        dk_acc[t][c] = bk;
      }
    }
  }
  if (j < nk) {
    T *dkr = dk + ((size_t)kv * nk + j) * d;
    T *dvr = dv_out + ((size_t)kv * nk + j) * dv;
    for (int c = 0; c < d; ++c) put(&dkr[c], dk_acc[t][c] * scale);
    for (int c = 0; c < dv; ++c) put(&dvr[c], dv_acc[t][c]);
  }
}

// dQ of a block of queries: dS = p * (dO v^T - delta), dQ = dS k * scale.
// Grid: (query blocks, batch * q_heads).
template <typename T, int D>
__device__ void backward_q(const T *q, const T *k, const T *v, const T *d_out, const float *lse,
                           const float *dl, T *dq, int nq, int nk, int d, int dv, int hq,
                           int group, float scale, int causal) {
  constexpr int R = Tiles<D>::ROWS, S = Tiles<D>::STREAM;
  __shared__ float ks[S][D];
  __shared__ float vs[S][D];
  __shared__ float dq_acc[R][D + 1];
  const int t = threadIdx.x, r = blockIdx.y, i0 = blockIdx.x * R, i = i0 + t;
  const int kv = (r / hq) * (hq / group) + (r % hq) / group;
  const T *kr = k + (size_t)kv * nk * d;
  const T *vr = v + (size_t)kv * nk * dv;
  float qi[D], doi[D];
#pragma unroll
  for (int c = 0; c < D; ++c) {
    qi[c] = at(q + (size_t)r * nq * d, nq, d, i, c);
    doi[c] = at(d_out + (size_t)r * nq * dv, nq, dv, i, c);
    dq_acc[t][c] = 0.0f;
  }
  const bool live = i < nq;
  const float li = live ? lse[(size_t)r * nq + i] : 0.0f;
  const float di = live ? dl[(size_t)r * nq + i] : 0.0f;
  const int k_end = causal ? min(nk, i0 + R) : nk;
  for (int j0 = 0; j0 < k_end; j0 += S) {
    __syncthreads();
    load_tiles<D, S, R>(ks, vs, kr, d, vr, dv, nk, j0);
    __syncthreads();
    float ds[S];
#pragma unroll
    for (int j = 0; j < S; ++j) {
      float s, dp;
      two_dots<D>(qi, ks[j], doi, vs[j], s, dp);
      const int key = j0 + j;
      const bool seen = live && key < nk && (!causal || key <= i);
      ds[j] = seen ? expf(s * scale - li) * (dp - di) : 0.0f;
    }
#pragma unroll 4
    for (int c = 0; c < D; ++c) {
      float a = dq_acc[t][c];
#pragma unroll
      for (int j = 0; j < S; ++j) a = fmaf(ds[j], ks[j][c], a);
      dq_acc[t][c] = a;
    }
  }
  if (live) {
    T *o = dq + ((size_t)r * nq + i) * d;
    for (int c = 0; c < d; ++c) put(&o[c], dq_acc[t][c] * scale);
  }
}

// The four kernels for one element type and one padded head dimension.
#define FLASH(SUFFIX, T, D)                                                                     \
  extern "C" __global__ void flash_forward_##D##_##SUFFIX(                                      \
      const T *q, const T *k, const T *v, T *out, float *lse, int nq, int nk, int d, int dv,    \
      int hq, int group, float scale, int causal) {                                             \
    forward<T, D>(q, k, v, out, lse, nq, nk, d, dv, hq, group, scale, causal);                  \
  }                                                                                             \
  extern "C" __global__ void flash_delta_##D##_##SUFFIX(const T *d_out, const T *out,           \
                                                        float *dl, size_t rows, int dv) {       \
    delta<T>(d_out, out, dl, rows, dv);                                                         \
  }                                                                                             \
  extern "C" __global__ void flash_backward_kv_##D##_##SUFFIX(                                  \
      const T *q, const T *k, const T *v, const T *d_out, const float *lse, const float *dl,    \
      T *dk, T *dv_out, int nq, int nk, int d, int dv, int hq, int group, float scale,          \
      int causal) {                                                                             \
    backward_kv<T, D>(q, k, v, d_out, lse, dl, dk, dv_out, nq, nk, d, dv, hq, group, scale,     \
                      causal);                                                                  \
  }                                                                                             \
  extern "C" __global__ void flash_backward_q_##D##_##SUFFIX(                                   \
      const T *q, const T *k, const T *v, const T *d_out, const float *lse, const float *dl,    \
      T *dq, int nq, int nk, int d, int dv, int hq, int group, float scale, int causal) {       \
    backward_q<T, D>(q, k, v, d_out, lse, dl, dq, nq, nk, d, dv, hq, group, scale, causal);     \
  }

// Every element type at one padded head dimension: one module per D, so
// that a GPU compiles (JIT) only the dimension a model uses.
#define FLASH_ALL_TYPES(D)                                                                      \
  FLASH(f32, float, D)                                                                          \
  FLASH(f16, __half, D)                                                                         \
  FLASH(bf16, __nv_bfloat16, D)
