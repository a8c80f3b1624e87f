//! A backward that frees as it goes, without recomputing.

use std::collections::HashSet;

use candle_core::backprop::GradStore;
use candle_core::{bail, Module, Result, Tensor, TensorId, Var};
use candle_observe::{scope, Kind, Observer, Place};

use crate::grads::accumulate;
use crate::vjp::{recompute_observed, seeded, Arg, Seed};

/// What one layer's backward gave: its input's gradient and its parameters'.
struct Step {
    input: Option<Tensor>,
    params: GradStore,
}

/// Back-propagates `root` (a scalar) through its graph, whose leaf `input`
/// is a plain tensor: the variables' gradients, always complete, and the
/// input's, which candle makes through operations that use a variable. That
/// one may be incomplete when something else in the graph without a graph
/// of its own also received a gradient (it may have been computed from
/// `input` without a variable): then `complete` is false.
fn pull_back_plain(root: Tensor, input: &Tensor, vars: &[Var]) -> Result<(Step, bool)> {
    let mut store = root.backward()?;
    drop(root);
    let expected: HashSet<TensorId> = vars
        .iter()
        .map(|v| v.as_tensor().id())
        .chain([input.id()])
        .collect();
    let complete = store.get_ids().all(|id| expected.contains(id));
    let input_grad = store.remove(input).map(|g| g.detach());
    let mut params = GradStore::default();
    accumulate(&mut params, &store, vars)?;
    Ok((
        Step {
            input: input_grad,
            params,
        },
        complete,
    ))
}

/// One layer's (or the last layer's and the head's) backward, without
/// recomputing. When candle's gradient of the input may be incomplete and
/// it is wanted, the layer runs again from the input made a variable, for
/// the input's gradient only (the parameters' come from the first pass).
fn layer_backward(
    root: Tensor,
    input: &Tensor,
    seed: Seed<'_>,
    rerun: impl FnOnce(&Tensor) -> Result<Tensor>,
    vars: &[Var],
    want_input: bool,
    observer: &dyn Observer,
) -> Result<Step> {
    let (mut step, complete) = pull_back_plain(root, input, vars)?;
    if complete {
        return Ok(step);
    }
    step.input = None;
    if want_input && input.dtype().is_float() {
        let vjp = recompute_observed(|a| rerun(&a[0]), &[Arg::Grad(input)], seed, &[], observer)?;
        step.input = vjp.inputs.into_iter().next().flatten();
    }
    Ok(step)
}

/// [`crate::Sequential::lean_with`]: see there.
pub(crate) fn lean_backward_with<M: Module>(
    layers: &[M],
    input: &Tensor,
    vars: &[Var],
    head: impl Fn(&Tensor) -> Result<Tensor>,
    mut on_grad: impl FnMut(&Var, Tensor) -> Result<()>,
    observer: &dyn Observer,
) -> Result<(Tensor, Option<Tensor>)> {
    let Some((last, _)) = layers.split_last() else {
        bail!("a lean backward needs at least one layer");
    };
    // Forward: each layer's input (detached) and its output with the
    // layer's graph.
    let mut saved: Vec<(Tensor, Tensor)> = Vec::with_capacity(layers.len());
    let (x_last, loss) = {
        let _acts = scope(observer, Kind::Activations, Place::Device);
        let mut x = input.detach();
        for layer in layers {
            let out = layer.forward(&x)?;
            let next = out.detach();
            saved.push((x, out));
            x = next;
        }
        let (x_last, out_last) = saved.pop().expect("one layer at least");
        drop(x);
        (x_last, head(&out_last)?)
    };
    if loss.elem_count() != 1 {
        bail!(
            "the head must return the scalar loss, got shape {:?}",
            loss.dims()
        );
    }
    let value = loss.detach();
    observer.mark("after forward");

    let _grads = scope(observer, Kind::Gradients, Place::Device);
    let mut hand_over = |params: GradStore| -> Result<()> {
        for var in vars {
            if let Some(g) = params.get(var.as_tensor()) {
                on_grad(var, g.clone())?;
            }
        }
        Ok(())
    };
    let rerun_last = |x: &Tensor| head(&last.forward(x)?);
    // The first layer's input gradient only when it needs no second run.
    let many = layers.len() > 1;
    let step = layer_backward(loss, &x_last, Seed::Loss, rerun_last, vars, many, observer)?;
    drop(x_last);
    hand_over(step.params)?;
    let mut upstream = step.input;
    for (i, (layer, (x, out))) in layers.iter().zip(saved).enumerate().rev() {
        let Some(g) = upstream.take() else {
            bail!("a layer's output got no gradient: the layer after it does not use its input");
        };
        let root = seeded(&out, &g)?;
        drop(out);
        let rerun = |x: &Tensor| layer.forward(x);
        let step = layer_backward(root, &x, Seed::Grad(&g), rerun, vars, i > 0, observer)?;
        drop(g);
        hand_over(step.params)?;
        upstream = step.input;
    }
    Ok((value, upstream))
}
