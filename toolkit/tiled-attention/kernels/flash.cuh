// The tiled attention on a CUDA GPU: the forward with its log-sum-exp and
// the recomputing backward (src/forward.rs and src/backward.rs compose the
// same arithmetic from candle's operations, one launch per operation and
// block). Each row (a query in the forward and in dQ's kernel, a key in
// dK's and dV's) belongs to a group of D / 16 consecutive threads, its
// lanes: each lane holds 16 of the row's columns in registers, four runs
// of 4 interleaved (lane l holds columns 4l..4l+3, then 4(l + lanes)..,
// ...) so that a group reads consecutive 16-byte words of a tile, one load
// per 4 columns, and its share of every running sum. A dot
// product is each lane's partial sum, added across the group by warp
// shuffles (a butterfly, which leaves every lane the same bits). The block
// walks the other side's rows through shared memory a tile at a time.
// Nothing of size `n x n` exists anywhere.
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
//
// Every thread of a block runs the same loops the same number of times
// (their bounds depend on the block, never on the row), so every lane of a
// warp reaches every shuffle, as a full mask requires.
#pragma once
#include "candle_kernel_params/elements.cuh"
#include <math.h>
#include <stddef.h>

// A block is 128 threads, four warps: 64 rows of 2 lanes at D = 32, 32 of
// 4 at 64, 16 of 8 at 128. A streamed tile is 32 rows of the other side,
// at most 2 x 16 KiB of shared memory at D = 128, under the 48 KiB every
// launch may have. (src/flash_plan.rs gives the same grid.)
template <int D> struct Tiles {
  static constexpr int COLS = 16;               // columns a lane holds
  static constexpr int QUADS = COLS / 4;        // its runs of 4 columns
  static constexpr int LANES = D / COLS;        // lanes a row has
  static constexpr int THREADS = 128;           // threads a block has
  static constexpr int ROWS = THREADS / LANES;  // rows a block owns
  static constexpr int STREAM = 32;             // rows a streamed tile has
  static_assert(D % COLS == 0 && 32 % LANES == 0, "a row's lanes lie in one warp");
};

// The column a lane holds as its `u`-th: runs of 4, interleaved, so that
// a row's lanes read consecutive 16-byte words of a tile.
template <int D> __device__ __forceinline__ int column(int lane, int u) {
  return 4 * (lane + Tiles<D>::LANES * (u / 4)) + u % 4;
}

// A lane's columns of a tile's row into `x`, its `u`-th into `x[u]`: one
// 16-byte load per run of 4 (the tiles are 16-byte aligned, and a row of D
// floats keeps the next row so).
template <int D>
__device__ __forceinline__ void tile_columns(float (&x)[Tiles<D>::COLS],
                                             const float (&tile_row)[D], int lane) {
  const float4 *quads = reinterpret_cast<const float4 *>(tile_row);
#pragma unroll
  for (int k = 0; k < Tiles<D>::QUADS; ++k) {
    const float4 q = quads[lane + Tiles<D>::LANES * k];
    x[4 * k] = q.x;
    x[4 * k + 1] = q.y;
    x[4 * k + 2] = q.z;
    x[4 * k + 3] = q.w;
  }
}

// `x` summed over the L lanes of a row (L a power of two, the lanes
// consecutive and aligned): the same value on every lane.
template <int L> __device__ __forceinline__ float lanes_sum(float x) {
#pragma unroll
  for (int m = L / 2; m > 0; m /= 2) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// The element `c` of row `row` of a `(rows, width)` matrix, or 0 past its
// end or its width (the padding).
template <typename T>
__device__ __forceinline__ float at(const T *m, int rows, int width, int row, int c) {
  return row < rows && c < width ? load(m[(size_t)row * width + c]) : 0.0f;
}

// Rows `first..first + S` of two `(rows, width)` matrices (keys and values,
// or queries and their output's gradient) into shared tiles, padded; the
// block's N threads share the work, consecutive threads reading
// consecutive elements.
template <int D, int S, int N, typename T>
__device__ __forceinline__ void load_tiles(float (&a)[S][D], float (&b)[S][D], const T *ma,
                                           int width_a, const T *mb, int width_b, int rows,
                                           int first) {
  for (int e = threadIdx.x; e < S * D; e += N) {
    const int row = e / D, c = e % D;
    a[row][c] = at(ma, rows, width_a, first + row, c);
    b[row][c] = at(mb, rows, width_b, first + row, c);
  }
}

// A lane's columns of row `row`: its `u`-th into `x[u]`.
template <int D, typename T>
__device__ __forceinline__ void load_row(float (&x)[Tiles<D>::COLS], const T *m, int rows,
                                         int width, int row, int lane) {
#pragma unroll
  for (int u = 0; u < Tiles<D>::COLS; ++u) x[u] = at(m, rows, width, row, column<D>(lane, u));
}

// A lane's share of `x . tile_row` over its columns.
template <int D>
__device__ __forceinline__ float partial_dot(const float (&x)[Tiles<D>::COLS],
                                             const float (&tile_row)[D], int lane) {
  float t[Tiles<D>::COLS];
  tile_columns<D>(t, tile_row, lane);
  float s = 0.0f;
#pragma unroll
  for (int u = 0; u < Tiles<D>::COLS; ++u) s = fmaf(x[u], t[u], s);
  return s;
}

// The backward's step for one streamed row: a lane's columns of row `a`
// and row `b` of the two tiles into `ac` and `bc` (read from shared memory
// once, for the dots and the caller's sums), and the row-wide dots
// `s = x . a` and `dp = y . b`, on every lane.
template <int D>
__device__ __forceinline__ void two_dots(const float (&x)[Tiles<D>::COLS],
                                         const float (&y)[Tiles<D>::COLS], const float (&a)[D],
                                         const float (&b)[D], float (&ac)[Tiles<D>::COLS],
                                         float (&bc)[Tiles<D>::COLS], int lane, float &s,
                                         float &dp) {
  tile_columns<D>(ac, a, lane);
  tile_columns<D>(bc, b, lane);
  s = 0.0f;
  dp = 0.0f;
#pragma unroll
  for (int u = 0; u < Tiles<D>::COLS; ++u) {
    s = fmaf(x[u], ac[u], s);
    dp = fmaf(y[u], bc[u], dp);
  }
  s = lanes_sum<Tiles<D>::LANES>(s);
  dp = lanes_sum<Tiles<D>::LANES>(dp);
}

// A lane's columns of `x` (times `factor`) into row `row` of a `(_, width)`
// matrix, those within its width.
template <int D, typename T>
__device__ __forceinline__ void store_row(T *m, int width, size_t row,
                                          const float (&x)[Tiles<D>::COLS], float factor,
                                          int lane) {
#pragma unroll
  for (int u = 0; u < Tiles<D>::COLS; ++u) {
    const int c = column<D>(lane, u);
    if (c < width) store(&m[row * width + c], x[u] * factor);
  }
}

// out = softmax(q k^T * scale) v and lse = each row's log-sum-exp of its
// scaled scores. Grid: (query blocks, batch * q_heads).
template <typename T, int D>
__device__ void forward(const T *q, const T *k, const T *v, T *out, float *lse, int nq, int nk,
                        int d, int dv, int hq, int group, float scale, int causal) {
  using Tl = Tiles<D>;
  constexpr int L = Tl::LANES, C = Tl::COLS, R = Tl::ROWS, S = Tl::STREAM;
  __shared__ __align__(16) float ks[S][D];
  __shared__ __align__(16) float vs[S][D];
  const int lane = threadIdx.x % L, r = blockIdx.y, i0 = blockIdx.x * R;
  const int i = i0 + threadIdx.x / L;
  const int kv = (r / hq) * (hq / group) + (r % hq) / group;
  const T *kr = k + (size_t)kv * nk * d;
  const T *vr = v + (size_t)kv * nk * dv;
  float qi[C], acc[C];
  load_row<D>(qi, q + (size_t)r * nq * d, nq, d, i, lane);
#pragma unroll
  for (int u = 0; u < C; ++u) acc[u] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  // The keys any of the block's queries sees.
  const int k_end = causal ? min(nk, i0 + R) : nk;
  for (int j0 = 0; j0 < k_end; j0 += S) {
    __syncthreads(); // every thread is done with the previous tile
    load_tiles<D, S, Tl::THREADS>(ks, vs, kr, d, vr, dv, nk, j0);
    __syncthreads();
    float p[S];
    float tile_max = -INFINITY;
#pragma unroll
    for (int j = 0; j < S; ++j) {
      const float dot = lanes_sum<L>(partial_dot<D>(qi, ks[j], lane));
      const int key = j0 + j;
      p[j] = key < nk && (!causal || key <= i) ? dot * scale : -INFINITY;
      tile_max = fmaxf(tile_max, p[j]);
    }
    const float m_new = fmaxf(m, tile_max);
    // No key of this tile is seen: the same on all of a row's lanes, and no
    // shuffle follows before the next tile.
    if (m_new == -INFINITY) continue;
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
#pragma unroll
    for (int u = 0; u < C; ++u) acc[u] *= correction;
    // Each value row's columns read once, in quads; every acc[u] still
    // sums its terms in the order of the keys.
#pragma unroll
    for (int j = 0; j < S; ++j) {
      float vc[C];
      tile_columns<D>(vc, vs[j], lane);
#pragma unroll
      for (int u = 0; u < C; ++u) acc[u] = fmaf(p[j], vc[u], acc[u]);
    }
  }
  if (i < nq) {
#pragma unroll
    for (int u = 0; u < C; ++u) acc[u] /= l;
    store_row<D>(out, dv, (size_t)r * nq + i, acc, 1.0f, lane);
    if (lane == 0) lse[(size_t)r * nq + i] = m + logf(l);
  }
}

// Rows of `delta` each block of the row-wise kernel computes at once: one
// per warp of its 256 threads.
constexpr int DELTA_THREADS = 256;

// delta = rowsum(d_out * out), the softmax backward's correction term: a
// warp per row of `rows`, its 32 lanes reading consecutive elements.
template <typename T>
__device__ void delta(const T *d_out, const T *out, float *dl, size_t rows, int dv) {
  const int lane = threadIdx.x % 32, warps = DELTA_THREADS / 32;
  // The bound and the step are the warp's own: its lanes shuffle together.
  for (size_t i = (size_t)blockIdx.x * warps + threadIdx.x / 32; i < rows;
       i += (size_t)gridDim.x * warps) {
    float s = 0.0f;
    for (int c = lane; c < dv; c += 32) s = fmaf(load(d_out[i * dv + c]), load(out[i * dv + c]), s);
    s = lanes_sum<32>(s);
    if (lane == 0) dl[i] = s;
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
  using Tl = Tiles<D>;
  constexpr int L = Tl::LANES, C = Tl::COLS, R = Tl::ROWS, S = Tl::STREAM;
  __shared__ __align__(16) float qs[S][D];
  __shared__ __align__(16) float dos[S][D];
  __shared__ float ls[S];
  __shared__ float dls[S];
  const int lane = threadIdx.x % L, kv = blockIdx.y, j0 = blockIdx.x * R;
  const int j = j0 + threadIdx.x / L;
  const int hkv = hq / group, b = kv / hkv, h0 = (kv % hkv) * group;
  float kj[C], vj[C], dk_acc[C], dv_acc[C];
  load_row<D>(kj, k + (size_t)kv * nk * d, nk, d, j, lane);
  load_row<D>(vj, v + (size_t)kv * nk * dv, nk, dv, j, lane);
#pragma unroll
  for (int u = 0; u < C; ++u) {
    dk_acc[u] = 0.0f;
    dv_acc[u] = 0.0f;
  }
  for (int g = 0; g < group; ++g) {
    const size_t r = (size_t)b * hq + h0 + g;
    const T *qr = q + r * nq * d;
    const T *dor = d_out + r * nq * dv;
    // Queries before the block's first key see none of its keys.
    for (int i0 = causal ? j0 : 0; i0 < nq; i0 += S) {
      __syncthreads();
      load_tiles<D, S, Tl::THREADS>(qs, dos, qr, d, dor, dv, nq, i0);
      for (int ii = threadIdx.x; ii < S; ii += Tl::THREADS) {
        const bool in = i0 + ii < nq;
        ls[ii] = in ? lse[r * nq + i0 + ii] : 0.0f;
        dls[ii] = in ? dl[r * nq + i0 + ii] : 0.0f;
      }
      __syncthreads();
      // One query at a time, its two dot products and both sums from the
      // same registers: a query's columns are read from the tile once.
#pragma unroll 2
      for (int ii = 0; ii < S; ++ii) {
        float qc[C], doc[C], s, dp;
        two_dots<D>(kj, vj, qs[ii], dos[ii], qc, doc, lane, s, dp);
        const int i = i0 + ii;
        const bool seen = j < nk && i < nq && (!causal || j <= i);
        const float p = seen ? expf(s * scale - ls[ii]) : 0.0f;
        const float ds = p * (dp - dls[ii]);
#pragma unroll
        for (int u = 0; u < C; ++u) {
          dv_acc[u] = fmaf(p, doc[u], dv_acc[u]);
          dk_acc[u] = fmaf(ds, qc[u], dk_acc[u]);
        }
      }
    }
  }
  if (j < nk) {
    store_row<D>(dk, d, (size_t)kv * nk + j, dk_acc, scale, lane);
    store_row<D>(dv_out, dv, (size_t)kv * nk + j, dv_acc, 1.0f, lane);
  }
}

// dQ of a block of queries: dS = p * (dO v^T - delta), dQ = dS k * scale.
// Grid: (query blocks, batch * q_heads).
template <typename T, int D>
__device__ void backward_q(const T *q, const T *k, const T *v, const T *d_out, const float *lse,
                           const float *dl, T *dq, int nq, int nk, int d, int dv, int hq,
                           int group, float scale, int causal) {
  using Tl = Tiles<D>;
  constexpr int L = Tl::LANES, C = Tl::COLS, R = Tl::ROWS, S = Tl::STREAM;
  __shared__ __align__(16) float ks[S][D];
  __shared__ __align__(16) float vs[S][D];
  const int lane = threadIdx.x % L, r = blockIdx.y, i0 = blockIdx.x * R;
  const int i = i0 + threadIdx.x / L;
  const int kv = (r / hq) * (hq / group) + (r % hq) / group;
  const T *kr = k + (size_t)kv * nk * d;
  const T *vr = v + (size_t)kv * nk * dv;
  float qi[C], doi[C], dq_acc[C];
  load_row<D>(qi, q + (size_t)r * nq * d, nq, d, i, lane);
  load_row<D>(doi, d_out + (size_t)r * nq * dv, nq, dv, i, lane);
#pragma unroll
  for (int u = 0; u < C; ++u) dq_acc[u] = 0.0f;
  const bool live = i < nq;
  const float li = live ? lse[(size_t)r * nq + i] : 0.0f;
  const float di = live ? dl[(size_t)r * nq + i] : 0.0f;
  const int k_end = causal ? min(nk, i0 + R) : nk;
  for (int j0 = 0; j0 < k_end; j0 += S) {
    __syncthreads();
    load_tiles<D, S, Tl::THREADS>(ks, vs, kr, d, vr, dv, nk, j0);
    __syncthreads();
    // One key at a time: its columns are read from the tile once, for
    // both dot products and for dQ's sum.
#pragma unroll 2
    for (int j = 0; j < S; ++j) {
      float kc[C], vc[C], s, dp;
      two_dots<D>(qi, doi, ks[j], vs[j], kc, vc, lane, s, dp);
      const int key = j0 + j;
      const bool seen = live && key < nk && (!causal || key <= i);
      const float ds = seen ? expf(s * scale - li) * (dp - di) : 0.0f;
#pragma unroll
      for (int u = 0; u < C; ++u) dq_acc[u] = fmaf(ds, kc[u], dq_acc[u]);
    }
  }
  if (live) store_row<D>(dq, d, (size_t)r * nq + i, dq_acc, scale, lane);
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
