//! Element-wise f32 functions that vectorise, a way to compile a loop for
//! the widest vector unit the CPU has, one slice added into another
//! ([`add_assign`], [`par_add_assign`]), and scratch for a parallel loop's
//! tasks that holds the same bytes every run ([`WorkerScratch`]).
//!
//! libm's `expf` and `tanhf` are calls the compiler cannot vectorise. The
//! functions here are plain arithmetic (Cephes' polynomials), inlined, so
//! that a loop over a slice becomes vector code: write the loop once inside
//! [`dispatch!`], which compiles it for AVX-512, for AVX2 and for the
//! baseline, and calls the widest at run time. Rust never fuses a multiply
//! and an add on its own, so the three give the same bits.
//!
//! ```
//! candle_cpu_math::dispatch! {
//!     /// `row[i] = exp(row[i])`.
//!     pub fn exp_all(row: &mut [f32]) -> () {
//!         for x in row.iter_mut() {
//!             *x = candle_cpu_math::exp(*x);
//!         }
//!     }
//! }
//! let mut v = [0.0f32, 1.0, f32::NEG_INFINITY];
//! exp_all(&mut v);
//! assert_eq!(v[0], 1.0);
//! assert!((v[1] - std::f32::consts::E).abs() < 1e-6);
//! assert_eq!(v[2], 0.0);
//! ```
#![warn(missing_docs)]

mod add;
mod scratch;

pub use add::{add_assign, par_add_assign};
pub use scratch::WorkerScratch;

/// Below this, `exp` is zero in f32.
const EXP_MIN: f32 = -87.336_55;
/// Above this, `exp` overflows f32.
const EXP_MAX: f32 = 88.376_26;

/// `e^x`, within 2 ulp of libm's; 0 below about -87.3 (minus infinity
/// included) and clamped at about 88.4, where f32 overflows.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
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

/// `tanh(x)`, within 3 ulp of libm's: Cephes' odd polynomial below 0.625 in
/// magnitude (where `1 - 2 / (e^2x + 1)` would cancel), that form above.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let a = x.abs();
    let z = x * x;
    let mut p = -5.704_988_7e-3;
    p = p * z + 2.063_909e-2;
    p = p * z - 5.373_971_6e-2;
    p = p * z + 0.133_314_42;
    p = p * z - 0.333_332_8;
    let small = p * z * x + x;
    let large = 1.0 - 2.0 / (exp(2.0 * a) + 1.0);
    if a < 0.625 {
        small
    } else {
        large.copysign(x)
    }
}

/// `sqrt(2 / pi)`, as candle's GELU has it.
const SQRT_TWO_OVER_PI: f32 = 0.797_884_6;

/// GELU in its tanh approximation, as candle's `Tensor::gelu` computes it:
/// `0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2)))`.
#[inline(always)]
pub fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + tanh(SQRT_TWO_OVER_PI * x * (1.0 + 0.044715 * x * x)))
}

/// The derivative of [`gelu`]: 1 above 10 and 0 below -10, where it is so
/// in f32 (and where `x^2` could overflow).
#[inline(always)]
pub fn gelu_grad(x: f32) -> f32 {
    let x2 = x * x;
    let t = tanh(SQRT_TWO_OVER_PI * x * (1.0 + 0.044715 * x2));
    let inner = SQRT_TWO_OVER_PI * (1.0 + 3.0 * 0.044715 * x2);
    let d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * inner;
    if x > 10.0 {
        1.0
    } else if x < -10.0 {
        0.0
    } else {
        d
    }
}

/// Compiles the function it wraps three times (AVX-512, AVX2, the baseline)
/// and calls the widest the CPU has, detected at run time.
///
/// The body is an ordinary function body; loops over slices in it are
/// vectorised at each width. Float sums and maxima are not reassociated by
/// the compiler: keep several partial results in an array to vectorise
/// them.
#[macro_export]
macro_rules! dispatch {
    ($(#[$doc:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty $body:block) => {
        $(#[$doc])*
        $vis fn $name($($arg: $ty),*) -> $ret {
            #[inline(always)]
            fn plain($($arg: $ty),*) -> $ret $body

            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512($($arg: $ty),*) -> $ret {
                    plain($($arg),*)
                }
                #[target_feature(enable = "avx2")]
                unsafe fn avx2($($arg: $ty),*) -> $ret {
                    plain($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has the features the function is compiled for.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: as above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            plain($($arg),*)
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulp(a: f32, b: f32) -> u32 {
        if a == b {
            return 0;
        }
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_is_within_two_ulp_of_libm() {
        let mut worst = 0;
        let mut x = -87.0f32;
        while x < 88.0 {
            worst = worst.max(ulp(exp(x), x.exp()));
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
    fn tanh_is_within_three_ulp_of_libm() {
        let mut worst = 0;
        let mut x = -12.0f32;
        while x < 12.0 {
            worst = worst.max(ulp(tanh(x), x.tanh()));
            x += 0.000_37;
        }
        for x in [
            0.0f32, -0.0, 1e-30, -1e-30, 1e-4, 0.624_99, 0.625, 30.0, -30.0,
        ] {
            worst = worst.max(ulp(tanh(x), x.tanh()));
        }
        assert!(worst <= 3, "{worst} ulp");
    }

    #[test]
    fn gelu_and_its_derivative_match_the_plain_formulas() {
        let mut x = -10.0f32;
        while x < 10.0 {
            let k = (2.0f64 / std::f64::consts::PI).sqrt();
            let xd = x as f64;
            let t = (k * xd * (1.0 + 0.044715 * xd * xd)).tanh();
            let g = 0.5 * xd * (1.0 + t);
            let dg =
                0.5 * (1.0 + t) + 0.5 * xd * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * xd * xd);
            assert!(
                (gelu(x) as f64 - g).abs() <= 1e-6 * (1.0 + g.abs()),
                "gelu({x})"
            );
            assert!((gelu_grad(x) as f64 - dg).abs() <= 1e-6, "gelu'({x})");
            x += 0.013;
        }
        for x in [1e20f32, -1e20, f32::MAX, f32::MIN] {
            assert_eq!(gelu_grad(x), if x > 0.0 { 1.0 } else { 0.0 }, "gelu'({x})");
        }
    }

    dispatch! {
        /// A sum with lanes, compiled at each width.
        fn lane_sum(v: &[f32]) -> f32 {
            let mut lanes = [0f32; 16];
            let mut chunks = v.chunks_exact(16);
            for c in &mut chunks {
                for j in 0..16 {
                    lanes[j] += c[j];
                }
            }
            lanes.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
        }
    }

    #[test]
    fn a_dispatched_function_computes_what_its_body_says() {
        let v: Vec<f32> = (0..101).map(|i| i as f32).collect();
        assert_eq!(lane_sum(&v), 5050.0);
    }
}
