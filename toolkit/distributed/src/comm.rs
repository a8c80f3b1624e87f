//! A communicator: the collectives of an engine, checked and counted.

use std::sync::Mutex;

use candle_core::{bail, Result};
use candle_observe::{scope, Kind, NoObserver, Observer, Place};

use crate::traffic::{Collective, Traffic};

/// The collectives a communication library provides, on `f32` buffers. An
/// implementation is called by [`Comm`] only, with buffers whose lengths it
/// has checked, from one thread at a time.
pub trait Engine: Send + Sync {
    /// This process's rank, from 0.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn size(&self) -> usize;
    /// `recv[i] = Σ over ranks of send[i]`, on every rank.
    fn all_reduce_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<()>;
    /// `recv = (Σ over ranks of send)[rank·n .. (rank+1)·n]`, `n = recv.len()`.
    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<()>;
    /// `recv[r·n .. (r+1)·n] = send of rank r`, `n = send.len()`.
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<()>;
    /// `buf = buf of rank root`, on every rank.
    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;
    /// The library's name and version, for reports.
    fn describe(&self) -> String;
    /// Ends every rank of the job at once with `code` (a rank that cannot
    /// go on would otherwise leave the others waiting in a collective).
    /// The default ends this process only, which is all there is for an
    /// engine without peers; engines with peers override it.
    fn abort(&self, code: i32) -> ! {
        std::process::exit(code)
    }
}

/// One process alone: every collective is a copy (rank 0 of 1).
#[derive(Debug, Clone, Copy, Default)]
pub struct Solo;

impl Engine for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        recv.copy_from_slice(send);
        Ok(())
    }
    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        recv.copy_from_slice(send);
        Ok(())
    }
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        recv.copy_from_slice(send);
        Ok(())
    }
    fn broadcast(&self, _: &mut [f32], _: usize) -> Result<()> {
        Ok(())
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
    fn describe(&self) -> String {
        "one process".into()
    }
}

/// The ranks of a job and the collectives between them: an [`Engine`] with
/// the buffers' lengths checked, every call counted in [`Traffic`], and the
/// buffers it allocates reported to an [`Observer`] as
/// [`Kind::Communication`](candle_observe::Kind::Communication).
///
/// A length that does not fit is an error on the rank that sees it, not
/// undefined behaviour in the library. The other ranks are then waiting in
/// the collective: a rank that cannot go on should end the job with
/// [`abort`](Self::abort) rather than return. The buffers are `f32`
/// whatever the parameters' type: with bf16 parameters a gather moves twice
/// the bytes that a bf16 gather would.
///
/// ```
/// use candle_distributed::Comm;
/// let comm = Comm::solo();
/// let mut grads = vec![1f32, 2.0];
/// comm.all_reduce_sum(&mut grads)?;
/// assert_eq!(grads, [1.0, 2.0]);
/// assert_eq!(comm.traffic().all_reduce.calls, 1);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub struct Comm {
    engine: Box<dyn Engine>,
    traffic: Mutex<Traffic>,
    observer: Box<dyn Observer + Send + Sync>,
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Comm")
            .field("rank", &self.rank())
            .field("size", &self.size())
            .field("engine", &self.engine.describe())
            .finish()
    }
}

impl Comm {
    /// A communicator over `engine`.
    pub fn new(engine: impl Engine + 'static) -> Self {
        Self {
            engine: Box::new(engine),
            traffic: Mutex::new(Traffic::default()),
            observer: Box::new(NoObserver),
        }
    }

    /// One process, rank 0 of 1.
    pub fn solo() -> Self {
        Self::new(Solo)
    }

    /// Reports the buffers it allocates to `observer` from now on.
    pub fn observed(mut self, observer: impl Observer + Send + Sync + 'static) -> Self {
        self.observer = Box::new(observer);
        self
    }

    /// This process's rank, from 0.
    pub fn rank(&self) -> usize {
        self.engine.rank()
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.engine.size()
    }

    /// The engine, as a report names it.
    pub fn describe(&self) -> String {
        self.engine.describe()
    }

    /// What every collective so far moved.
    pub fn traffic(&self) -> Traffic {
        *self.traffic.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn count(&self, op: Collective, payload: usize) {
        let mut t = self.traffic.lock().unwrap_or_else(|e| e.into_inner());
        t.count(op, (payload * 4) as u64, self.rank(), self.size());
    }

    /// A buffer of `n` zeros, counted as communication.
    pub fn buffer(&self, n: usize) -> Vec<f32> {
        let _comm = scope(&*self.observer, Kind::Communication, Place::Device);
        vec![0f32; n]
    }

    /// Runs `f` with its allocations counted as communication buffers.
    pub fn within_buffers<R>(&self, f: impl FnOnce() -> R) -> R {
        let _comm = scope(&*self.observer, Kind::Communication, Place::Device);
        f()
    }

    /// The observer it reports buffers to.
    pub fn observer(&self) -> &(dyn Observer + Send + Sync) {
        &*self.observer
    }

    /// `buf[i] = Σ over ranks of buf[i]`, on every rank.
    pub fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        let send = {
            let _comm = scope(&*self.observer, Kind::Communication, Place::Device);
            buf.to_vec()
        };
        self.engine.all_reduce_sum(&send, buf)?;
        self.count(Collective::AllReduce, buf.len());
        Ok(())
    }

    /// This rank's block of the sum over ranks of `send`: `recv.len()`
    /// elements, `send.len()` being the number of ranks times that.
    pub fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        if send.len() != recv.len() * self.size() {
            bail!(
                "reduce-scatter over {} ranks: {} elements sent, {} received; the sent must be the ranks times the received",
                self.size(),
                send.len(),
                recv.len()
            );
        }
        self.engine.reduce_scatter_sum(send, recv)?;
        self.count(Collective::ReduceScatter, send.len());
        Ok(())
    }

    /// Every rank's `send`, in rank order, into `recv` (the number of ranks
    /// times `send.len()` elements).
    pub fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        if recv.len() != send.len() * self.size() {
            bail!(
                "all-gather over {} ranks: {} elements sent, {} received; the received must be the ranks times the sent",
                self.size(),
                send.len(),
                recv.len()
            );
        }
        self.engine.all_gather(send, recv)?;
        self.count(Collective::AllGather, recv.len());
        Ok(())
    }

    /// `buf` of rank `root`, on every rank.
    pub fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()> {
        if root >= self.size() {
            bail!(
                "broadcast from rank {root}, but there are {} ranks",
                self.size()
            );
        }
        self.engine.broadcast(buf, root)?;
        self.count(Collective::Broadcast { root }, buf.len());
        Ok(())
    }

    /// Returns once every rank has called it.
    pub fn barrier(&self) -> Result<()> {
        self.engine.barrier()
    }

    /// Ends every rank of the job at once with exit status `code`.
    pub fn abort(&self, code: i32) -> ! {
        self.engine.abort(code)
    }
}
