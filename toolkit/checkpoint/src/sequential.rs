//! Stacks of layers: checkpointed in segments, or back-propagated one layer
//! at a time. Both are loops over [`recompute`].

use std::ops::Range;

use candle_core::backprop::GradStore;
use candle_core::{bail, Module, Result, Tensor, Var};
use candle_observe::{within, Kind, Observer, Place};

use crate::grads::add_grad;
use crate::policy::{Policy, Tape, TapeModule};
use crate::vjp::{recompute_observed, Arg, Seed};

/// What a [`crate::Sequential`] backward returns. Everything is detached.
#[derive(Debug)]
pub struct Checkpointed {
    /// The loss.
    pub loss: Tensor,
    /// The gradients of the variables passed in; a variable used by several
    /// segments gets the sum.
    pub grads: GradStore,
    /// The gradient of the loss with respect to the input; `None` for an
    /// input that cannot have one (token ids).
    pub input_grad: Option<Tensor>,
}

/// A sink for parameter gradients, as the `_with` drivers take one.
pub(crate) type GradSink<'a> = &'a mut dyn FnMut(&Var, Tensor) -> Result<()>;

impl Checkpointed {
    /// Runs `backward`, a driver that hands each parameter gradient to a
    /// sink and returns the loss and the input's gradient, summing what it
    /// hands over per variable.
    pub(crate) fn summing(
        backward: impl FnOnce(GradSink<'_>) -> Result<(Tensor, Option<Tensor>)>,
    ) -> Result<Self> {
        let mut grads = GradStore::default();
        let (loss, input_grad) = backward(&mut |var, g| add_grad(&mut grads, var, g))?;
        Ok(Self {
            loss,
            grads,
            input_grad,
        })
    }
}

/// Splits `n` layers into `segments` contiguous ranges, as even as possible
/// (the first ones one longer).
///
/// ```
/// assert_eq!(candle_checkpoint::segment_bounds(5, 2)?, [0..3, 3..5]);
/// assert!(candle_checkpoint::segment_bounds(2, 3).is_err());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn segment_bounds(n: usize, segments: usize) -> Result<Vec<Range<usize>>> {
    if n == 0 {
        bail!("there are no layers to checkpoint");
    }
    if segments == 0 || segments > n {
        bail!("segments is {segments}: it must be between 1 and the number of layers, {n}");
    }
    let (base, extra) = (n / segments, n % segments);
    let mut start = 0;
    Ok((0..segments)
        .map(|i| {
            let len = base + usize::from(i < extra);
            let r = start..start + len;
            start += len;
            r
        })
        .collect())
}

/// How a segment of layers runs: on modules (the tape unused), or on tape
/// modules under a policy.
pub(crate) trait Segment {
    fn run(&self, range: Range<usize>, x: &Tensor, tape: &Tape) -> Result<Tensor>;
}

pub(crate) struct Modules<'a, M>(pub(crate) &'a [M]);

impl<M: Module> Segment for Modules<'_, M> {
    fn run(&self, range: Range<usize>, x: &Tensor, _: &Tape) -> Result<Tensor> {
        self.0[range]
            .iter()
            .try_fold(x.clone(), |h, l| l.forward(&h))
    }
}

pub(crate) struct TapeModules<'a, L>(pub(crate) &'a [L]);

impl<L: TapeModule> Segment for TapeModules<'_, L> {
    fn run(&self, range: Range<usize>, x: &Tensor, tape: &Tape) -> Result<Tensor> {
        self.0[range]
            .iter()
            .try_fold(x.clone(), |h, l| l.forward_t(&h, tape))
    }
}

/// The checkpointed loop: a forward that keeps each segment's
/// input (and what `policy` keeps), then each segment recomputed and pulled
/// back, last first, its parameter gradients handed to `sink`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_by_segments(
    layers: &dyn Segment,
    bounds: &[Range<usize>],
    policy: &Policy,
    input: &Tensor,
    vars: &[Var],
    head: impl FnOnce(&Tensor) -> Result<Tensor>,
    mut sink: impl FnMut(GradStore) -> Result<()>,
    observer: &dyn Observer,
) -> Result<(Tensor, Option<Tensor>)> {
    let mut saved = Vec::with_capacity(bounds.len());
    let mut kept = Vec::with_capacity(bounds.len());
    saved.push(input.detach());
    for range in &bounds[..bounds.len() - 1] {
        let last = saved.last().expect("saved starts with the input");
        let tape = Tape::record(policy);
        let out = within(observer, Kind::Activations, Place::Device, || {
            layers.run(range.clone(), last, &tape)
        })?;
        // Detached: the segment's intermediate tensors go with its graph,
        // but for what the tape kept.
        saved.push(out.detach());
        // The graph goes before the mark, so that the mark sees what the
        // forward holds from here on.
        drop(out);
        kept.push(Some(tape.into_saved()));
        observer.mark("segment forward");
    }
    // The last segment runs once, in the backward: nothing kept to replay.
    kept.push(None);
    let mut head = Some(head);
    let mut upstream: Option<Tensor> = None;
    let mut loss = None;
    for range in bounds.iter().rev() {
        let x = saved.pop().expect("one saved input per segment");
        let tape = match kept.pop().flatten() {
            Some(saved) => Tape::replay(policy, saved),
            None => Tape::plain(),
        };
        // Token ids and other integer inputs are read, not differentiated.
        let arg = if x.dtype().is_float() {
            Arg::Grad(&x)
        } else {
            Arg::Const(&x)
        };
        let vjp = match (upstream.take(), head.take()) {
            (None, Some(head)) => recompute_observed(
                |a| head(&layers.run(range.clone(), &a[0], &tape)?),
                &[arg],
                Seed::Loss,
                vars,
                observer,
            )?,
            (Some(g), _) => recompute_observed(
                |a| layers.run(range.clone(), &a[0], &tape),
                &[arg],
                Seed::Grad(&g),
                vars,
                observer,
            )?,
            (None, None) => bail!(
                "the input of layer {} is not a float tensor: only the first layer may take ids",
                range.start
            ),
        };
        drop(x);
        tape.finish()?;
        drop(tape);
        if let Some(l) = vjp.loss {
            loss = Some(l);
        }
        let mut inputs = vjp.inputs;
        upstream = inputs.pop().flatten();
        sink(vjp.params)?;
        observer.mark("segment backward");
    }
    match loss {
        Some(loss) => Ok((loss, upstream)),
        None => bail!("internal: no segment ran"),
    }
}

/// A sink for [`backward_by_segments`] that hands each gradient of `vars`
/// in a segment's store to `on_grad`, keeping none.
pub(crate) fn hand_each<'a>(
    vars: &'a [Var],
    mut on_grad: impl FnMut(&Var, Tensor) -> Result<()> + 'a,
) -> impl FnMut(GradStore) -> Result<()> + 'a {
    move |mut store| {
        for var in vars {
            if let Some(g) = store.remove(var.as_tensor()) {
                on_grad(var, g)?;
            }
        }
        Ok(())
    }
}
