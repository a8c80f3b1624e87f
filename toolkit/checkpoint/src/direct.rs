//! A backward that calls each layer's backward itself, without candle's
//! graph between the layers.

use candle_core::{bail, Result, Tensor, Var};
use candle_custom_grad::DirectBackward;
use candle_observe::{scope, Kind, NoObserver, Observer, Place};

use crate::sequential::{segment_bounds, Checkpointed, GradSink};
use crate::vjp::{recompute, Arg, Seed};

/// Hands each parameter gradient of `params` whose tensor is one of `vars`
/// to `on_grad`; a constant parameter not among `vars` is not trained and
/// its gradient is dropped. A parameter computed from a variable (a cast to
/// a half type, say) is an error: its gradient would have to go through
/// candle's graph to reach the variable.
fn hand_over(
    params: Vec<(Tensor, Tensor)>,
    vars: &[Var],
    on_grad: &mut impl FnMut(&Var, Tensor) -> Result<()>,
) -> Result<()> {
    for (param, grad) in params {
        match vars.iter().find(|v| v.as_tensor().id() == param.id()) {
            Some(var) => on_grad(var, grad)?,
            None if param.track_op() && !param.is_variable() => bail!(
                "a layer's parameter of shape {:?} is computed from a variable (a cast, say): \
                 the direct backward hands gradients to the variables themselves; \
                 build the layer on the variable, or use lean_backward",
                param.dims()
            ),
            None => {}
        }
    }
    Ok(())
}

/// A head written with candle's operations, as [`direct_backward`] takes
/// one: the loss and its gradient with respect to the head's input, through
/// candle's backward (which first copies the input, to make it a variable).
/// A head with a backward of its own, such as
/// `candle_lean_nn::cross_entropy_and_grad`, needs neither.
pub fn autograd_head(
    head: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> impl FnOnce(&Tensor) -> Result<(Tensor, Tensor)> {
    move |h| {
        let vjp = recompute(
            |a| head(&a[0]),
            &[Arg::Grad(h)],
            Seed::Loss,
            &[],
            &NoObserver,
        )?;
        match (vjp.loss, vjp.inputs.into_iter().next().flatten()) {
            (Some(loss), Some(grad)) => Ok((loss, grad)),
            _ => bail!("internal: the head's backward gave no loss or no gradient"),
        }
    }
}

/// [`crate::lean_backward`] for layers whose backward is written out
/// ([`DirectBackward`], such as `candle_lean_nn`'s fused layers): the
/// forward keeps each layer's input, output and what its backward needs,
/// and the backward calls each layer's backward directly, last layer first,
/// freeing each output once the layer before it is done with it.
///
/// Through candle's graph, even a layer whose backward is written out
/// costs a zeros tensor and a sum for its output's gradient and another pair
/// for its input's; here a layer's backward holds the gradient it is given,
/// the one it passes on and its parameters', as PyTorch's does. The first
/// layer's input gets a gradient only when candle tracks it (a variable, or
/// computed from one: pull the gradient back through that graph yourself);
/// a data batch needs none, which saves a matrix product. `head` maps the last output
/// to the scalar loss and that loss's gradient with respect to the output:
/// `candle_lean_nn::cross_entropy_and_grad`, or any loss written with
/// candle's operations through [`autograd_head`]. A head with variables of
/// its own is a layer: put it in `layers`.
///
/// ```
/// use candle_checkpoint::{autograd_head, direct_backward, lean_backward};
/// use candle_core::{Device, Result, Tensor, Var};
/// use candle_lean_nn::{Activation, LeanLayer, LeanLinear};
/// use candle_observe::NoObserver;
/// let dev = Device::Cpu;
/// let vars: Vec<Var> = (0..6).map(|i| Var::randn(0f32, 0.5, if i % 2 == 0 { vec![4, 4] } else { vec![4] }, &dev))
///     .collect::<Result<_>>()?;
/// let layers: Vec<LeanLayer> = vars.chunks(2)
///     .map(|p| {
///         let linear = LeanLinear::new(p[0].as_tensor().clone(), Some(p[1].as_tensor().clone()))?;
///         Ok(LeanLayer::new(linear, Activation::Gelu))
///     })
///     .collect::<Result<_>>()?;
/// let x = Tensor::randn(0f32, 1.0, (3, 4), &dev)?;
/// let head = |h: &Tensor| h.sqr()?.mean_all();
/// let direct = direct_backward(&layers, &x, &vars, autograd_head(head), &NoObserver)?;
/// let lean = lean_backward(&layers, &x, &vars, head, &NoObserver)?;
/// for v in &vars {
///     let d = (direct.grads.get(v).unwrap() - lean.grads.get(v).unwrap())?.abs()?.max_all()?;
///     assert_eq!(d.to_scalar::<f32>()?, 0.0);
/// }
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn direct_backward<L: DirectBackward>(
    layers: &[L],
    input: &Tensor,
    vars: &[Var],
    head: impl FnOnce(&Tensor) -> Result<(Tensor, Tensor)>,
    observer: &dyn Observer,
) -> Result<Checkpointed> {
    Checkpointed::summing(|add| direct_backward_with(layers, input, vars, head, add, observer))
}

/// [`direct_backward`] handing each parameter gradient to `on_grad(var,
/// gradient)` as soon as its layer's backward has made it, and keeping none
/// (see [`crate::lean_backward_with`]). Returns the loss and the input's
/// gradient.
pub fn direct_backward_with<L: DirectBackward>(
    layers: &[L],
    input: &Tensor,
    vars: &[Var],
    head: impl FnOnce(&Tensor) -> Result<(Tensor, Tensor)>,
    mut on_grad: impl FnMut(&Var, Tensor) -> Result<()>,
    observer: &dyn Observer,
) -> Result<(Tensor, Option<Tensor>)> {
    if layers.is_empty() {
        bail!("direct_backward needs at least one layer");
    }
    // Forward: each layer's input and what its backward needs.
    let (mut saved, out) = {
        let _acts = scope(observer, Kind::Activations, Place::Device);
        forward_saving(layers, input.detach())?
    };
    observer.mark("after forward");
    let _grads = scope(observer, Kind::Gradients, Place::Device);
    let (loss, grad) = run_head(head, &out)?;
    let want_first = input.track_op();
    let grad = backward_through(
        layers,
        &mut saved,
        out,
        grad,
        vars,
        want_first,
        &mut on_grad,
    )?;
    Ok((loss, grad))
}

/// Each layer's input and what its backward needs, first layer first.
type Saved<L> = Vec<(Tensor, <L as DirectBackward>::Saved)>;

/// Runs `layers` from `x`, keeping each layer's input (the output of the
/// layer before, shared, not copied) and what its backward needs: those,
/// and the last output.
fn forward_saving<L: DirectBackward>(layers: &[L], mut x: Tensor) -> Result<(Saved<L>, Tensor)> {
    let mut saved = Vec::with_capacity(layers.len());
    for layer in layers {
        let (y, kept) = layer.forward_saved(&x)?;
        saved.push((x, kept));
        x = y;
    }
    Ok((saved, x))
}

/// The head's loss and the gradient of the last output, checked.
fn run_head(
    head: impl FnOnce(&Tensor) -> Result<(Tensor, Tensor)>,
    out: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (loss, grad) = head(out)?;
    if loss.elem_count() != 1 || grad.dims() != out.dims() {
        bail!(
            "the head must return the scalar loss and its gradient of the output's shape {:?}, got shapes {:?} and {:?}",
            out.dims(),
            loss.dims(),
            grad.dims()
        );
    }
    Ok((loss, grad))
}

/// Calls the backward of each of `layers`, last first, from what
/// [`forward_saving`] kept (taken from `saved`), their last output `out`
/// and its gradient, handing the parameters' gradients to `on_grad` and
/// freeing each output once the layer before it is done with it. Returns
/// the first layer's input's gradient when `want_first`.
fn backward_through<L: DirectBackward>(
    layers: &[L],
    saved: &mut Saved<L>,
    mut out: Tensor,
    mut grad: Tensor,
    vars: &[Var],
    want_first: bool,
    on_grad: &mut impl FnMut(&Var, Tensor) -> Result<()>,
) -> Result<Option<Tensor>> {
    for (i, layer) in layers.iter().enumerate().rev() {
        let Some((x, kept)) = saved.pop() else {
            bail!("internal: a layer's saved input is missing");
        };
        let want_input = i > 0 || want_first;
        // The gradient is handed over: the layer frees it when done with it.
        let step = layer.backward_saved(&x, &out, kept, grad, want_input)?;
        // This layer's output is done with.
        out = x;
        hand_over(step.params, vars, on_grad)?;
        match step.input {
            Some(g) => grad = g,
            None if !want_input => return Ok(None),
            None => bail!("a layer's backward gave its input no gradient though it was asked for"),
        }
    }
    Ok(Some(grad))
}

/// [`crate::checkpoint_sequential`] for layers whose backward is written
/// out ([`DirectBackward`]): the forward keeps each segment's input only;
/// the backward runs each segment's forward again, keeping what its layers'
/// backwards need, and calls them directly, last segment first. With no
/// graph anywhere, a segment's backward holds what [`direct_backward`]'s
/// holds for its layers, and a recomputed segment starts from its saved
/// input itself, not a copy. `head` is as [`direct_backward`]'s.
///
/// ```
/// use candle_checkpoint::{checkpoint_direct, direct_backward};
/// use candle_core::{Device, Result, Tensor, Var};
/// use candle_lean_nn::{cross_entropy_and_grad, Activation, LeanLayer, LeanLinear};
/// use candle_observe::NoObserver;
/// let dev = Device::Cpu;
/// let vars: Vec<Var> = (0..4).map(|_| Var::randn(0f32, 0.5, (5, 5), &dev)).collect::<Result<_>>()?;
/// let layers: Vec<LeanLayer> = vars.iter()
///     .map(|v| Ok(LeanLayer::new(LeanLinear::new(v.as_tensor().clone(), None)?, Activation::Relu)))
///     .collect::<Result<_>>()?;
/// let x = Tensor::randn(0f32, 1.0, (3, 5), &dev)?;
/// let y = Tensor::new(&[0u32, 4, 2], &dev)?;
/// let head = |h: &Tensor| cross_entropy_and_grad(h, &y, 1.0);
/// let plain = direct_backward(&layers, &x, &vars, head, &NoObserver)?;
/// let ckpt = checkpoint_direct(&layers, 2, &x, &vars, head, &NoObserver)?;
/// for v in &vars {
///     let d = (plain.grads.get(v).unwrap() - ckpt.grads.get(v).unwrap())?.abs()?.max_all()?;
///     assert_eq!(d.to_scalar::<f32>()?, 0.0);
/// }
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn checkpoint_direct<L: DirectBackward>(
    layers: &[L],
    segments: usize,
    input: &Tensor,
    vars: &[Var],
    head: impl FnOnce(&Tensor) -> Result<(Tensor, Tensor)>,
    observer: &dyn Observer,
) -> Result<Checkpointed> {
    Checkpointed::summing(|add| {
        checkpoint_direct_with(layers, segments, input, vars, head, add, observer)
    })
}

/// [`checkpoint_direct`] handing each parameter gradient to `on_grad`:
/// the loss and the input's gradient.
fn checkpoint_direct_with<L: DirectBackward>(
    layers: &[L],
    segments: usize,
    input: &Tensor,
    vars: &[Var],
    head: impl FnOnce(&Tensor) -> Result<(Tensor, Tensor)>,
    mut on_grad: GradSink<'_>,
    observer: &dyn Observer,
) -> Result<(Tensor, Option<Tensor>)> {
    let bounds = segment_bounds(layers.len(), segments)?;
    // Forward: each segment's input; what the layers keep is dropped.
    let mut inputs: Vec<Tensor> = Vec::with_capacity(bounds.len());
    let out = {
        let _acts = scope(observer, Kind::Activations, Place::Device);
        let mut x = input.detach();
        for range in &bounds {
            inputs.push(x.clone());
            for layer in &layers[range.clone()] {
                x = layer.forward_saved(&x)?.0;
            }
        }
        x
    };
    observer.mark("segment forward");
    let (loss, mut grad) = {
        let _grads = scope(observer, Kind::Gradients, Place::Device);
        run_head(head, &out)?
    };
    drop(out);
    let want_first = input.track_op();
    let mut input_grad = None;
    for (range, x) in bounds.iter().zip(inputs).rev() {
        let segment = &layers[range.clone()];
        let (mut saved, out) = {
            let _acts = scope(observer, Kind::Activations, Place::Device);
            forward_saving(segment, x)?
        };
        let _grads = scope(observer, Kind::Gradients, Place::Device);
        let want = range.start > 0 || want_first;
        match backward_through(segment, &mut saved, out, grad, vars, want, &mut on_grad)? {
            Some(g) if range.start > 0 => grad = g,
            g => {
                input_grad = g;
                break;
            }
        }
        observer.mark("segment backward");
    }
    Ok((loss, input_grad))
}
