//! A backward that calls each layer's backward itself, without candle's
//! graph between the layers.

use candle_core::{bail, Result, Tensor, Var};
use candle_custom_grad::DirectBackward;
use candle_observe::{scope, Kind, Observer, Place};

use crate::sequential::{segment_bounds, GradSink};
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

/// A head written with candle's operations, as a direct backward
/// ([`crate::Sequential::direct`]) takes one: the loss and its gradient with respect to the head's input, through
/// candle's backward (which first copies the input, to make it a variable).
/// A head with a backward of its own, such as
/// `candle_lean_nn::cross_entropy_and_grad`, needs neither.
pub fn autograd_head(
    head: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> impl FnOnce(&Tensor) -> Result<(Tensor, Tensor)> {
    move |h| {
        let vjp = recompute(|a| head(&a[0]), &[Arg::Grad(h)], Seed::Loss, &[])?;
        match (vjp.loss, vjp.inputs.into_iter().next().flatten()) {
            (Some(loss), Some(grad)) => Ok((loss, grad)),
            _ => bail!("internal: the head's backward gave no loss or no gradient"),
        }
    }
}

/// [`crate::Sequential::direct`]'s backward without segments: see there.
pub(crate) fn direct_backward_with<L: DirectBackward>(
    layers: &[L],
    input: &Tensor,
    vars: &[Var],
    head: impl FnOnce(&Tensor) -> Result<(Tensor, Tensor)>,
    mut on_grad: impl FnMut(&Var, Tensor) -> Result<()>,
    observer: &dyn Observer,
) -> Result<(Tensor, Option<Tensor>)> {
    if layers.is_empty() {
        bail!("a direct backward needs at least one layer");
    }
    // Forward: each layer's input and what its backward needs.
    let (mut saved, out) = {
        let _acts = scope(observer, Kind::Activations, Place::Device);
        forward_saving(layers, input.detach())?
    };
    observer.mark("after forward");
    let _grads = scope(observer, Kind::Gradients, Place::Device);
    let (loss, grad) = run_head(head, &out)?;
    // No backward reads the last output (the logits, for a language model).
    drop(out);
    let want_first = input.track_op();
    // Each layer's backward a stretch of its own: a later micro-batch, which
    // adds each gradient into a sum as it is made, holds the sum instead of
    // the gradients made before the stretch (a planner subtracts them).
    let grad = backward_through(
        layers,
        &mut saved,
        grad,
        vars,
        want_first,
        &mut on_grad,
        Some(observer),
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
/// [`forward_saving`] kept (taken from `saved`) and the last output's
/// gradient, handing the parameters' gradients to `on_grad` and freeing
/// each layer's input (the output of the layer before) and what it kept as
/// soon as its backward is done. Returns the first layer's input's gradient
/// when `want_first`. With `marks`, marks the end of each layer's backward
/// but the first layer's.
fn backward_through<L: DirectBackward>(
    layers: &[L],
    saved: &mut Saved<L>,
    mut grad: Tensor,
    vars: &[Var],
    want_first: bool,
    on_grad: &mut impl FnMut(&Var, Tensor) -> Result<()>,
    marks: Option<&dyn Observer>,
) -> Result<Option<Tensor>> {
    for (i, layer) in layers.iter().enumerate().rev() {
        let Some((x, kept)) = saved.pop() else {
            bail!("internal: a layer's saved input is missing");
        };
        let want_input = i > 0 || want_first;
        // The gradient is handed over: the layer frees it when done with it.
        let step = layer.backward_saved(&x, kept, grad, want_input)?;
        drop(x);
        hand_over(step.params, vars, on_grad)?;
        if let (Some(observer), true) = (marks, i > 0) {
            observer.mark("layer backward");
        }
        match step.input {
            Some(g) => grad = g,
            None if !want_input => return Ok(None),
            None => bail!("a layer's backward gave its input no gradient though it was asked for"),
        }
    }
    Ok(Some(grad))
}

/// [`crate::Sequential::direct`]'s backward in `segments` checkpoints:
/// the forward keeps each segment's input only; the backward runs each
/// segment's forward again, keeping what its layers' backward needs, then
/// their backward. Hands each parameter gradient to `on_grad`; returns the
/// loss and the input's gradient.
pub(crate) fn checkpoint_direct_with<L: DirectBackward>(
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
    // The head, each recompute and each backward are stretches of their
    // own: an observer taking each stretch's peak (a planner drawing its
    // line in the batch) sees the recompute, whose peak grows faster, apart
    // from the backward, whose peak is higher at small batches.
    observer.mark("head");
    let want_first = input.track_op();
    let mut input_grad = None;
    for (range, x) in bounds.iter().zip(inputs).rev() {
        let segment = &layers[range.clone()];
        let mut saved = {
            let _acts = scope(observer, Kind::Activations, Place::Device);
            // The segment's output is the next one's input, done with.
            forward_saving(segment, x)?.0
        };
        observer.mark("segment recompute");
        let _grads = scope(observer, Kind::Gradients, Place::Device);
        let want = range.start > 0 || want_first;
        match backward_through(segment, &mut saved, grad, vars, want, &mut on_grad, None)? {
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
