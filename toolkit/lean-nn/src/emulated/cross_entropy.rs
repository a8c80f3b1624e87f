//! The cross-entropy's kernels (`kernels/cross_entropy.cu`), run on the CPU
//! by `tests/emulated/cross_entropy.cpp`, against the plain computation in
//! f64 and against the CPU's row kernels (`crate::cpu`), in every dtype and
//! for several launch shapes. Their sums are a block's reduction, in
//! another order than the CPU's: the values are compared to their
//! precision, not to the bit.

use candle_core::{DType, Device, Result, Tensor};
use candle_toolkit_cuda_emulation::{run_on_f64, Build};

use super::{bits, harness, values};

const ROWS: usize = 37;
/// Not a multiple of any block's threads: the last pass is partial.
const CLASSES: usize = 1000;
/// Blocks and threads: fewer blocks than rows (a block takes several), a
/// single warp, and a block whose warps outnumber those of the first.
const LAUNCHES: [(u32, u32); 3] = [(5, 64), (1, 32), (3, 256)];
const DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

/// A repeatable value in (-1, 1) for `i`.
fn noise(i: usize) -> f64 {
    let mut x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 29;
    (x >> 11) as f64 / (1u64 << 52) as f64 - 1.0
}

/// Logits of a few units, as `dtype` rounds them; row 1 shifted by 100
/// (the softmax does not move) and row 2 constant.
fn logits(dtype: DType) -> Result<Tensor> {
    let z: Vec<f32> = (0..ROWS * CLASSES)
        .map(|i| match i / CLASSES {
            1 => 100.0 + 4.0 * noise(i) as f32,
            2 => 0.5,
            _ => 4.0 * noise(i) as f32,
        })
        .collect();
    Tensor::from_vec(z, (ROWS, CLASSES), &Device::Cpu)?.to_dtype(dtype)
}

/// Class indices, the first and the last among them.
fn targets() -> Vec<u32> {
    (0..ROWS)
        .map(|r| match r {
            0 => 0,
            3 => CLASSES as u32 - 1,
            _ => (r * 7919 % CLASSES) as u32,
        })
        .collect()
}

/// Runs `kernel` on `z` and `targets` with the launch `(blocks, threads)`.
fn run(
    build: Build,
    kernel: &str,
    (blocks, threads): (u32, u32),
    (z, rows): (&[f64], usize),
    targets: &[u32],
    scale: f64,
) -> Vec<f64> {
    let input: Vec<f64> = z
        .iter()
        .copied()
        .chain(targets.iter().map(|&t| f64::from(t)))
        .collect();
    let classes = z.len() / rows;
    run_on_f64(
        &harness("cross_entropy", build),
        &[
            kernel,
            &blocks.to_string(),
            &threads.to_string(),
            &rows.to_string(),
            &classes.to_string(),
            &scale.to_string(),
        ],
        &input,
    )
}

/// Row `r`'s logits.
fn row(z: &[f64], r: usize) -> &[f64] {
    &z[r * CLASSES..(r + 1) * CLASSES]
}

/// The row's maximum and `ln(sum(exp(z - max)))`, in f64.
fn stats(z: &[f64]) -> (f64, f64) {
    let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (max, z.iter().map(|&v| (v - max).exp()).sum::<f64>().ln())
}

/// How far a kernel computed in `dtype`'s accumulation (f32, or f64) may
/// be from the f64 value, relative to the magnitudes it sums or scales; how
/// far a value rounded to `dtype` may be, relative to itself; and how far
/// below the normal range (half of f16's subnormal spacing).
fn tolerances(dtype: DType) -> (f64, f64, f64) {
    match dtype {
        DType::F64 => (1e-13, 0.0, 0.0),
        DType::F32 => (1e-5, 0.0, 0.0),
        // Half an ulp of the element type, and the f32 arithmetic's share.
        DType::F16 => (1e-5, 2f64.powi(-11), 2f64.powi(-25)),
        _ => (1e-5, 2f64.powi(-8), 0.0),
    }
}

/// The plain gradient of row `r` of `z` against `t`, times `scale`, and
/// the magnitude each element's arithmetic scales: `scale * (p + onehot)`.
fn plain_grad(z: &[f64], r: usize, t: u32, scale: f64) -> Vec<(f64, f64)> {
    let z = row(z, r);
    let (max, lse) = stats(z);
    z.iter()
        .enumerate()
        .map(|(c, &v)| {
            let p = (v - max - lse).exp();
            let onehot = f64::from(u8::from(c == t as usize));
            (scale * (p - onehot), scale * (p + onehot))
        })
        .collect()
}

#[test]
fn each_rows_loss_is_the_plain_computations_in_every_dtype_and_launch() -> Result<()> {
    let t = targets();
    for dtype in DTYPES {
        let z = values(&logits(dtype)?);
        let (acc, ..) = tolerances(dtype);
        for launch in LAUNCHES {
            let name = format!("cross_entropy_loss_{}", dtype.as_str());
            let got = run(Build::Plain, &name, launch, (&z, ROWS), &t, 1.0);
            assert_eq!(got.len(), ROWS, "{name}: a loss per row");
            for (r, (&got, &t)) in got.iter().zip(&t).enumerate() {
                let (max, lse) = stats(row(&z, r));
                let zt = row(&z, r)[t as usize];
                let want = max + lse - zt;
                let bound = acc * (max.abs() + lse.abs() + zt.abs());
                assert!(
                    (got - want).abs() <= bound,
                    "{name} {launch:?}, row {r}: {got} for {want} (within {bound:e})"
                );
            }
        }
    }
    Ok(())
}

#[test]
fn the_gradient_is_the_plain_computations_in_every_dtype_and_launch() -> Result<()> {
    let t = targets();
    // A micro-batch's share of a loss scale: the factor is not 1.
    let scale = 0.375 / ROWS as f64;
    for dtype in DTYPES {
        let z = values(&logits(dtype)?);
        let (acc, rounded, subnormal) = tolerances(dtype);
        for launch in LAUNCHES {
            let name = format!("cross_entropy_grad_{}", dtype.as_str());
            let got = run(Build::Plain, &name, launch, (&z, ROWS), &t, scale);
            assert_eq!(got.len(), z.len(), "{name}: the logits' shape");
            for (r, &t) in t.iter().enumerate() {
                let want = plain_grad(&z, r, t, scale);
                for (c, (&g, &(want, magnitude))) in row(&got, r).iter().zip(&want).enumerate() {
                    let bound = rounded * want.abs() + acc * magnitude + subnormal;
                    assert!(
                        (g - want).abs() <= bound,
                        "{name} {launch:?}, row {r} class {c}: {g} for {want} (within {bound:e})"
                    );
                }
            }
        }
    }
    Ok(())
}

#[test]
fn the_kernels_agree_with_the_cpus_row_kernels() -> Result<()> {
    let t = targets();
    let scale = 1.0 / ROWS as f32;
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let logits = logits(dtype)?;
        let z = values(&logits);
        let (acc, rounded, subnormal) = tolerances(dtype);
        let suffix = dtype.as_str();
        let losses = run(
            Build::Plain,
            &format!("cross_entropy_loss_{suffix}"),
            LAUNCHES[0],
            (&z, ROWS),
            &t,
            1.0,
        );
        let cpu = crate::cpu::cross_entropy_sum(&logits, &t)?;
        let sum: f64 = losses.iter().sum();
        let magnitude: f64 = (0..ROWS)
            .map(|r| {
                let (max, lse) = stats(row(&z, r));
                max.abs() + lse.abs() + row(&z, r)[t[r] as usize].abs()
            })
            .sum();
        // Each side within `acc` of the plain computation.
        let bound = 2.0 * acc * magnitude;
        assert!(
            (sum - cpu).abs() <= bound,
            "{dtype:?}: {sum} by the kernel, {cpu} by the CPU (within {bound:e})"
        );
        let grad = run(
            Build::Plain,
            &format!("cross_entropy_grad_{suffix}"),
            LAUNCHES[0],
            (&z, ROWS),
            &t,
            f64::from(scale),
        );
        let cpu = values(&crate::cpu::cross_entropy_grad(&logits, &t, scale)?);
        let magnitudes = (0..ROWS).flat_map(|r| plain_grad(&z, r, t[r], f64::from(scale)));
        for (i, ((&g, &c), (_, magnitude))) in grad.iter().zip(&cpu).zip(magnitudes).enumerate() {
            // Each within its bound of the plain computation.
            let bound = 2.0 * (rounded * c.abs() + acc * magnitude + subnormal);
            assert!(
                (g - c).abs() <= bound,
                "{dtype:?}, element {i}: {g} by the kernel, {c} by the CPU (within {bound:e})"
            );
        }
    }
    Ok(())
}

#[test]
fn a_nan_logit_makes_its_row_nan_and_no_other() {
    let (rows, classes) = (3, 70);
    let mut z: Vec<f64> = (0..rows * classes).map(noise).collect();
    z[classes + 5] = f64::NAN;
    let t = [1, 2, 3];
    for dtype in DTYPES {
        let suffix = dtype.as_str();
        let loss = run(
            Build::Plain,
            &format!("cross_entropy_loss_{suffix}"),
            (2, 32),
            (&z, rows),
            &t,
            1.0,
        );
        let grad = run(
            Build::Plain,
            &format!("cross_entropy_grad_{suffix}"),
            (2, 32),
            (&z, rows),
            &t,
            1.0,
        );
        assert!(
            loss[1].is_nan(),
            "{dtype:?}: the loss of the row with a NaN is {}",
            loss[1]
        );
        assert!(
            loss[0].is_finite() && loss[2].is_finite(),
            "{dtype:?}: {loss:?}"
        );
        for (r, row) in grad.chunks(classes).enumerate() {
            let nans = row.iter().filter(|g| g.is_nan()).count();
            let want = if r == 1 { classes } else { 0 };
            assert_eq!(nans, want, "{dtype:?}: NaNs in row {r}'s gradient");
        }
    }
}

#[test]
fn no_two_threads_of_a_block_race() {
    let (rows, classes) = (3, 150);
    let z: Vec<f64> = (0..rows * classes).map(noise).collect();
    let t = [0, 149, 77];
    // Two warps: their partials meet in shared memory, which the sum then
    // reuses after the maximum.
    let launch = (2, 64);
    for kernel in ["cross_entropy_loss_f32", "cross_entropy_grad_f32"] {
        let raced = run(Build::RaceChecked, kernel, launch, (&z, rows), &t, 0.5);
        // A race that the sanitizer misses may still change a value: the
        // plain build's are held to the plain computation above.
        let plain = run(Build::Plain, kernel, launch, (&z, rows), &t, 0.5);
        assert_eq!(bits(&raced), bits(&plain), "{kernel}");
    }
    let losses = run(
        Build::Plain,
        "cross_entropy_loss_f32",
        launch,
        (&z, rows),
        &t,
        1.0,
    );
    for (r, (&got, &t)) in losses.iter().zip(&t).enumerate() {
        let z: Vec<f64> = z[r * classes..(r + 1) * classes]
            .iter()
            .map(|&v| f64::from(v as f32))
            .collect();
        let (max, lse) = stats(&z);
        let want = max + lse - z[t as usize];
        assert!(
            (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
            "row {r}: {got} for {want}"
        );
    }
}
