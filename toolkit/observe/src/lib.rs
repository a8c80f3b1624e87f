//! A hook through which training techniques say what the memory they are
//! about to allocate is for, and when a step of theirs is done.
//!
//! The techniques of this family that allocate state or recompute
//! (checkpointing, gradient accumulation, lean optimizers, offload) take an
//! [`Observer`]. The default, [`NoObserver`], does nothing and costs nothing.
//! A profiler implements it to tag allocations by [`Kind`] and [`Place`] and
//! to mark a timeline.
//!
//! They take it by one rule: a type that allocates as it is made has a
//! constructor `with_observer(..., observer)` beside its `new`
//! (`LeanAdamW::with_observer`, `StreamedLinear::with_observer`); one that
//! allocates later is told with `observed(observer)` on the value
//! (`GradAccumulator::new(vars, rows).observed(tags)`, `Comm::observed`,
//! `StreamedLinear::observed`); a builder names the setting `observer`, as
//! it names its other settings (the checkpointing crate's `Sequential`).
//!
//! ```
//! use std::cell::RefCell;
//! use candle_observe::{Kind, Observer, Place, Token};
//!
//! /// Records what it was told, in order.
//! #[derive(Default)]
//! struct Log(RefCell<Vec<String>>);
//!
//! impl Observer for Log {
//!     fn enter(&self, kind: Kind, place: Place) -> Token {
//!         self.0.borrow_mut().push(format!("enter {kind:?} on {place:?}"));
//!         Token::default()
//!     }
//!     fn leave(&self, _: Token) {
//!         self.0.borrow_mut().push("leave".into());
//!     }
//!     fn mark(&self, label: &'static str) {
//!         self.0.borrow_mut().push(label.into());
//!     }
//! }
//!
//! let log = Log::default();
//! {
//!     let _scope = candle_observe::scope(&log, Kind::Gradients, Place::Device);
//!     log.mark("backward done");
//! }
//! assert_eq!(
//!     *log.0.borrow(),
//!     ["enter Gradients on Device", "backward done", "leave"]
//! );
//! ```
#![warn(missing_docs)]

/// What memory is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Kind {
    /// Model weights, and copies of them (casts, fetched shards).
    Parameters,
    /// Tensors saved or recomputed for the backward.
    Activations,
    /// Gradients, and gradient sums.
    Gradients,
    /// Optimizer moments and master weights.
    OptimizerState,
    /// Buffers that a collective sends from or receives into.
    Communication,
}

/// Where memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Place {
    /// The device that computes (the CPU itself on a CPU-only run).
    Device,
    /// Host memory that stands beside a device (offloaded state).
    Host,
}

/// What [`Observer::enter`] returns and [`Observer::leave`] is given back:
/// whatever the observer needs to restore its previous state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Token(pub u64);

/// Told what the memory allocated from now on is for, and when a step is done.
///
/// Every method has a no-op default. Calls nest: each `enter` is followed by
/// the `leave` of its token before the enclosing one's.
pub trait Observer {
    /// Allocations from now until the matching [`leave`](Self::leave) are
    /// of `kind`, in `place`.
    fn enter(&self, kind: Kind, place: Place) -> Token {
        let _ = (kind, place);
        Token::default()
    }

    /// Ends the scope that `enter` returned `token` for.
    fn leave(&self, token: Token) {
        let _ = token;
    }

    /// A step is done (a segment's forward, a layer's backward...).
    fn mark(&self, label: &'static str) {
        let _ = label;
    }
}

/// The observer that observes nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoObserver;

impl Observer for NoObserver {}

/// A scope of one kind of memory: [`Observer::leave`] on drop.
#[must_use = "the scope ends when this is dropped"]
pub struct Scope<'a> {
    observer: &'a dyn Observer,
    token: Token,
}

impl Drop for Scope<'_> {
    fn drop(&mut self) {
        self.observer.leave(self.token);
    }
}

impl std::fmt::Debug for Scope<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scope").field("token", &self.token).finish()
    }
}

/// Enters `kind` in `place` on `observer` until the returned scope is dropped.
pub fn scope(observer: &dyn Observer, kind: Kind, place: Place) -> Scope<'_> {
    let token = observer.enter(kind, place);
    Scope { observer, token }
}

/// Runs `f` inside [`scope`].
pub fn within<R>(observer: &dyn Observer, kind: Kind, place: Place, f: impl FnOnce() -> R) -> R {
    let _scope = scope(observer, kind, place);
    f()
}
