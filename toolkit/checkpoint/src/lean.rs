//! A backward that frees as it goes, without recomputing.

use std::collections::HashSet;

use candle_core::backprop::GradStore;
use candle_core::{bail, Module, Result, Tensor, TensorId, Var};
use candle_observe::{scope, Kind, Observer, Place};

use crate::grads::accumulate;
use crate::sequential::Checkpointed;
use crate::vjp::{recompute, seeded, Arg, Seed};

/// What one layer's backward gave: its input's gradient and its parameters'.
struct Step {
    input: Option<Tensor>,
    params: GradStore,
}

/// Back-propagates `root` (a scalar) through its graph, whose leaf `input`
/// is a plain tensor. `None` when the gradient candle gives `input` may be
/// incomplete: something in the graph was computed from a plain tensor
/// without a variable (so candle kept no graph for it) and still received a
/// gradient, and that something may have been computed from `input`.
fn pull_back_plain(root: Tensor, input: &Tensor, vars: &[Var]) -> Result<Option<Step>> {
    let mut store = root.backward()?;
    drop(root);
    let expected: HashSet<TensorId> = vars
        .iter()
        .map(|v| v.as_tensor().id())
        .chain([input.id()])
        .collect();
    if store.get_ids().any(|id| !expected.contains(id)) {
        return Ok(None);
    }
    let input_grad = store.remove(input).map(|g| g.detach());
    let mut params = GradStore::default();
    accumulate(&mut params, &store, vars)?;
    Ok(Some(Step {
        input: input_grad,
        params,
    }))
}

/// One layer's (or the last layer's and the head's) backward: without
/// recomputing when candle's gradient of the input is complete, else again
/// from the saved input made a variable, which is exact whatever the layer
/// does.
fn layer_backward(
    root: Tensor,
    input: &Tensor,
    seed: Seed<'_>,
    rerun: impl FnOnce(&Tensor) -> Result<Tensor>,
    vars: &[Var],
    observer: &dyn Observer,
) -> Result<Step> {
    if let Some(step) = pull_back_plain(root, input, vars)? {
        return Ok(step);
    }
    let vjp = recompute(|a| rerun(&a[0]), &[Arg::Grad(input)], seed, vars, observer)?;
    Ok(Step {
        input: vjp.inputs.into_iter().next().flatten(),
        params: vjp.params,
    })
}

/// Back-propagates through `layers` and `head` as `head(layers(input))
/// .backward()` would, but one layer's graph at a time, so that each layer's
/// activations and the gradient it consumed are freed as soon as the
/// backward has passed it.
///
/// candle's own backward keeps the whole graph, every activation of the
/// forward, until it returns, while PyTorch frees each saved tensor once its
/// node has run. Here the forward keeps each layer's graph apart (its input
/// detached from the layer before, sharing its storage: no copy), and the
/// backward pulls the gradient back through the head and the last layer,
/// then through each layer from the last, dropping each graph after its
/// backward. The peak is the forward's activations plus one layer's
/// backward, as in PyTorch; nothing is recomputed when each layer reaches
/// its input through operations that use variables (a Linear, a fused lean
/// layer, a residual around them). A layer that also computes from its input
/// without a variable (a norm without weights, a scaled copy) is recomputed
/// once, from its saved input made a variable, so its gradients stay exact.
///
/// `head` maps the last layer's output to the scalar loss. The input's
/// gradient is `None` when the first layer's input cannot have one (token
/// ids) or gets none through variables (a plain data batch into a Linear
/// gets one; ask [`recompute`] for an input that needs it exactly).
///
/// ```
/// use candle_checkpoint::lean_backward;
/// use candle_core::{Device, Module, Result, Tensor, Var};
/// use candle_observe::NoObserver;
/// struct Dense(Var);
/// impl Module for Dense {
///     fn forward(&self, x: &Tensor) -> Result<Tensor> {
///         x.matmul(self.0.as_tensor())?.gelu()
///     }
/// }
/// let dev = Device::Cpu;
/// let layers: Vec<Dense> = (0..3)
///     .map(|_| Ok(Dense(Var::randn(0f32, 0.5, (4, 4), &dev)?)))
///     .collect::<Result<_>>()?;
/// let vars: Vec<Var> = layers.iter().map(|l| l.0.clone()).collect();
/// let x = Tensor::randn(0f32, 1.0, (2, 4), &dev)?;
/// let head = |h: &Tensor| h.sqr()?.mean_all();
/// let lean = lean_backward(&layers, &x, &vars, head, &NoObserver)?;
/// let plain = head(&layers.iter().try_fold(x.clone(), |h, l| l.forward(&h))?)?.backward()?;
/// for v in &vars {
///     let d = (lean.grads.get(v).unwrap() - plain.get(v).unwrap())?.abs()?.max_all()?;
///     assert_eq!(d.to_scalar::<f32>()?, 0.0);
/// }
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn lean_backward<M: Module>(
    layers: &[M],
    input: &Tensor,
    vars: &[Var],
    head: impl Fn(&Tensor) -> Result<Tensor>,
    observer: &dyn Observer,
) -> Result<Checkpointed> {
    let Some((last, _)) = layers.split_last() else {
        bail!("lean_backward needs at least one layer");
    };
    // Forward: each layer's input (detached) and its output with the
    // layer's graph.
    let mut saved: Vec<(Tensor, Tensor)> = Vec::with_capacity(layers.len());
    let loss = {
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
    let (x_last, loss) = loss;
    if loss.elem_count() != 1 {
        bail!(
            "the head must return the scalar loss, got shape {:?}",
            loss.dims()
        );
    }
    let value = loss.detach();

    let _grads = scope(observer, Kind::Gradients, Place::Device);
    let mut grads = GradStore::default();
    let rerun_last = |x: &Tensor| head(&last.forward(x)?);
    let step = layer_backward(loss, &x_last, Seed::Loss, rerun_last, vars, observer)?;
    drop(x_last);
    accumulate(&mut grads, &step.params, vars)?;
    let mut upstream = step.input;
    for (layer, (x, out)) in layers.iter().zip(saved).rev() {
        let Some(g) = upstream.take() else {
            bail!("a layer's output got no gradient: the layer after it does not use its input");
        };
        let root = seeded(&out, &g)?;
        drop(out);
        let step = layer_backward(
            root,
            &x,
            Seed::Grad(&g),
            |x| layer.forward(x),
            vars,
            observer,
        )?;
        drop(g);
        accumulate(&mut grads, &step.params, vars)?;
        upstream = step.input;
    }
    Ok(Checkpointed {
        loss: value,
        grads,
        input_grad: upstream,
    })
}
