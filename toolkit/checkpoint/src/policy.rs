//! Selective checkpointing: which tensors a checkpointed function keeps from
//! its first forward, so that the recomputation skips them.

use std::cell::RefCell;
use std::collections::VecDeque;

use candle_core::{bail, Result, Tensor};
use candle_custom_grad::{with_backward2, Backward2};

/// What a checkpointed function keeps from its first forward, in the
/// vocabulary of JAX's checkpoint policies. Plain backprop (JAX's
/// `everything_saveable`) is not checkpointing at all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Policy {
    /// Only the function's inputs: every operation is run again
    /// (`nothing_saveable`).
    Nothing,
    /// The outputs of matrix products as well: the recomputation runs only
    /// the element-wise operations between them (`dots_saveable`, and
    /// PyTorch's selective activation checkpointing with its usual policy:
    /// save matmul outputs, recompute the rest).
    Dots,
    /// The outputs of the products given these names
    /// ([`Tape::named_matmul`]; `save_only_these_names`).
    Names(Vec<String>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Outside checkpointing: compute, keep nothing.
    Plain,
    /// The first forward: keep what the policy saves.
    Record,
    /// The recomputation: hand back what was kept instead of computing it.
    Replay,
}

/// What a checkpointed function computes its products with, so that a
/// [`Policy`] can keep them: write the function's matrix products as
/// `tape.matmul(a, b)` (or `tape.linear`), the rest as usual.
///
/// ```
/// use candle_checkpoint::Tape;
/// use candle_core::{Device, Tensor};
/// let dev = Device::Cpu;
/// let tape = Tape::plain();
/// let x = Tensor::new(&[[1f32, 2.0]], &dev)?;
/// let w = Tensor::new(&[[1f32, 0.0], [0.0, 2.0], [1.0, 1.0]], &dev)?;
/// let y = tape.linear(&x, &w, None)?; // x W^T
/// assert_eq!(y.to_vec2::<f32>()?, [[1.0, 4.0, 3.0]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug)]
pub struct Tape {
    policy: Policy,
    mode: Mode,
    saved: RefCell<VecDeque<Tensor>>,
}

impl Tape {
    /// A tape that computes and keeps nothing: for running a function
    /// written against a tape outside checkpointing.
    pub fn plain() -> Self {
        Self {
            policy: Policy::Nothing,
            mode: Mode::Plain,
            saved: RefCell::default(),
        }
    }

    pub(crate) fn record(policy: &Policy) -> Self {
        Self {
            policy: policy.clone(),
            mode: Mode::Record,
            saved: RefCell::default(),
        }
    }

    pub(crate) fn replay(policy: &Policy, saved: VecDeque<Tensor>) -> Self {
        Self {
            policy: policy.clone(),
            mode: Mode::Replay,
            saved: RefCell::new(saved),
        }
    }

    /// What the first forward kept, in order.
    pub(crate) fn into_saved(self) -> VecDeque<Tensor> {
        self.saved.into_inner()
    }

    /// An error if the recomputation did not use everything kept: the
    /// function took another path the second time.
    pub(crate) fn finish(&self) -> Result<()> {
        let left = self.saved.borrow().len();
        if left != 0 {
            bail!("the recomputation used {left} fewer saved products than the first forward kept: the function must compute the same products each time");
        }
        Ok(())
    }

    /// `a.matmul(b)`, kept under [`Policy::Dots`].
    pub fn matmul(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        self.product(None, a, b)
    }

    /// `a.matmul(b)` named `name`: kept under [`Policy::Dots`], and under
    /// [`Policy::Names`] if the name is listed.
    pub fn named_matmul(&self, name: &str, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        self.product(Some(name), a, b)
    }

    /// `x W^T + b` for `x` of any rank `(..., in)` and `w` `(out, in)`, the
    /// product through [`matmul`](Self::matmul).
    pub fn linear(&self, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
        self.named_linear(None, x, w, b)
    }

    /// [`linear`](Self::linear) whose product is named `name`.
    pub fn named_linear(
        &self,
        name: Option<&str>,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (out_f, in_f) = w.dims2()?;
        let mut dims = x.dims().to_vec();
        let x2 = x.reshape(((), in_f))?;
        let y = self.product(name, &x2, &w.t()?)?;
        if let Some(last) = dims.last_mut() {
            *last = out_f;
        }
        let y = y.reshape(dims)?;
        match b {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }

    fn keeps(&self, name: Option<&str>) -> bool {
        match &self.policy {
            Policy::Nothing => false,
            Policy::Dots => true,
            Policy::Names(names) => name.is_some_and(|n| names.iter().any(|m| m == n)),
        }
    }

    fn product(&self, name: Option<&str>, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        match (self.mode, self.keeps(name)) {
            (Mode::Record, true) => {
                let y = a.matmul(b)?;
                self.saved.borrow_mut().push_back(y.detach());
                Ok(y)
            }
            (Mode::Replay, true) => {
                let Some(out) = self.saved.borrow_mut().pop_front() else {
                    bail!("the recomputation computed more saved products than the first forward: the function must compute the same products each time");
                };
                let mut expected = a.dims().to_vec();
                if let (Some(last), Some(&n)) = (expected.last_mut(), b.dims().last()) {
                    *last = n;
                }
                if expected != out.dims() {
                    bail!(
                        "a kept product has shape {:?}, but {:?} x {:?} makes {expected:?}: the function must compute the same products each time",
                        out.dims(),
                        a.dims(),
                        b.dims()
                    );
                }
                with_backward2(out, [a, b], Product)
            }
            _ => a.matmul(b),
        }
    }
}

/// The backward of a product whose output was kept: the product's own
/// (`dA = G B^T`, `dB = A^T G`), which needs its inputs, not its output.
struct Product;

impl Backward2 for Product {
    fn backward(
        &self,
        a: &Tensor,
        b: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad.matmul(&b.t()?)?), Some(a.t()?.matmul(grad)?)))
    }
}

/// A layer written against a [`Tape`], so that a [`Policy`] can keep its
/// products.
pub trait TapeModule {
    /// The forward, its products through `tape`.
    fn forward_t(&self, x: &Tensor, tape: &Tape) -> Result<Tensor>;
}
