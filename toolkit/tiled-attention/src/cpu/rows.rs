//! Row operations of the kernel, vectorised.
//!
//! Each is compiled for AVX-512, AVX2 and the baseline, the widest chosen at
//! run time (`candle_cpu_math::dispatch!`): the default target (SSE2) gives
//! a quarter of AVX-512's width. The exponential is a polynomial
//! (`candle_cpu_math::exp`) rather than libm's, which does not vectorise:
//! the softmax spent a third of its time in it.

use candle_cpu_math::{dispatch, exp};

/// Sixteen partial results at a time: float sums and maxima are not
/// reassociated by the compiler, so lanes are written out.
const LANES: usize = 16;

dispatch! {
    /// The largest element; minus infinity for an empty or fully masked row.
    pub(crate) fn max(row: &[f32]) -> f32 {
        let mut lanes = [f32::NEG_INFINITY; LANES];
        let mut chunks = row.chunks_exact(LANES);
        for c in &mut chunks {
            for j in 0..LANES {
                lanes[j] = if c[j] > lanes[j] { c[j] } else { lanes[j] };
            }
        }
        let mut m = f32::NEG_INFINITY;
        for &x in lanes.iter().chain(chunks.remainder()) {
            m = if x > m { x } else { m };
        }
        m
    }
}

/// `row[j] = exp(row[j] - sub)`, returning the row's new sum: two passes,
/// as one loop that also sums does not vectorise.
pub(crate) fn exp_sub_sum(row: &mut [f32], sub: f32) -> f32 {
    exp_sub(row, sub);
    sum(row)
}

dispatch! {
    /// The sum of a row.
    pub(crate) fn sum(row: &[f32]) -> f32 {
        let mut lanes = [0f32; LANES];
        let mut chunks = row.chunks_exact(LANES);
        for c in &mut chunks {
            for j in 0..LANES {
                lanes[j] += c[j];
            }
        }
        lanes.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
    }
}

dispatch! {
    /// `row[j] = exp(row[j] - sub)`.
    pub(crate) fn exp_sub(row: &mut [f32], sub: f32) -> () {
        for x in row.iter_mut() {
            *x = exp(*x - sub);
        }
    }
}

dispatch! {
    /// `p[j] = p[j] * (dp[j] - delta)`: the softmax's backward.
    pub(crate) fn softmax_grad(p: &mut [f32], dp: &[f32], delta: f32) -> () {
        for (p, &g) in p.iter_mut().zip(dp) {
            *p *= g - delta;
        }
    }
}

dispatch! {
    /// `dp[j] = p[j] * (dp[j] - delta) * scale`: the softmax's backward,
    /// written over the probabilities' gradient.
    pub(crate) fn softmax_grad_over(dp: &mut [f32], p: &[f32], delta: f32, scale: f32) -> () {
        for (g, &p) in dp.iter_mut().zip(p) {
            *g = p * (*g - delta) * scale;
        }
    }
}

dispatch! {
    /// The dot product of two rows.
    pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
        let mut lanes = [0f32; LANES];
        let (mut ca, mut cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
        for (x, y) in (&mut ca).zip(&mut cb) {
            for j in 0..LANES {
                lanes[j] += x[j] * y[j];
            }
        }
        let rest: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
        lanes.iter().sum::<f32>() + rest
    }
}

dispatch! {
    /// `row[j] *= factor`.
    pub(crate) fn scale(row: &mut [f32], factor: f32) -> () {
        for x in row.iter_mut() {
            *x *= factor;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_operations_equal_the_plain_loops() {
        let row: Vec<f32> = (0..37)
            .map(|i| ((i * 7919) % 101) as f32 / 10.0 - 5.0)
            .collect();
        let plain_max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(max(&row), plain_max);
        assert_eq!(max(&[]), f32::NEG_INFINITY);

        let mut e = row.clone();
        let sum = exp_sub_sum(&mut e, plain_max);
        let want: Vec<f32> = row.iter().map(|x| (x - plain_max).exp()).collect();
        for (g, w) in e.iter().zip(&want) {
            assert!((g - w).abs() <= 2.0 * f32::EPSILON * w, "{g} vs {w}");
        }
        assert!((sum - want.iter().sum::<f32>()).abs() < 1e-5);

        let mut e2 = row.clone();
        exp_sub(&mut e2, plain_max);
        assert_eq!(e, e2);

        let d = dot(&row, &want);
        let plain: f64 = row
            .iter()
            .zip(&want)
            .map(|(a, b)| *a as f64 * *b as f64)
            .sum();
        assert!((d as f64 - plain).abs() < 1e-4, "{d} vs {plain}");

        let mut p = want.clone();
        softmax_grad(&mut p, &row, 0.5);
        for ((g, w), r) in p.iter().zip(&want).zip(&row) {
            assert_eq!(*g, w * (r - 0.5));
        }
        let mut s = row.clone();
        scale(&mut s, 3.0);
        for (g, r) in s.iter().zip(&row) {
            assert_eq!(*g, r * 3.0);
        }
    }
}
