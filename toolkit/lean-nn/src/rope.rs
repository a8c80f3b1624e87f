//! Rotary position embeddings with a backward.

use candle_core::{bail, DType, Device, Result, Tensor};
use candle_custom_grad::{with_backward1, Backward1};

/// Rotary position embeddings as Llama-family models apply them (the
/// halves of each head rotated, `x * cos + rotate_half(x) * sin`), on `x`
/// `(batch, heads, seq, head_dim)` with tables `cos` and `sin` `(seq,
/// head_dim / 2)` ([`RopeConfig::tables`]). The forward is candle-nn's fused
/// `rotary_emb::rope`, which has no backward of its own; the backward is
/// the inverse rotation of the gradient (the same kernel with `-sin`), so
/// nothing beyond the input and the shared tables is kept. candle-nn's
/// differentiable `rope_slow` keeps a rotated copy of the input too.
///
/// ```
/// use candle_core::{DType, Device, Tensor, Var};
/// let dev = Device::Cpu;
/// let (cos, sin) = candle_lean_nn::RopeConfig { positions: 4, head_dim: 8, theta: 10_000.0 }.tables(DType::F32, &dev)?;
/// let x = Var::randn(0f32, 1.0, (1, 2, 4, 8), &dev)?;
/// let lean = candle_lean_nn::rope(&x, &cos, &sin)?;
/// let plain = candle_nn::rotary_emb::rope_slow(&x, &cos, &sin)?;
/// assert!((&lean - &plain)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-6);
/// let g = lean.sqr()?.sum_all()?.backward()?;
/// assert!(g.get(&x).is_some());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    check(x, cos, sin)?;
    let x = x.contiguous()?;
    let out = candle_nn::rotary_emb::rope(&x.detach(), cos, sin)?;
    with_backward1(
        out,
        &x,
        Rope {
            cos: cos.clone(),
            sin: sin.clone(),
        },
    )
}

/// The gradient of [`rope`]'s input from its output's gradient: the
/// inverse rotation.
pub fn rope_backward(grad: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    candle_nn::rotary_emb::rope(&grad.contiguous()?, cos, &sin.neg()?)
}

/// The rotation of [`rope`]: how many positions, the head size, and the
/// base of the angles (`rope_theta` in a model's `config.json`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeConfig {
    /// Positions `0..positions` get a row of the tables.
    pub positions: usize,
    /// The head size: even, the halves rotated against each other.
    pub head_dim: usize,
    /// The base: angle `p / theta^(2i / head_dim)`.
    pub theta: f64,
}

impl RopeConfig {
    /// The tables `cos` and `sin` `(positions, head_dim / 2)`, computed in
    /// f32 and given in `dtype`.
    pub fn tables(&self, dtype: DType, device: &Device) -> Result<(Tensor, Tensor)> {
        let RopeConfig {
            positions: seq,
            head_dim,
            theta,
        } = *self;
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            bail!("rotary embeddings rotate pairs: head_dim {head_dim} must be even and positive");
        }
        let half = head_dim / 2;
        let inv: Vec<f32> = (0..half)
            .map(|i| (1.0 / theta.powf(2.0 * i as f64 / head_dim as f64)) as f32)
            .collect();
        let inv = Tensor::from_vec(inv, (1, half), device)?;
        let pos = Tensor::arange(0u32, seq as u32, device)?
            .to_dtype(DType::F32)?
            .reshape((seq, 1))?;
        let angles = pos.broadcast_mul(&inv)?;
        Ok((
            angles.cos()?.to_dtype(dtype)?,
            angles.sin()?.to_dtype(dtype)?,
        ))
    }
}

fn check(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<()> {
    let (_, _, seq, d) = x.dims4()?;
    if cos.dims() != sin.dims() || cos.rank() != 2 || cos.dim(0)? < seq || cos.dim(1)? * 2 != d {
        bail!(
            "rotary embeddings of input {:?} (batch, heads, seq, head_dim) need tables of \
             ({seq}.., {}), got cos {:?} and sin {:?}",
            x.dims(),
            d / 2,
            cos.dims(),
            sin.dims()
        );
    }
    if cos.dtype() != x.dtype() || sin.dtype() != x.dtype() {
        bail!(
            "rotary tables are {:?} for {:?} input: give them the input's dtype",
            cos.dtype(),
            x.dtype()
        );
    }
    Ok(())
}

struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Backward1 for Rope {
    fn backward(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        rope_backward(grad, &self.cos, &self.sin).map(Some)
    }
}
