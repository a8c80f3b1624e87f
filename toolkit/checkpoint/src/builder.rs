//! [`Sequential`]: checkpointing a stack of layers, configured by name
//! rather than by position.

use std::marker::PhantomData;

use candle_core::{Module, Result, Tensor, Var};
use candle_observe::{NoObserver, Observer};

use crate::policy::{Policy, TapeModule};
use crate::sequential::{checkpointed, Checkpointed, Modules, TapeModules};

/// A stack of layers to back-propagate in checkpointed segments: the
/// gradients of plain backprop, with only one segment's activations (and
/// the segments' inputs) alive at a time.
///
/// Build it on any [`Module`]s with [`Sequential::new`], or on layers
/// written against a [`crate::Tape`] with [`Sequential::taped`], which may
/// also keep what a [`Policy`] says (selective checkpointing; only taped
/// layers have `policy`). Then set what differs from the defaults and call
/// `backward`. The builder allocates nothing.
///
/// | setting | default |
/// | --- | --- |
/// | [`segments`](Sequential::segments) | `⌈√n⌉` for `n` layers (Chen et al., 2016) |
/// | [`policy`](Sequential::policy) | [`Policy::Nothing`]: only the segments' inputs are kept |
/// | [`observer`](Sequential::observer) | none |
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
    segments: Option<usize>,
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
    /// `vars` (a variable used by several segments gets the sum) and the
    /// input's gradient.
    pub fn backward(
        self,
        input: &Tensor,
        vars: &[Var],
        head: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Checkpointed> {
        let segments = self.segment_count();
        checkpointed(
            &Modules(self.layers),
            self.layers.len(),
            segments,
            &NOTHING,
            input,
            vars,
            head,
            self.observer,
        )
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
        let segments = self.segment_count();
        checkpointed(
            &TapeModules(self.layers),
            self.layers.len(),
            segments,
            self.policy,
            input,
            vars,
            head,
            self.observer,
        )
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
        self.segments = Some(segments);
        self
    }

    /// The measurement hook told of each segment's forward and backward.
    pub fn observer(mut self, observer: &'a dyn Observer) -> Self {
        self.observer = observer;
        self
    }

    fn segment_count(&self) -> usize {
        self.segments
            .unwrap_or_else(|| (self.layers.len() as f64).sqrt().ceil() as usize)
    }
}
