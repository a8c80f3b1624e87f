//! Block matrix products through the `gemm` crate (the one candle's CPU
//! backend uses), on strided views: a transposed operand is a view with
//! its strides swapped, never a copy.

/// A matrix view over a slice: element `(i, j)` is `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub(crate) struct View<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

impl<'a> View<'a> {
    /// A row-major view with `cols` elements per row.
    pub fn rows(data: &'a [f32], cols: usize) -> Self {
        Self {
            data,
            rs: cols,
            cs: 1,
        }
    }

    /// The transpose of a row-major matrix with `cols` elements per row.
    pub fn transposed(data: &'a [f32], cols: usize) -> Self {
        Self {
            data,
            rs: 1,
            cs: cols,
        }
    }

    /// Panics unless every element of an `m x n` view lies inside the slice:
    /// the product below reads through raw pointers.
    fn check(&self, m: usize, n: usize, what: &str) {
        if m == 0 || n == 0 {
            return;
        }
        let last = (m - 1) * self.rs + (n - 1) * self.cs;
        assert!(
            last < self.data.len(),
            "internal: {what} view {m}x{n} reaches {last}, slice has {}",
            self.data.len()
        );
    }
}

/// `dst = factor * a b` (or `dst += factor * a b` with `accumulate`), where
/// `a` is `m x k`, `b` is `k x n` and `dst` is row-major `m x n`, `dst_rs`
/// elements per row. Single-threaded: the kernel parallelises over blocks.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    a: View,
    b: View,
    m: usize,
    n: usize,
    k: usize,
    factor: f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    View::rows(dst, dst_rs).check(m, n, "dst");
    a.check(m, k, "lhs");
    b.check(k, n, "rhs");
    // SAFETY: the three views were checked to lie inside their slices, and
    // `dst` is borrowed mutably, so it aliases neither operand.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            1.0,
            factor,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain(a: View, b: View, m: usize, n: usize, k: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                for t in 0..k {
                    out[i * n + j] += a.data[i * a.rs + t * a.cs] * b.data[t * b.rs + j * b.cs];
                }
            }
        }
        out
    }

    #[test]
    fn strided_products_equal_the_plain_loops() {
        let (m, n, k) = (5, 7, 3);
        let a: Vec<f32> = (0..m * k).map(|i| i as f32 * 0.5 - 3.0).collect();
        let bt: Vec<f32> = (0..n * k).map(|i| (i % 5) as f32 - 2.0).collect();
        let (va, vb) = (View::rows(&a, k), View::transposed(&bt, k));
        let want = plain(va, vb, m, n, k);
        let mut got = vec![1f32; m * n];
        matmul(&mut got, n, false, va, vb, m, n, k, 1.0);
        assert_eq!(got, want);
        matmul(&mut got, n, true, va, vb, m, n, k, 0.5);
        let twice: Vec<f32> = want.iter().map(|x| x * 1.5).collect();
        assert_eq!(got, twice);
    }

    #[test]
    #[should_panic(expected = "internal: rhs view")]
    fn a_view_past_its_slice_is_refused() {
        let a = [1f32; 6];
        let mut dst = [0f32; 4];
        matmul(
            &mut dst,
            2,
            false,
            View::rows(&a, 3),
            View::rows(&a[..5], 2),
            2,
            2,
            3,
            1.0,
        );
    }
}
