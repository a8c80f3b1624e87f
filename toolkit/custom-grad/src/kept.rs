//! What a custom backward keeps beside the graph, for a ledger to see.
//!
//! candle's graph holds an operation's inputs and output. A backward of
//! this crate may keep more tensors of its own (a GELU's input, an
//! attention's log-sum-exp), out of reach of a walk through the graph.
//! While a [`Recording`] is alive on a thread, each operation made there
//! notes what its backward keeps ([`Backward2::kept`](crate::Backward2::kept)),
//! under its output's id.

use std::cell::RefCell;
use std::collections::HashMap;

use candle_core::{Tensor, TensorId};

thread_local! {
    static NOTES: RefCell<Option<HashMap<TensorId, Vec<Tensor>>>> = const { RefCell::new(None) };
    /// Recordings alive on this thread: the notes go with the last.
    static LIVE: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Notes what the custom backwards made on this thread keep, from
/// [`Recording::start`] until it is dropped. The notes share the kept
/// tensors' storage (they allocate no copy) and keep them alive while the
/// recording lives.
#[derive(Debug)]
pub struct Recording {
    // Not Send: the notes are this thread's.
    _thread: std::marker::PhantomData<*const ()>,
}

impl Recording {
    /// Starts recording on this thread (a recording already running goes
    /// on, its notes kept, and the notes are shared until the last
    /// recording is dropped).
    pub fn start() -> Self {
        NOTES.with(|n| {
            n.borrow_mut().get_or_insert_with(HashMap::new);
        });
        LIVE.with(|l| l.set(l.get() + 1));
        Self {
            _thread: std::marker::PhantomData,
        }
    }

    /// The tensors the backward of the operation that made `out` keeps
    /// beside the graph (none for an operation not of this crate).
    pub fn kept_by(&self, out: &Tensor) -> Vec<Tensor> {
        NOTES.with(|n| {
            n.borrow()
                .as_ref()
                .and_then(|m| m.get(&out.id()).cloned())
                .unwrap_or_default()
        })
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        let left = LIVE.with(|l| {
            let left = l.get().saturating_sub(1);
            l.set(left);
            left
        });
        if left == 0 {
            NOTES.with(|n| n.borrow_mut().take());
        }
    }
}

/// Whether a recording is running on this thread.
pub(crate) fn is_recording() -> bool {
    NOTES.with(|n| n.borrow().is_some())
}

/// Notes what the operation that made `out` keeps.
pub(crate) fn note(out: &Tensor, kept: Vec<Tensor>) {
    if kept.is_empty() {
        return;
    }
    NOTES.with(|n| {
        if let Some(m) = n.borrow_mut().as_mut() {
            m.insert(out.id(), kept);
        }
    });
}
