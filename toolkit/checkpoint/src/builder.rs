//! [`Sequential`]: a stack of layers' backward (checkpointed in segments,
//! lean, or direct), configured by name rather than by position.

use std::marker::PhantomData;

use candle_core::{Module, Result, Tensor, Var};
use candle_custom_grad::DirectBackward;
use candle_observe::{NoObserver, Observer};

use crate::direct::{checkpoint_direct_with, direct_backward_with};
use crate::lean::lean_backward_with;
use crate::policy::{Policy, TapeModule};
use crate::sequential::{backward_by_segments, segment_bounds, Checkpointed, Modules, Segment};
use crate::sequential::{hand_each, TapeModules};

/// A stack of layers to back-propagate: the gradients of plain backprop,
/// with less alive at a time than candle's `backward` keeps.
///
/// Build it on any [`Module`]s with [`Sequential::new`], on layers written
/// against a [`crate::Tape`] with [`Sequential::taped`], which may also keep
/// what a [`Policy`] says (selective checkpointing; only taped layers have
/// `policy`), or on layers whose backward is written out with
/// [`Sequential::direct`]. Then set what differs from the defaults and call
/// one of:
///
/// | call | what is kept, what is recomputed |
/// | --- | --- |
/// | `backward` | the segments' inputs; each segment recomputed in the backward (as PyTorch's `checkpoint_sequential`) |
/// | [`lean`](Sequential::lean) (modules) | every layer's graph apart, each freed once the backward has passed it; nothing recomputed |
/// | `backward` (direct layers) | what each layer's backward needs; no graph, nothing recomputed unless `segments` is set |
///
/// Each has a `_with` form that hands every parameter gradient to a
/// callback as soon as its layer has made it, and keeps none (to add it to
/// a running sum, or move it off the device): it returns the loss and the
/// input's gradient. The builder allocates nothing.
///
/// | setting | default |
/// | --- | --- |
/// | [`segments`](Sequential::segments) | `⌈√n⌉` for `n` layers (Chen et al., 2016); none for direct layers |
/// | [`each_layer`](Sequential::each_layer) | off (sets `segments` to the number of layers) |
/// | [`policy`](Sequential::policy) | [`Policy::Nothing`]: only the segments' inputs are kept |
/// | [`observer`](Sequential::observer) | none |
///
/// A variable used by several segments (or layers) gets the sum of its
/// gradients; the `_with` forms hand each part over on its own.
///
/// ```
/// use candle_checkpoint::{Policy, Sequential, Tape, TapeModule};
/// use candle_core::{Device, Result, Tensor, Var};
/// struct Dense(Var);
/// impl TapeModule for Dense {
///     fn forward_t(&self, x: &Tensor, tape: &Tape) -> Result<Tensor> {
///         tape.linear(x, self.0.as_tensor(), None)?.gelu()
///     }
/// }
/// let dev = Device::Cpu;
/// let layers: Vec<Dense> = (0..4)
///     .map(|_| Ok(Dense(Var::randn(0f32, 0.5, (6, 6), &dev)?)))
///     .collect::<Result<_>>()?;
/// let vars: Vec<Var> = layers.iter().map(|l| l.0.clone()).collect();
/// let x = Tensor::randn(0f32, 1.0, (3, 6), &dev)?;
/// let head = |h: &Tensor| h.sqr()?.sum_all();
/// let plain = Sequential::taped(&layers).backward(&x, &vars, head)?;
/// let dots = Sequential::taped(&layers)
///     .segments(4)
///     .policy(&Policy::Dots)
///     .backward(&x, &vars, head)?;
/// for v in &vars {
///     let d = (plain.grads.get(v).unwrap() - dots.grads.get(v).unwrap())?.abs()?.max_all()?;
///     assert!(d.to_scalar::<f32>()? < 1e-5);
/// }
/// # Ok::<(), candle_core::Error>(())
/// ```
///
/// A policy on modules, which compute nothing through a tape, does not
/// compile:
///
/// ```compile_fail
/// use candle_checkpoint::{Policy, Sequential};
/// let layers = [|x: &candle_core::Tensor| x.exp()];
/// let _ = Sequential::new(&layers).policy(&Policy::Dots);
/// ```
pub struct Sequential<'a, L, K = Plain> {
    layers: &'a [L],
    segments: Option<Segments>,
    policy: &'a Policy,
    observer: &'a dyn Observer,
    kind: PhantomData<K>,
}

/// [`Sequential`] on [`Module`]s: every operation is recomputed.
#[derive(Debug, Clone, Copy)]
pub struct Plain;

/// [`Sequential`] on [`TapeModule`]s: a [`Policy`] may keep products.
#[derive(Debug, Clone, Copy)]
pub struct Taped;

/// [`Sequential`] on [`DirectBackward`] layers: each layer's backward is
/// called directly, with no candle graph between the layers.
#[derive(Debug, Clone, Copy)]
pub struct Direct;

/// What a builder keeps when no policy is given.
static NOTHING: Policy = Policy::Nothing;

impl<L, K> std::fmt::Debug for Sequential<'_, L, K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sequential")
            .field("layers", &self.layers.len())
            .field("segments", &self.segments)
            .field("policy", self.policy)
            .finish_non_exhaustive()
    }
}

impl<'a, M: Module> Sequential<'a, M, Plain> {
    /// Any modules, closures included; the first may take token ids.
    pub fn new(layers: &'a [M]) -> Self {
        Self::on(layers)
    }

    /// Runs the layers on `input`, `head` on their output to a scalar loss,
    /// and back-propagates segment by segment: the loss, the gradients of
    /// `vars` and the input's gradient (`None` for token ids).
    pub fn backward(
        self,
        input: &Tensor,
        vars: &[Var],
        head: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Checkpointed> {
        Checkpointed::summing(|add| self.backward_with(input, vars, head, add))
    }

    /// [`Sequential::backward`] handing each parameter gradient to
    /// `on_grad(var, gradient)` as soon as its segment is done: the loss
    /// and the input's gradient.
    pub fn backward_with(
        self,
        input: &Tensor,
        vars: &[Var],
        head: impl FnOnce(&Tensor) -> Result<Tensor>,
        on_grad: impl FnMut(&Var, Tensor) -> Result<()>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        self.by_segments(&Modules(self.layers), input, vars, head, on_grad)
    }

    /// Back-propagates through the layers and `head` as `head(layers(input))
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
    /// backward, as in PyTorch.
    ///
    /// The parameters' gradients come from that one pass, always whole. The
    /// gradient a layer's input gets is candle's, made through operations that
    /// use a variable (a Linear, a fused lean layer, a residual around them);
    /// when the layer also gives a gradient to a tensor without a graph (its
    /// input transformed without a variable first, or a plain constant such as
    /// an additive mask or a position table), that gradient could be partial,
    /// and the layer runs once more from its saved input made a variable, for
    /// the input's gradient only. So the gradients are exact whatever the
    /// layers do; only such layers cost a second forward and backward.
    ///
    /// `head` maps the last layer's output to the scalar loss. The returned
    /// input gradient is the first layer's input's when candle's is whole
    /// without that second run (a plain data batch into a Linear); `None` when
    /// the input cannot have one (token ids) or would need it: ask
    /// [`crate::recompute`] for it then.
    /// `segments` and `each_layer` do not apply.
    ///
    /// ```
    /// use candle_checkpoint::Sequential;
    /// use candle_core::{Device, Module, Result, Tensor, Var};
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
    /// let lean = Sequential::new(&layers).lean(&x, &vars, head)?;
    /// let plain = head(&layers.iter().try_fold(x.clone(), |h, l| l.forward(&h))?)?.backward()?;
    /// for v in &vars {
    ///     let d = (lean.grads.get(v).unwrap() - plain.get(v).unwrap())?.abs()?.max_all()?;
    ///     assert_eq!(d.to_scalar::<f32>()?, 0.0);
    /// }
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn lean(
        self,
        input: &Tensor,
        vars: &[Var],
        head: impl Fn(&Tensor) -> Result<Tensor>,
    ) -> Result<Checkpointed> {
        Checkpointed::summing(|add| self.lean_with(input, vars, head, add))
    }

    /// [`Sequential::lean`] handing each parameter gradient to
    /// `on_grad(var, gradient)` as soon as its layer's backward has made
    /// it: the loss and the input's gradient.
    pub fn lean_with(
        self,
        input: &Tensor,
        vars: &[Var],
        head: impl Fn(&Tensor) -> Result<Tensor>,
        on_grad: impl FnMut(&Var, Tensor) -> Result<()>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        lean_backward_with(self.layers, input, vars, head, on_grad, self.observer)
    }
}

impl<'a, L: TapeModule> Sequential<'a, L, Taped> {
    /// Layers that compute their products through a [`crate::Tape`], so
    /// that a [`Policy`] can keep them.
    pub fn taped(layers: &'a [L]) -> Self {
        Self::on(layers)
    }

    /// What each segment keeps from its first forward, so that its
    /// recomputation skips it.
    pub fn policy(mut self, policy: &'a Policy) -> Self {
        self.policy = policy;
        self
    }

    /// As [`Sequential::backward`] on modules, the products `policy` names
    /// kept from the first forward.
    pub fn backward(
        self,
        input: &Tensor,
        vars: &[Var],
        head: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Checkpointed> {
        Checkpointed::summing(|add| self.backward_with(input, vars, head, add))
    }

    /// [`Sequential::backward`] handing each parameter gradient to
    /// `on_grad(var, gradient)` as soon as its segment is done.
    pub fn backward_with(
        self,
        input: &Tensor,
        vars: &[Var],
        head: impl FnOnce(&Tensor) -> Result<Tensor>,
        on_grad: impl FnMut(&Var, Tensor) -> Result<()>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        self.by_segments(&TapeModules(self.layers), input, vars, head, on_grad)
    }
}

impl<'a, L: DirectBackward> Sequential<'a, L, Direct> {
    /// Layers whose backward is written out ([`DirectBackward`], such as
    /// `candle_lean_nn`'s fused layers): the forward keeps what each
    /// layer's backward needs, and the backward calls each layer's backward
    /// directly, last layer first, freeing what it consumed.
    ///
    /// Through candle's graph, even a layer whose backward is written out
    /// costs a zeros tensor and a sum for its output's gradient and another
    /// pair for its input's; here a layer's backward holds the gradient it
    /// is given, the one it passes on and its parameters', as PyTorch's
    /// does. With [`segments`](Sequential::segments) set, the forward keeps
    /// the segments' inputs only and each segment runs again in the
    /// backward.
    ///
    /// The first layer's input gets a gradient only when candle tracks it
    /// (a variable, or computed from one); a data batch needs none, which
    /// saves a matrix product. `head` maps the last output to the scalar
    /// loss and its gradient with respect to that output:
    /// `candle_lean_nn::cross_entropy_and_grad`, or any loss written with
    /// candle's operations through [`crate::autograd_head`]. A head with
    /// variables of its own is a layer: put it in `layers`.
    ///
    /// ```
    /// use candle_checkpoint::{Sequential, autograd_head};
    /// use candle_core::{Device, Result, Tensor, Var};
    /// use candle_lean_nn::{cross_entropy_and_grad, Activation, LeanLayer, LeanLinear};
    /// let dev = Device::Cpu;
    /// let vars: Vec<Var> = (0..6)
    ///     .map(|i| Var::randn(0f32, 0.5, if i % 2 == 0 { vec![5, 5] } else { vec![5] }, &dev))
    ///     .collect::<Result<_>>()?;
    /// let layers: Vec<LeanLayer> = vars.chunks(2)
    ///     .map(|p| {
    ///         let linear = LeanLinear::new(p[0].as_tensor().clone(), Some(p[1].as_tensor().clone()))?;
    ///         Ok(LeanLayer::new(linear, Activation::Gelu))
    ///     })
    ///     .collect::<Result<_>>()?;
    /// let x = Tensor::randn(0f32, 1.0, (3, 5), &dev)?;
    /// let y = Tensor::new(&[0u32, 4, 2], &dev)?;
    /// let head = |h: &Tensor| cross_entropy_and_grad(h, &y, 1.0);
    /// let direct = Sequential::direct(&layers).backward(&x, &vars, head)?;
    /// let ckpt = Sequential::direct(&layers).segments(2).backward(&x, &vars, head)?;
    /// let square = |h: &Tensor| h.sqr()?.mean_all();
    /// let through_candle = Sequential::direct(&layers).backward(&x, &vars, autograd_head(square))?;
    /// let lean = Sequential::new(&layers).lean(&x, &vars, square)?;
    /// for v in &vars {
    ///     let d = (direct.grads.get(v).unwrap() - ckpt.grads.get(v).unwrap())?.abs()?.max_all()?;
    ///     assert_eq!(d.to_scalar::<f32>()?, 0.0);
    ///     let d = (through_candle.grads.get(v).unwrap() - lean.grads.get(v).unwrap())?.abs()?.max_all()?;
    ///     assert_eq!(d.to_scalar::<f32>()?, 0.0);
    /// }
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn direct(layers: &'a [L]) -> Self {
        Self::on(layers)
    }

    /// Runs the layers on `input` and `head` on their output, then each
    /// layer's backward: the loss, the gradients of `vars` and the input's
    /// gradient (when candle tracks the input).
    pub fn backward(
        self,
        input: &Tensor,
        vars: &[Var],
        head: impl FnOnce(&Tensor) -> Result<(Tensor, Tensor)>,
    ) -> Result<Checkpointed> {
        Checkpointed::summing(|add| self.backward_with(input, vars, head, add))
    }

    /// [`Sequential::backward`] handing each parameter gradient to
    /// `on_grad(var, gradient)` as soon as its layer's backward has made
    /// it: the loss and the input's gradient.
    pub fn backward_with(
        self,
        input: &Tensor,
        vars: &[Var],
        head: impl FnOnce(&Tensor) -> Result<(Tensor, Tensor)>,
        mut on_grad: impl FnMut(&Var, Tensor) -> Result<()>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (layers, observer) = (self.layers, self.observer);
        match self.segments {
            None => direct_backward_with(layers, input, vars, head, &mut on_grad, observer),
            Some(segments) => {
                let segments = segments.resolve(layers.len());
                checkpoint_direct_with(layers, segments, input, vars, head, &mut on_grad, observer)
            }
        }
    }
}

/// A segment count as set: a number, or one segment per layer.
#[derive(Debug, Clone, Copy)]
enum Segments {
    Count(usize),
    EachLayer,
}

impl Segments {
    fn resolve(self, layers: usize) -> usize {
        match self {
            Segments::Count(n) => n,
            Segments::EachLayer => layers,
        }
    }
}

impl<'a, L, K> Sequential<'a, L, K> {
    fn on(layers: &'a [L]) -> Self {
        Self {
            layers,
            segments: None,
            policy: &NOTHING,
            observer: &NoObserver,
            kind: PhantomData,
        }
    }

    /// Contiguous segments to recompute one at a time, from 1 (the whole
    /// stack recomputed at once) to the number of layers (each layer its
    /// own); another count is an error when the backward runs.
    pub fn segments(mut self, segments: usize) -> Self {
        self.segments = Some(Segments::Count(segments));
        self
    }

    /// Each layer its own segment: the forward keeps the layers' inputs
    /// only, and the backward hands each layer's gradients over as soon as
    /// that layer is done (with a `_with` call, so that no more than one
    /// layer's gradients exist beside what the callback keeps).
    pub fn each_layer(mut self) -> Self {
        self.segments = Some(Segments::EachLayer);
        self
    }

    /// The measurement hook told of each segment's forward and backward.
    pub fn observer(mut self, observer: &'a dyn Observer) -> Self {
        self.observer = observer;
        self
    }

    /// The checkpointed loop over `segment`, the layers seen through
    /// their kind's forward.
    fn by_segments(
        &self,
        segment: &dyn Segment,
        input: &Tensor,
        vars: &[Var],
        head: impl FnOnce(&Tensor) -> Result<Tensor>,
        on_grad: impl FnMut(&Var, Tensor) -> Result<()>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let n = self.layers.len();
        let segments = match self.segments {
            Some(s) => s.resolve(n),
            None => (n as f64).sqrt().ceil() as usize,
        };
        let bounds = segment_bounds(n, segments)?;
        let sink = hand_each(vars, on_grad);
        backward_by_segments(
            segment,
            &bounds,
            self.policy,
            input,
            vars,
            head,
            sink,
            self.observer,
        )
    }
}
