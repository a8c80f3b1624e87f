//! Helpers shared by the test files.

use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Tensor, Var};

/// The largest absolute difference of two tensors, in f64.
pub fn max_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    (a.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f64>()
}

/// The largest difference between two stores' gradients of `vars`.
pub fn worst(a: &GradStore, b: &GradStore, vars: &[Var]) -> Result<f64> {
    let mut w = 0f64;
    for v in vars {
        let (x, y) = (a.get(v.as_tensor()), b.get(v.as_tensor()));
        w = w.max(max_diff(x.expect("a gradient"), y.expect("a gradient"))?);
    }
    Ok(w)
}
