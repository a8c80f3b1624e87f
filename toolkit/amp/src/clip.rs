//! Gradient clipping by the global norm.

use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Tensor, Var};

/// Scales the gradients of `vars` so that their global L2 norm is at most
/// `max_norm` (at least 0; `f64::INFINITY` leaves them as they are); returns
/// the norm before clipping. The squares are summed in
/// f32 on the device and read back once.
///
/// ```
/// use candle_core::{Device, Var};
/// let w = Var::new(&[3f32, 4.0], &Device::Cpu)?;
/// let mut grads = w.as_tensor().sqr()?.sum_all()?.backward()?; // gradient [6, 8]
/// let norm = candle_amp::clip_grad_norm(&mut grads, &[w.clone()], 5.0)?;
/// assert_eq!(norm, 10.0);
/// let g = grads.get(w.as_tensor()).unwrap().to_vec1::<f32>()?;
/// assert!((g[0] - 3.0).abs() < 1e-5 && (g[1] - 4.0).abs() < 1e-5);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn clip_grad_norm(grads: &mut GradStore, vars: &[Var], max_norm: f64) -> Result<f64> {
    // A negative bound would flip every gradient, a NaN one clip nothing
    // unseen. An infinite one clips nothing: torch's idiom for the norm alone.
    if max_norm.is_nan() || max_norm < 0.0 {
        candle_core::bail!(
            "max_norm is {max_norm}; allowed: a number from 0 (infinity: the norm alone)"
        );
    }
    let mut sum: Option<Tensor> = None;
    for var in vars {
        if let Some(g) = grads.get(var.as_tensor()) {
            let s = g.to_dtype(DType::F32)?.sqr()?.sum_all()?;
            sum = Some(match sum {
                Some(acc) => (acc + s)?,
                None => s,
            });
        }
    }
    let Some(sum) = sum else { return Ok(0.0) };
    let norm = f64::from(sum.to_scalar::<f32>()?).sqrt();
    if norm > max_norm {
        let factor = max_norm / (norm + 1e-6);
        for var in vars {
            if let Some(g) = grads.remove(var.as_tensor()) {
                grads.insert(var.as_tensor(), (g * factor)?);
            }
        }
    }
    Ok(norm)
}
