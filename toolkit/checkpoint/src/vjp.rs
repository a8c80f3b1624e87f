//! The vector-Jacobian product through a recomputed function.

use candle_core::backprop::GradStore;
use candle_core::{bail, Result, Tensor, Var};
use candle_custom_grad::{with_backward2, Backward2};
use candle_observe::{scope, Kind, NoObserver, Observer, Place};

/// An input of a recomputed function.
#[derive(Debug, Clone, Copy)]
pub enum Arg<'a> {
    /// An input whose gradient is wanted (the residual stream, say).
    Grad(&'a Tensor),
    /// An input that is only read (an attention mask, token ids).
    Const(&'a Tensor),
}

impl Arg<'_> {
    fn tensor(&self) -> &Tensor {
        match self {
            Arg::Grad(t) | Arg::Const(t) => t,
        }
    }
}

/// What the output of a function is pulled back with.
#[derive(Debug, Clone, Copy)]
pub enum Seed<'a> {
    /// The output is the scalar loss itself.
    Loss,
    /// The gradient of the loss with respect to the output, of its shape.
    Grad(&'a Tensor),
}

/// What [`recompute`] returns. Everything is detached.
#[derive(Debug)]
pub struct Vjp {
    /// The gradient of each input, in order: `None` for [`Arg::Const`].
    /// An input the output does not depend on gets zeros.
    pub inputs: Vec<Option<Tensor>>,
    /// The gradients of the variables passed in that the output depends on.
    pub params: GradStore,
    /// The loss, when seeded with [`Seed::Loss`].
    pub loss: Option<Tensor>,
}

/// The root of a backward that hands `grad` to `output` as its gradient.
///
/// A scalar whose backward gives `output` the gradient `grad` itself: the
/// same as back-propagating `sum(output * grad)`, without that product, its
/// gradient and the product's own gradient, three tensors of the output's
/// size that candle would make on the way.
pub(crate) fn seeded(output: &Tensor, grad: &Tensor) -> Result<Tensor> {
    struct Inject;
    impl Backward2 for Inject {
        fn backward(
            &self,
            _output: &Tensor,
            grad: &Tensor,
            _root: &Tensor,
            _ones: &Tensor,
        ) -> Result<(Option<Tensor>, Option<Tensor>)> {
            // The root's own gradient is the scalar one: nothing to scale.
            Ok((Some(grad.clone()), None))
        }
    }
    let root = Tensor::zeros((), output.dtype(), output.device())?;
    with_backward2(root, [output, grad], Inject)
}

/// Back-propagates `output`, whose graph starts at `inputs`, with `seed`:
/// the gradients of `inputs` and of `vars`.
///
/// `inputs` are the tensors the function ran on (`None` for an input that
/// needs no gradient). An input that is a variable gets zeros if the output
/// does not depend on it; a plain tensor gets a gradient only where candle
/// passed one (through an operation that also used a variable), else
/// `None`. The output and its graph are dropped before this returns.
pub(crate) fn pull_back(
    output: Tensor,
    seed: Seed<'_>,
    inputs: &[Option<&Tensor>],
    vars: &[Var],
    observer: &dyn Observer,
) -> Result<Vjp> {
    let _grads = scope(observer, Kind::Gradients, Place::Device);
    let (root, loss) = match seed {
        Seed::Loss => {
            if output.elem_count() != 1 {
                bail!(
                    "Seed::Loss needs a scalar output, the function returned shape {:?}",
                    output.dims()
                );
            }
            let loss = output.detach();
            (output, Some(loss))
        }
        Seed::Grad(g) => {
            if g.dims() != output.dims() {
                bail!(
                    "the upstream gradient has shape {:?}, the function's output {:?}",
                    g.dims(),
                    output.dims()
                );
            }
            let g = g.detach().to_dtype(output.dtype())?;
            (seeded(&output, &g)?, None)
        }
    };
    let store = root.backward()?;
    drop(root);
    let mut params = GradStore::default();
    for var in vars {
        if let Some(g) = store.get(var.as_tensor()) {
            params.insert(var.as_tensor(), g.detach());
        }
    }
    let inputs = inputs
        .iter()
        .map(|x| match x {
            None => Ok(None),
            Some(x) => match store.get(x) {
                Some(g) => Ok(Some(g.detach())),
                None if x.is_variable() => x.zeros_like().map(Some),
                None => Ok(None),
            },
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Vjp {
        inputs,
        params,
        loss,
    })
}

/// Recomputes `f` from `args` and back-propagates `seed` through it: the
/// gradients of the [`Arg::Grad`] inputs and of `vars` (the parameters `f`
/// uses; others are ignored).
///
/// This is the step checkpointing repeats: the forward kept only `args`, the
/// backward runs `f` again on them and pulls the upstream gradient back.
/// Only `f`'s activations of this one call are alive meanwhile.
///
/// ```
/// use candle_checkpoint::{Arg, Seed, recompute};
/// use candle_core::{Device, Tensor, Var};
/// let dev = Device::Cpu;
/// let w = Var::new(&[2f32, 3.0], &dev)?;
/// let x = Tensor::new(&[1f32, 4.0], &dev)?;
/// let mask = Tensor::new(&[1f32, 0.0], &dev)?;
/// // f(x, mask) = (x * w * mask), pulled back with ones: d/dx = w * mask, d/dw = x * mask.
/// let f = |a: &[Tensor]| (&a[0] * w.as_tensor())? * &a[1];
/// let ones = Tensor::ones(2, candle_core::DType::F32, &dev)?;
/// let vjp = recompute(f, &[Arg::Grad(&x), Arg::Const(&mask)], Seed::Grad(&ones), &[w.clone()])?;
/// assert_eq!(vjp.inputs[0].as_ref().unwrap().to_vec1::<f32>()?, [2.0, 0.0]);
/// assert!(vjp.inputs[1].is_none());
/// assert_eq!(vjp.params.get(w.as_tensor()).unwrap().to_vec1::<f32>()?, [1.0, 0.0]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn recompute(
    f: impl FnOnce(&[Tensor]) -> Result<Tensor>,
    args: &[Arg<'_>],
    seed: Seed<'_>,
    vars: &[Var],
) -> Result<Vjp> {
    recompute_observed(f, args, seed, vars, &NoObserver)
}

/// [`recompute`], the recomputation's activations and gradients told to
/// `observer`.
pub(crate) fn recompute_observed(
    f: impl FnOnce(&[Tensor]) -> Result<Tensor>,
    args: &[Arg<'_>],
    seed: Seed<'_>,
    vars: &[Var],
    observer: &dyn Observer,
) -> Result<Vjp> {
    for (i, arg) in args.iter().enumerate() {
        if let Arg::Grad(t) = arg {
            if !t.dtype().is_float() {
                bail!(
                    "argument {i} is {:?}: only a float input can have a gradient (pass it as Arg::Const)",
                    t.dtype()
                );
            }
        }
    }
    let _acts = scope(observer, Kind::Activations, Place::Device);
    let leaves = args
        .iter()
        .map(|arg| match arg {
            // A fresh variable, so that the input gets its whole gradient
            // whatever its first operation: a plain tensor gets one only
            // through operations that also use a variable.
            Arg::Grad(t) => Ok(Some(Var::from_tensor(&t.detach())?.into_inner())),
            Arg::Const(_) => Ok(None),
        })
        .collect::<Result<Vec<_>>>()?;
    let tensors: Vec<Tensor> = args
        .iter()
        .zip(&leaves)
        .map(|(arg, leaf)| match leaf {
            Some(t) => t.clone(),
            None => arg.tensor().detach(),
        })
        .collect();
    let output = f(&tensors)?;
    drop(tensors);
    let leaf_refs: Vec<Option<&Tensor>> = leaves.iter().map(Option::as_ref).collect();
    pull_back(output, seed, &leaf_refs, vars, observer)
}
