//! A job whose ranks are threads of one process: real collectives over
//! shared memory, for tests and examples that need a job's values without
//! a communication library.

use std::sync::{Arc, Barrier, Mutex};

use candle_core::{bail, Result};

use crate::comm::Engine;

/// What the ranks of a [`Threads`] job share: each rank's contribution to
/// the collective under way, and a barrier to take turns.
#[derive(Debug)]
struct World {
    size: usize,
    slots: Mutex<Vec<Vec<f32>>>,
    barrier: Barrier,
}

impl World {
    /// Puts `send` in this rank's slot, waits for every rank's, reads the
    /// slots with `read`, and waits until every rank has read them (so the
    /// next collective cannot overwrite a slot still being read).
    fn exchange<R>(&self, rank: usize, send: &[f32], read: impl FnOnce(&[Vec<f32>]) -> R) -> R {
        {
            let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
            slots[rank].clear();
            slots[rank].extend_from_slice(send);
        }
        self.barrier.wait();
        let out = {
            let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
            read(&slots)
        };
        self.barrier.wait();
        out
    }
}

/// One rank of a job whose ranks are threads of this process
/// ([`Threads::world`]): every collective exchanges real values, so a
/// step on N thread ranks computes what N processes under `mpirun` would.
/// Every rank must call the same collectives in the same order, each from
/// its own thread; a rank that stops calling leaves the others waiting.
///
/// ```
/// use std::sync::Arc;
/// use candle_distributed::{Comm, Threads};
/// let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
///     let ranks: Vec<_> = Threads::world(2)
///         .into_iter()
///         .map(|t| s.spawn(move || {
///             let comm = Comm::new(t);
///             let mut buf = vec![comm.rank() as f32 + 1.0];
///             comm.all_reduce_sum(&mut buf).map(|_| buf)
///         }))
///         .collect();
///     ranks.into_iter().map(|r| r.join().unwrap().unwrap()).collect()
/// });
/// assert_eq!(sums, [[3.0], [3.0]]);
/// ```
#[derive(Debug, Clone)]
pub struct Threads {
    rank: usize,
    world: Arc<World>,
}

impl Threads {
    /// The `size` ranks of a new job (at least one), rank `r` at index `r`:
    /// hand each to its own thread.
    pub fn world(size: usize) -> Vec<Threads> {
        let size = size.max(1);
        let world = Arc::new(World {
            size,
            slots: Mutex::new(vec![Vec::new(); size]),
            barrier: Barrier::new(size),
        });
        (0..size)
            .map(|rank| Threads {
                rank,
                world: Arc::clone(&world),
            })
            .collect()
    }

    fn check(&self, slots: &[Vec<f32>], len: usize, what: &str) -> Result<()> {
        if let Some((r, s)) = slots.iter().enumerate().find(|(_, s)| s.len() != len) {
            bail!(
                "{what}: rank {r} sent {} values, rank {} sent {len}",
                s.len(),
                self.rank
            );
        }
        Ok(())
    }
}

impl Engine for Threads {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.world.size
    }
    fn all_reduce_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        self.world.exchange(self.rank, send, |slots| {
            self.check(slots, send.len(), "all-reduce")?;
            for (i, r) in recv.iter_mut().enumerate() {
                *r = slots.iter().map(|s| s[i]).sum();
            }
            Ok(())
        })
    }
    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        let start = self.rank * recv.len();
        self.world.exchange(self.rank, send, |slots| {
            self.check(slots, send.len(), "reduce-scatter")?;
            for (i, r) in recv.iter_mut().enumerate() {
                *r = slots.iter().map(|s| s[start + i]).sum();
            }
            Ok(())
        })
    }
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        self.world.exchange(self.rank, send, |slots| {
            self.check(slots, send.len(), "all-gather")?;
            for (chunk, s) in recv.chunks_mut(send.len().max(1)).zip(slots) {
                chunk.copy_from_slice(&s[..chunk.len()]);
            }
            Ok(())
        })
    }
    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()> {
        let send = buf.to_vec();
        self.world.exchange(self.rank, &send, |slots| {
            self.check(slots, send.len(), "broadcast")?;
            buf.copy_from_slice(&slots[root]);
            Ok(())
        })
    }
    fn barrier(&self) -> Result<()> {
        self.world.barrier.wait();
        Ok(())
    }
    fn describe(&self) -> String {
        format!(
            "rank {} of {} threads in one process",
            self.rank, self.world.size
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Comm;

    /// Runs `f` on each rank of a job of `n` threads, results by rank.
    fn on_ranks<R: Send>(n: usize, f: impl Fn(&Comm) -> R + Sync) -> Vec<R> {
        std::thread::scope(|s| {
            let f = &f;
            let ranks: Vec<_> = Threads::world(n)
                .into_iter()
                .map(|t| s.spawn(move || f(&Comm::new(t))))
                .collect();
            ranks.into_iter().map(|r| r.join().unwrap()).collect()
        })
    }

    #[test]
    fn each_collective_gives_the_job_s_values() {
        let got = on_ranks(3, |comm| -> Result<_> {
            let r = comm.rank() as f32;
            let send: Vec<f32> = (0..6).map(|i| i as f32 + 10.0 * r).collect();
            let mut block = vec![0f32; 2];
            comm.reduce_scatter_sum(&send, &mut block)?;
            let mut all = vec![0f32; 3];
            comm.all_gather(&[r], &mut all)?;
            let mut b = vec![r];
            comm.broadcast(&mut b, 2)?;
            Ok((block, all, b))
        });
        for (rank, g) in got.into_iter().enumerate() {
            let (block, all, b) = g.unwrap();
            // Σ over ranks of i + 10 r: 3i + 30 at the rank's two places.
            let i = 2 * rank;
            assert_eq!(block, [3.0 * i as f32 + 30.0, 3.0 * (i + 1) as f32 + 30.0]);
            assert_eq!(all, [0.0, 1.0, 2.0]);
            assert_eq!(b, [2.0]);
        }
    }

    #[test]
    fn lengths_that_differ_between_ranks_are_an_error_on_every_rank() {
        let got = on_ranks(2, |comm| {
            let send = vec![1f32; 1 + comm.rank()];
            let mut recv = send.clone();
            comm.all_reduce_sum(&mut recv).map_err(|e| e.to_string())
        });
        for g in got {
            let e = g.unwrap_err();
            assert!(e.contains("all-reduce: rank"), "{e}");
        }
    }
}
