//! Row operations of the kernel, vectorised.
//!
//! Each function has one plain body that LLVM vectorises; on x86-64 the same
//! body is also compiled for AVX-512 and for AVX2 with FMA, and the widest
//! the CPU has is chosen at run time: the default target (SSE2) gives a
//! quarter of AVX-512's width. The exponential is a
//! polynomial (Cephes' `expf`, within 2 ulp) rather than libm's, which does
//! not vectorise: the softmax spends a third of its time in it otherwise.

/// Below this, `exp` is zero in f32 (and masked scores are minus infinity).
const EXP_MIN: f32 = -87.336_55;
const EXP_MAX: f32 = 88.376_26;

/// `exp(x)` for `x <= EXP_MAX`; zero below `EXP_MIN`, minus infinity included.
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 in two parts, so that `x - n ln 2` loses no bits.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let c = x.clamp(EXP_MIN, EXP_MAX);
    let shifted = c * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = c - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_2e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // 2^n: n + 127 in the exponent field.
    let n_bits = shifted.to_bits().wrapping_sub(ROUND.to_bits());
    let two_n = f32::from_bits(n_bits.wrapping_add(127) << 23);
    if x < EXP_MIN {
        0.0
    } else {
        y * two_n
    }
}

/// Sixteen partial results at a time: float sums and maxima are not
/// reassociated by the compiler, so lanes are written out.
const LANES: usize = 16;

macro_rules! dispatch {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty $body:block) => {
        $(#[$doc])*
        pub(crate) fn $name($($arg: $ty),*) -> $ret {
            #[inline(always)]
            fn plain($($arg: $ty),*) -> $ret $body

            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512($($arg: $ty),*) -> $ret {
                    plain($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) -> $ret {
                    plain($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has the features the function is compiled for.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: as above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            plain($($arg),*)
        }
    };
}

dispatch! {
    /// The largest element; minus infinity for an empty or fully masked row.
    fn max(row: &[f32]) -> f32 {
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
    fn sum(row: &[f32]) -> f32 {
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
    fn exp_sub(row: &mut [f32], sub: f32) -> () {
        for x in row.iter_mut() {
            *x = exp(*x - sub);
        }
    }
}

dispatch! {
    /// `p[j] = p[j] * (dp[j] - delta)`: the softmax's backward.
    fn softmax_grad(p: &mut [f32], dp: &[f32], delta: f32) -> () {
        for (p, &g) in p.iter_mut().zip(dp) {
            *p *= g - delta;
        }
    }
}

dispatch! {
    /// The dot product of two rows.
    fn dot(a: &[f32], b: &[f32]) -> f32 {
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
    fn scale(row: &mut [f32], factor: f32) -> () {
        for x in row.iter_mut() {
            *x *= factor;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_libm() {
        let mut worst = 0u32;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (exp(x), x.exp());
            worst = worst.max(got.to_bits().abs_diff(want.to_bits()));
            x += 0.001_7;
        }
        assert!(worst <= 2, "{worst} ulp");
    }

    #[test]
    fn exp_of_minus_infinity_and_far_below_is_zero() {
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(0.0), 1.0);
    }

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
