//! Finding an inf or NaN among many tensors with one read back.

use candle_core::{DType, Result, Tensor};

/// Collects tensors and says whether any holds an inf or NaN, reading one
/// number back from the device for all of them: each tensor times zero
/// (an inf or NaN makes NaN, any other value 0) is summed there, and the
/// sums are added up there. [`GradScaler::unscale`](crate::GradScaler::unscale)
/// checks a step's gradients with it, and an optimizer that holds its own
/// gradient blocks (a ZeRO one) can check those before it agrees with the
/// other ranks.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let mut check = candle_amp::InfCheck::default();
/// check.add(&Tensor::new(&[1f32, 2.0], &Device::Cpu)?)?;
/// check.add(&Tensor::new(&[f32::INFINITY], &Device::Cpu)?)?;
/// assert_eq!(check.found()?, Some(true));
/// assert_eq!(candle_amp::InfCheck::default().found()?, None);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Default)]
pub struct InfCheck {
    sum: Option<Tensor>,
}

impl InfCheck {
    /// Adds `t` (any float dtype) to the check, on its device; nothing is
    /// read back yet.
    pub fn add(&mut self, t: &Tensor) -> Result<()> {
        let probe = t.affine(0.0, 0.0)?.to_dtype(DType::F32)?.sum_all()?;
        self.sum = Some(match self.sum.take() {
            Some(sum) => (sum + probe)?,
            None => probe,
        });
        Ok(())
    }

    /// Whether any tensor added holds an inf or NaN, or `None` when none
    /// was added: the caller's own error ("nothing to check") tells the
    /// user more than a `false` would.
    pub fn found(self) -> Result<Option<bool>> {
        match self.sum {
            Some(sum) => Ok(Some(!sum.to_scalar::<f32>()?.is_finite())),
            None => Ok(None),
        }
    }
}
