//! The layer's backward element-wise work on the CPU for f16 and bf16.
//!
//! Through candle's operations a half-precision GELU derivative is computed
//! in f32 over the whole input, a tensor per step (cube, tanh, its square,
//! products and sums): about a dozen tensors the size of the layer's output
//! at once. Here each row is widened into a scratch row, the derivative
//! applied as in f32 ([`crate::cpu`]'s kernel) and the result rounded once
//! into the one tensor returned; the bias's gradient is summed in f32 from
//! the rounded rows and rounded once.

use candle_core::{bail, DType, Device, Result, Tensor, WithDType};
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use crate::cpu::{act_grad_row, add_row, with_slice, ROWS_PER_TASK};
use crate::linear::Activation;

/// Whether [`act_backward`] takes `grad` and `saved`: contiguous f16 or
/// bf16 tensors of one dtype on the CPU.
pub(crate) fn applies(grad: &Tensor, saved: &Tensor) -> bool {
    saved.device().is_cpu()
        && matches!(saved.dtype(), DType::F16 | DType::BF16)
        && grad.dtype() == saved.dtype()
        && saved.is_contiguous()
        && saved.elem_count() > 0
}

/// The product's gradient `dz = grad * act'` `(rows, n)` and the bias's
/// gradient, in the inputs' half dtype (see the module).
pub(crate) fn act_backward(
    grad: &Tensor,
    saved: &Tensor,
    act: Activation,
) -> Result<(Tensor, Tensor)> {
    if act == Activation::Identity {
        let db = grad.sum(0)?;
        return Ok((grad.clone(), db));
    }
    let grad = grad.contiguous()?;
    match saved.dtype() {
        DType::BF16 => typed::<half::bf16>(&grad, saved, act),
        DType::F16 => typed::<half::f16>(&grad, saved, act),
        other => bail!("internal: the half-precision kernel got {other:?}"),
    }
}

fn typed<T>(grad: &Tensor, saved: &Tensor, act: Activation) -> Result<(Tensor, Tensor)>
where
    T: WithDType,
    [T]: HalfFloatSliceExt,
{
    let (rows, n) = grad.dims2()?;
    let gelu_input = act == Activation::Gelu;
    let mut dz = vec![T::from_f64(0.0); rows * n];
    let db = with_slice::<T, _>(grad, |g| {
        with_slice::<T, _>(saved, |s| {
            dz.par_chunks_mut(n * ROWS_PER_TASK)
                .zip(g.par_chunks(n * ROWS_PER_TASK))
                .zip(s.par_chunks(n * ROWS_PER_TASK))
                .fold(
                    || Scratch::new(n),
                    |mut w, ((dz, g), s)| {
                        for ((dz, g), s) in dz
                            .chunks_exact_mut(n)
                            .zip(g.chunks_exact(n))
                            .zip(s.chunks_exact(n))
                        {
                            g.convert_to_f32_slice(&mut w.g);
                            s.convert_to_f32_slice(&mut w.s);
                            act_grad_row(&w.g, &w.s, &mut w.d, gelu_input);
                            dz.convert_from_f32_slice(&w.d);
                            // The bias's gradient from the rounded values:
                            // the column sums of the `dz` returned.
                            dz.convert_to_f32_slice(&mut w.d);
                            add_row(&mut w.db, &w.d);
                        }
                        w
                    },
                )
                .map(|w| w.db)
                .reduce(
                    || vec![0f32; n],
                    |mut a, b| {
                        add_row(&mut a, &b);
                        a
                    },
                )
        })
    })??;
    let mut db_half = vec![T::from_f64(0.0); n];
    db_half.convert_from_f32_slice(&db);
    Ok((
        Tensor::from_vec(dz, (rows, n), &Device::Cpu)?,
        Tensor::from_vec(db_half, n, &Device::Cpu)?,
    ))
}

/// One task's rows in f32, and its share of the bias's gradient.
struct Scratch {
    g: Vec<f32>,
    s: Vec<f32>,
    d: Vec<f32>,
    db: Vec<f32>,
}

impl Scratch {
    fn new(n: usize) -> Self {
        Self {
            g: vec![0.0; n],
            s: vec![0.0; n],
            d: vec![0.0; n],
            db: vec![0.0; n],
        }
    }
}
