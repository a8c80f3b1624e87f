//! The emulation's `__half` and `__nv_bfloat16`, bit for bit: conversions
//! from f64 (rounded once, as `__double2half` and `__double2bfloat16`) and
//! from f32 (the half crate's) and from an int, each operation computed in
//! f64 and rounded once to the type (the correctly rounded result, which the
//! card's half-type arithmetic gives; its hsqrt is an approximation), and
//! the comparisons.
//!
//! The half crate's own conversions from f64 round twice, through f32 (f16
//! with F16C) or after dropping the f64's low 32 bits (bf16): a double just
//! past a tie between two of the type's values can come out on the wrong
//! side. [`nearest`] rounds once, from the half crate's answer and its
//! neighbours.

use std::path::Path;

use candle_toolkit_cuda_emulation::{compile, run_on_f64};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// What the harness writes for each pair.
const RESULTS: usize = 22;

/// A half type, through the half crate.
trait Half: Copy + PartialOrd {
    const NAME: &'static str;
    fn from_bits(bits: u16) -> Self;
    fn from_f64(x: f64) -> Self;
    fn from_f32(x: f32) -> Self;
    fn to_f64(self) -> f64;
    fn to_bits(self) -> u16;
    fn neg(self) -> Self;
    fn abs(self) -> Self;
    /// The largest finite value's bits.
    const MAX_BITS: u16;
    /// The exponent of the smallest normal value.
    const MIN_EXP: i32;
}

macro_rules! half_type {
    ($t:ty, $name:expr, $min_exp:expr) => {
        impl Half for $t {
            const NAME: &'static str = $name;
            const MIN_EXP: i32 = $min_exp;
            const MAX_BITS: u16 = <$t>::MAX.to_bits();
            fn from_bits(bits: u16) -> Self {
                <$t>::from_bits(bits)
            }
            fn from_f64(x: f64) -> Self {
                <$t>::from_f64(x)
            }
            fn from_f32(x: f32) -> Self {
                <$t>::from_f32(x)
            }
            fn to_f64(self) -> f64 {
                <$t>::to_f64(self)
            }
            fn to_bits(self) -> u16 {
                <$t>::to_bits(self)
            }
            fn neg(self) -> Self {
                -self
            }
            fn abs(self) -> Self {
                <$t>::from_bits(self.to_bits() & 0x7fff)
            }
        }
    };
}
half_type!(f16, "f16", -14);
half_type!(bf16, "bf16", -126);

/// The larger (`larger`) or smaller of two, +0 above -0, a NaN where
/// either is one.
fn max_nan<T: Half>(x: T, y: T, larger: bool) -> T {
    let (x64, y64) = (x.to_f64(), y.to_f64());
    if x64.is_nan() || y64.is_nan() {
        return T::from_f64(f64::NAN);
    }
    let x_first = if x64 == y64 {
        x64.is_sign_positive() == larger
    } else {
        (x64 > y64) == larger
    };
    if x_first {
        x
    } else {
        y
    }
}

/// The type's value nearest `x`, ties to the even one, past the largest
/// value's half spacing infinity: among the half crate's answer (at most
/// one value off) and its neighbours, the nearest. A distance is exact
/// where the double and the value are within a factor of 2 (Sterbenz);
/// nearer 0 it may round, which keeps the distances' order (rounding is
/// monotone) and makes no false tie there.
fn nearest<T: Half>(x: f64) -> T {
    let max = T::from_bits(T::MAX_BITS).to_f64();
    let below_max = T::from_bits(T::MAX_BITS - 1).to_f64();
    if x.is_nan() || x.abs() >= max + (max - below_max) / 2.0 {
        return T::from_f64(x);
    }
    let guess = T::from_f64(x).to_bits();
    let (sign, magnitude) = (guess & 0x8000, (guess & 0x7fff).min(T::MAX_BITS));
    let candidates = [
        magnitude.saturating_sub(1),
        magnitude,
        (magnitude + 1).min(T::MAX_BITS),
    ];
    let mut best = sign | magnitude;
    for m in candidates {
        let (c, b) = (T::from_bits(sign | m), T::from_bits(best));
        let (dc, db) = ((x - c.to_f64()).abs(), (x - b.to_f64()).abs());
        if dc < db || (dc == db && m & 1 == 0) {
            best = sign | m;
        }
    }
    T::from_bits(best)
}

fn want<T: Half>(a: f64, b: f64) -> [f64; RESULTS] {
    let (x, y) = (nearest::<T>(a), nearest::<T>(b));
    let (x64, y64) = (x.to_f64(), y.to_f64());
    let once = |v: f64| nearest::<T>(v).to_f64();
    [
        x64,
        T::from_f32(a as f32).to_f64(),
        once(x64 + y64),
        once(x64 - y64),
        once(x64 * y64),
        once(x64 / y64),
        once(x64.sqrt()),
        x.neg().to_f64(),
        x.abs().to_f64(),
        max_nan(x, y, true).to_f64(),
        max_nan(x, y, false).to_f64(),
        // The lanes of __hadd2 and __hmul2 of (x, y) and (y, y) (bf16's; the
        // scalar operations for f16).
        once(x64 + y64),
        once(y64 + y64),
        once(x64 * y64),
        once(y64 * y64),
        // From an int: a truncated and clamped to i32's range (an int has
        // no -0).
        once(f64::from(a.trunc().clamp(-2e9, 2e9) as i32)),
        f64::from(u8::from(x64 < y64)),
        f64::from(u8::from(x64 <= y64)),
        f64::from(u8::from(x64 > y64)),
        f64::from(u8::from(x64 >= y64)),
        f64::from(u8::from(x64 == y64)),
        f64::from(u8::from(x64 != y64)),
    ]
}

/// Every type's value, finite or not, but no NaN.
fn any_value<T: Half>(rng: &mut StdRng) -> f64 {
    loop {
        let v = T::from_bits(rng.random()).to_f64();
        if !v.is_nan() {
            return v;
        }
    }
}

/// A double where rounding is hard: one of the type's values, the midpoint
/// between two neighbours (a tie, which goes to the even one, below or
/// above), a double just above or below a midpoint (which a round trip
/// through f32 would make a tie), or any double between them; either sign.
fn hard_double<T: Half>(rng: &mut StdRng) -> f64 {
    let bits = rng.random_range(0..T::MAX_BITS);
    let (lo, hi) = (T::from_bits(bits).to_f64(), T::from_bits(bits + 1).to_f64());
    let mid = (lo + hi) / 2.0;
    let x = [
        lo,
        mid,
        mid.next_up(),
        mid.next_down(),
        rng.random_range(lo..hi),
    ][rng.random_range(0..5)];
    if rng.random() {
        x
    } else {
        -x
    }
}

/// One of the type's values with 1 to its digits' significant bits, times
/// 2^k for k in `exps`: where products and quotients fall among the
/// subnormals.
fn scaled<T: Half>(rng: &mut StdRng, exps: std::ops::RangeInclusive<i32>) -> f64 {
    let in_one_two = T::from_f64(rng.random_range(1.0..2.0)).to_f64();
    let sign = if rng.random() { 1.0 } else { -1.0 };
    sign * in_one_two * 2f64.powi(rng.random_range(exps))
}

fn check<T: Half>() {
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let n = 20_000;
    let mut pairs = Vec::with_capacity(2 * n);
    for i in 0..n {
        // Half the pairs of the type's own values (the arithmetic), half
        // with a hard double first (the rounding).
        let a = if i % 2 == 0 {
            any_value::<T>(&mut rng)
        } else {
            hard_double::<T>(&mut rng)
        };
        pairs.extend([a, any_value::<T>(&mut rng)]);
    }
    // Products and quotients among the subnormals (below 2^MIN_EXP).
    let (tiny, ones) = (T::MIN_EXP / 2 - 4..=T::MIN_EXP / 2 + 2, 0..=3);
    for _ in 0..2_000 {
        pairs.extend([
            scaled::<T>(&mut rng, tiny.clone()),
            scaled::<T>(&mut rng, tiny.clone()),
        ]);
        let below = T::MIN_EXP - 6..=T::MIN_EXP;
        pairs.extend([
            scaled::<T>(&mut rng, below),
            scaled::<T>(&mut rng, ones.clone()),
        ]);
    }
    // The zeros' signs (+0 above -0 in max and min, and equal), the
    // infinities, and past the largest value: half its spacing (a tie,
    // which goes to infinity) and just short of it.
    let inf = f64::INFINITY;
    let max = T::from_bits(T::MAX_BITS).to_f64();
    let half_spacing = (max - T::from_bits(T::MAX_BITS - 1).to_f64()) / 2.0;
    for (a, b) in [
        (0.0, -0.0),
        (-0.0, 0.0),
        (inf, -inf),
        (-inf, 0.0),
        (inf, inf),
        (max + half_spacing, 1.0),
        (-max - half_spacing, 1.0),
        ((max + half_spacing).next_down(), 1.0),
        ((-max - half_spacing).next_up(), 1.0),
    ] {
        pairs.extend([a, b]);
    }
    let exe = compile(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/halves/harness.cpp"));
    let count = (pairs.len() / 2).to_string();
    let got = run_on_f64(&exe, &[T::NAME, &count], &pairs);
    assert_eq!(got.len(), pairs.len() / 2 * RESULTS);
    const WHAT: [&str; RESULTS] = [
        "from f64",
        "from f32",
        "x + y",
        "x - y",
        "x * y",
        "x / y",
        "hsqrt",
        "-x",
        "__habs",
        "__hmax_nan",
        "__hmin_nan",
        "__hadd2's first lane",
        "__hadd2's second lane",
        "__hmul2's first lane",
        "__hmul2's second lane",
        "from an int",
        "x < y",
        "x <= y",
        "x > y",
        "x >= y",
        "x == y",
        "x != y",
    ];
    for (pair, got) in pairs.chunks(2).zip(got.chunks(RESULTS)) {
        let want = want::<T>(pair[0], pair[1]);
        for ((what, g), w) in WHAT.iter().zip(got).zip(want) {
            assert!(
                (g.is_nan() && w.is_nan()) || g.to_bits() == w.to_bits(),
                "{}: {what} of {:e} and {:e}: {g:e}, not {w:e}",
                T::NAME,
                pair[0],
                pair[1]
            );
        }
    }
}

#[test]
fn f16_converts_and_computes_as_the_half_crate_rounds() {
    check::<f16>();
}

#[test]
fn bf16_converts_and_computes_as_the_half_crate_rounds() {
    check::<bf16>();
}
