//! Summing micro-batch gradients with row weights.

use std::collections::HashSet;

use candle_core::backprop::GradStore;
use candle_core::{bail, Result, Tensor, TensorId, Var};
use candle_observe::{within, Kind, NoObserver, Observer, Place};

/// Sums the gradients of a batch's micro-batches, each weighted by its share
/// of the batch's rows, keeping only the model's variables (detached).
///
/// ```
/// use candle_accumulate::GradAccumulator;
/// use candle_core::{Device, Tensor, Var};
/// let dev = Device::Cpu;
/// let w = Var::new(&[0f32], &dev)?;
/// // Mean of (w - x) over 3 rows, in micro-batches of 2 and 1 rows.
/// let rows = Tensor::new(&[1f32, 2.0, 6.0], &dev)?;
/// let mut acc = GradAccumulator::new(vec![w.clone()], 3);
/// for part in candle_accumulate::micro_batches(&rows, 2)? {
///     let loss = w.as_tensor().broadcast_sub(&part)?.mean_all()?;
///     acc.backward(&loss, part.dim(0)?)?;
/// }
/// // d/dw of the full batch's mean is 1, whatever the split.
/// assert_eq!(acc.grads()?.get(w.as_tensor()).unwrap().to_vec1::<f32>()?, [1.0]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub struct GradAccumulator {
    vars: Vec<Var>,
    batch_rows: usize,
    rows: usize,
    micro_batches: usize,
    sum: GradStore,
    /// The variables whose sum is the accumulator's alone (a gradient
    /// handed over, or a sum it made): later gradients go into it in place.
    owned: HashSet<TensorId>,
    observer: Box<dyn Observer>,
}

impl std::fmt::Debug for GradAccumulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradAccumulator")
            .field("vars", &self.vars.len())
            .field("batch_rows", &self.batch_rows)
            .field("rows", &self.rows)
            .field("micro_batches", &self.micro_batches)
            .finish()
    }
}

impl GradAccumulator {
    /// An accumulator for the gradients of `vars` over batches of
    /// `batch_rows` rows.
    pub fn new(vars: Vec<Var>, batch_rows: usize) -> Self {
        Self {
            vars,
            batch_rows,
            rows: 0,
            micro_batches: 0,
            sum: GradStore::default(),
            owned: HashSet::new(),
            observer: Box::new(NoObserver),
        }
    }

    /// Reports the gradient sum's memory to `observer` from now on.
    pub fn observed(mut self, observer: impl Observer + 'static) -> Self {
        self.observer = Box::new(observer);
        self
    }

    /// Sets the rows of the next batches (a last, shorter batch of an epoch);
    /// an error while a batch is being accumulated.
    pub fn set_batch_rows(&mut self, batch_rows: usize) -> Result<()> {
        if self.rows != 0 {
            bail!(
                "{} of the batch's {} rows are accumulated: finish the batch first",
                self.rows,
                self.batch_rows
            );
        }
        self.batch_rows = batch_rows;
        Ok(())
    }

    /// Back-propagates `loss`, the mean over a micro-batch of `rows` rows,
    /// with weight `rows / batch_rows`, and adds the gradients to the sum.
    pub fn backward(&mut self, loss: &Tensor, rows: usize) -> Result<()> {
        self.check_rows(rows)?;
        let weight = rows as f64 / self.batch_rows as f64;
        let grads = within(&*self.observer, Kind::Gradients, Place::Device, || {
            (loss * weight)?.backward()
        })?;
        self.add_weighted(&grads, rows)
    }

    /// Adds gradients already weighted by `rows / batch_rows` (from a
    /// checkpointed backward of the weighted loss, say). Entries that are not
    /// the model's variables (an input's gradient) are left out.
    pub fn add_weighted(&mut self, grads: &GradStore, rows: usize) -> Result<()> {
        self.check_rows(rows)?;
        let _sum = candle_observe::scope(&*self.observer, Kind::Gradients, Place::Device);
        for var in &self.vars {
            if let Some(g) = grads.get(var.as_tensor()) {
                add_to_sum(&mut self.sum, &mut self.owned, var, g.detach(), false)?;
            }
        }
        self.rows += rows;
        self.micro_batches += 1;
        Ok(())
    }

    /// Adds gradients handed over one at a time, already weighted by
    /// `rows / batch_rows`: `f` gets a sink that adds each `(variable,
    /// gradient)` to the sum as it comes. With a backward that hands its
    /// gradients over layer by layer (`candle_checkpoint::Sequential::lean_with`)
    /// a micro-batch's whole set of gradients never exists beside the sum,
    /// as PyTorch adds into `.grad`. The gradients handed over become the
    /// accumulator's: later micro-batches' are added into them in place
    /// (contiguous f32 on the CPU), as PyTorch does, so that adding takes
    /// no tensor beside the sum and the gradient; hand over gradients that
    /// nothing else holds. Gradients of other tensors are left
    /// out. If `f` fails, part of the micro-batch may have been added:
    /// [`reset`](Self::reset) before going on.
    pub fn add_weighted_with<R>(
        &mut self,
        rows: usize,
        f: impl FnOnce(&mut dyn FnMut(&Var, Tensor) -> Result<()>) -> Result<R>,
    ) -> Result<R> {
        self.check_rows(rows)?;
        let _sum = candle_observe::scope(&*self.observer, Kind::Gradients, Place::Device);
        let (vars, sum, owned) = (&self.vars, &mut self.sum, &mut self.owned);
        let mut add = |var: &Var, g: Tensor| -> Result<()> {
            if !vars
                .iter()
                .any(|v| v.as_tensor().id() == var.as_tensor().id())
            {
                return Ok(());
            }
            add_to_sum(sum, owned, var, g, true)
        };
        let out = f(&mut add)?;
        self.rows += rows;
        self.micro_batches += 1;
        Ok(out)
    }

    fn check_rows(&self, rows: usize) -> Result<()> {
        if rows == 0 {
            bail!("a micro-batch of 0 rows has no mean loss to back-propagate");
        }
        if self
            .rows
            .checked_add(rows)
            .is_none_or(|total| total > self.batch_rows)
        {
            bail!(
                "{} + {rows} rows is more than the batch's {} rows",
                self.rows,
                self.batch_rows
            );
        }
        Ok(())
    }

    /// The batch's gradients: an error until the micro-batches' rows add up
    /// to the batch's.
    pub fn grads(&self) -> Result<&GradStore> {
        if self.rows != self.batch_rows {
            bail!(
                "only {} of the batch's {} rows are accumulated",
                self.rows,
                self.batch_rows
            );
        }
        Ok(&self.sum)
    }

    /// Rows accumulated since the last [`take`](Self::take) or
    /// [`reset`](Self::reset).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Micro-batches accumulated since then.
    pub fn micro_batches(&self) -> usize {
        self.micro_batches
    }

    /// The batch's gradients, leaving the accumulator empty for the next.
    pub fn take(&mut self) -> Result<GradStore> {
        self.grads()?;
        self.rows = 0;
        self.micro_batches = 0;
        self.owned.clear();
        Ok(std::mem::take(&mut self.sum))
    }

    /// Drops what was accumulated.
    pub fn reset(&mut self) {
        self.sum = GradStore::default();
        self.owned.clear();
        self.rows = 0;
        self.micro_batches = 0;
    }
}

/// Adds `g` to `var`'s entry of `sum`; the first gradient becomes the sum,
/// with no copy, and is the accumulator's when `handed_over`. A sum that is
/// the accumulator's takes later gradients in place where it can.
fn add_to_sum(
    sum: &mut GradStore,
    owned: &mut HashSet<TensorId>,
    var: &Var,
    g: Tensor,
    handed_over: bool,
) -> Result<()> {
    let id = var.as_tensor().id();
    let total = match sum.remove(var.as_tensor()) {
        // Where candle refuses the write (storage shared after all), the
        // sum is made anew below rather than lost.
        Some(s) if owned.contains(&id) && candle_inplace::add_assign(&s, &g).unwrap_or(false) => s,
        Some(s) => {
            owned.insert(id);
            (s + g)?
        }
        None => {
            if handed_over {
                owned.insert(id);
            }
            g
        }
    };
    sum.insert(var.as_tensor(), total);
    Ok(())
}

/// Splits a batch along its first dimension into micro-batches of `size`
/// rows (views, not copies); the last may be shorter.
pub fn micro_batches(batch: &Tensor, size: usize) -> Result<Vec<Tensor>> {
    if size == 0 {
        bail!("micro-batch size must be at least 1");
    }
    let n = batch.dim(0)?;
    (0..n.div_ceil(size))
        .map(|i| batch.narrow(0, i * size, size.min(n - i * size)))
        .collect()
}
