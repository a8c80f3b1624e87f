//! Accumulation that owns its optimizer.

use candle_core::{Result, Tensor};
use candle_nn::Optimizer;

use crate::GradAccumulator;

/// An optimizer stepped with accumulated gradients: `accumulate` each
/// micro-batch's mean loss with its rows, `step` once the batch is complete.
///
/// ```
/// use candle_accumulate::Accumulating;
/// use candle_core::{Device, Tensor, Var};
/// use candle_nn::{Optimizer, SGD};
/// let w = Var::new(&[0f32], &Device::Cpu)?;
/// let sgd = SGD::new(vec![w.clone()], 0.5)?;
/// let mut acc = Accumulating::new(sgd, vec![w.clone()], 3);
/// acc.accumulate(&(w.as_tensor() * 2.0)?.sum_all()?, 2)?;
/// assert_eq!(acc.pending(), 2);
/// assert!(acc.step().is_err()); // 1 row missing
/// acc.accumulate(&(w.as_tensor() * 2.0)?.sum_all()?, 1)?;
/// acc.step()?;
/// assert_eq!(w.to_vec1::<f32>()?, [-1.0]); // 0 - 0.5 * 2
/// assert_eq!(acc.pending(), 0);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug)]
pub struct Accumulating<O: Optimizer> {
    optimizer: O,
    grads: GradAccumulator,
}

impl<O: Optimizer> Accumulating<O> {
    /// `optimizer` over `vars`, stepped once per batch of `batch_rows` rows.
    pub fn new(optimizer: O, vars: Vec<candle_core::Var>, batch_rows: usize) -> Self {
        Self {
            optimizer,
            grads: GradAccumulator::new(vars, batch_rows),
        }
    }

    /// Back-propagates a micro-batch's mean loss over `rows` rows.
    pub fn accumulate(&mut self, loss: &Tensor, rows: usize) -> Result<()> {
        self.grads.backward(loss, rows)
    }

    /// Rows accumulated and not yet stepped.
    pub fn pending(&self) -> usize {
        self.grads.rows()
    }

    /// Steps the optimizer with the batch's gradients; an error until the
    /// batch is complete.
    pub fn step(&mut self) -> Result<()> {
        let grads = self.grads.take()?;
        self.optimizer.step(&grads)
    }

    /// Drops the pending gradients.
    pub fn reset(&mut self) {
        self.grads.reset()
    }

    /// The accumulator (to change the batch's rows).
    pub fn accumulator(&mut self) -> &mut GradAccumulator {
        &mut self.grads
    }

    /// The optimizer.
    pub fn optimizer(&mut self) -> &mut O {
        &mut self.optimizer
    }
}
