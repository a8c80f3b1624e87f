//! What the crate's tests share.

// Each test crate compiles this module and uses part of it.
#![allow(dead_code)]

use candle_core::{DType, Device, Result, Tensor, Var};

/// The largest absolute difference of `a` and `b`, in f64.
pub fn max_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    (a.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f64>()
}

/// Deterministic values in about [-scale, scale] (candle's CPU generator
/// cannot be seeded).
pub fn data(shape: &[usize], scale: f32, seed: u64) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n as u64)
        .map(|i| {
            let k = (i + 1).wrapping_mul(seed.wrapping_mul(2654435761) | 1) % 1_000_003;
            ((k as f32 / 1_000_003.0) * 2.0 - 1.0) * scale
        })
        .collect();
    Tensor::from_vec(values, shape, &Device::Cpu)
}

/// [`data`] as a variable in `dtype`.
pub fn var(shape: &[usize], scale: f32, seed: u64, dtype: DType) -> Result<Var> {
    Var::from_tensor(&data(shape, scale, seed)?.to_dtype(dtype)?)
}

/// Class labels for `rows` rows, spread over `classes`.
pub fn targets(rows: usize, classes: usize) -> Result<Tensor> {
    let t: Vec<u32> = (0..rows as u32)
        .map(|i| (i * 7919 + 3) % classes as u32)
        .collect();
    Tensor::new(t, &Device::Cpu)
}
