//! f32 scratch for the tasks of a parallel loop, made before it.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Mutex, PoisonError};

/// f32 buffers of one length for the tasks of a parallel loop on rayon's
/// pool, all made before the loop starts: one for each task that can run
/// at once.
///
/// A buffer a loop's task makes for itself (`for_each_init`'s, or a `vec!`
/// in the closure) exists once for each worker that happens to be inside a
/// task at that moment, which the scheduler decides: the loop's peak memory
/// then differs from run to run. These are made up front, as many as the
/// fewer of the pool's workers and the loop's tasks, so a loop holds the
/// same bytes every run, and no task allocates.
///
/// ```
/// use candle_cpu_math::WorkerScratch;
/// use rayon::prelude::*;
///
/// let rows = vec![1f32; 8 * 100];
/// let scratch = WorkerScratch::new(100, 8);
/// let sums: Vec<f32> = rows
///     .par_chunks(100)
///     .map(|row| {
///         scratch.with(|s| {
///             s.copy_from_slice(row);
///             s.iter().sum()
///         })
///     })
///     .collect();
/// assert_eq!(sums, vec![100.0; 8]);
/// assert_eq!(scratch.extra(), 0);
/// ```
pub struct WorkerScratch {
    free: Mutex<Vec<Vec<f32>>>,
    len: usize,
    extra: AtomicUsize,
}

impl WorkerScratch {
    /// Buffers of `len` for a loop of `tasks` tasks on the current pool
    /// (the global pool outside one): the fewer of its workers and `tasks`,
    /// as no more of the loop's tasks can run at once.
    pub fn new(len: usize, tasks: usize) -> Self {
        let count = rayon::current_num_threads().min(tasks);
        Self {
            free: Mutex::new((0..count).map(|_| vec![0f32; len]).collect()),
            len,
            extra: AtomicUsize::new(0),
        }
    }

    /// The length of each buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffers are empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `f` on a free buffer, as an earlier task left it (zeros at first).
    /// When none is free (the loop runs on a pool with more workers than
    /// the one the buffers were made for, or `f` itself ran a parallel loop
    /// whose tasks took the others), `f` gets a new buffer of zeros, freed
    /// afterwards, and [`extra`](Self::extra) counts it.
    pub fn with<R>(&self, f: impl FnOnce(&mut [f32]) -> R) -> R {
        let free = || self.free.lock().unwrap_or_else(PoisonError::into_inner);
        let taken = free().pop();
        match taken {
            Some(mut buffer) => {
                let r = f(&mut buffer);
                free().push(buffer);
                r
            }
            None => {
                self.extra.fetch_add(1, Relaxed);
                f(&mut vec![0f32; self.len])
            }
        }
    }

    /// How many times [`with`](Self::with) found no buffer free and made
    /// one: 0 for a loop that ran on the pool the buffers were made for.
    pub fn extra(&self) -> usize {
        self.extra.load(Relaxed)
    }

    /// The buffers made up front and free now.
    #[cfg(test)]
    fn free_count(&self) -> usize {
        self.free.lock().unwrap().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
    }

    #[test]
    fn as_many_buffers_as_tasks_can_run_at_once() {
        pool(3).install(|| {
            for (tasks, made) in [(64, 3), (3, 3), (2, 2), (1, 1), (0, 0)] {
                let scratch = WorkerScratch::new(5, tasks);
                assert_eq!((scratch.free_count(), scratch.len()), (made, 5), "{tasks}");
            }
        });
    }

    #[test]
    fn every_task_gets_a_buffer_made_up_front() {
        pool(3).install(|| {
            let scratch = WorkerScratch::new(5, 64);
            // Each task finds what an earlier task left (a task's number
            // plus one), or the zeros it was made with.
            let found: Vec<f32> = (0..64)
                .into_par_iter()
                .map(|i| {
                    scratch.with(|b| {
                        assert_eq!(b.len(), 5);
                        let before = b[0];
                        assert!(b.iter().all(|&v| v == before));
                        b.fill(i as f32 + 1.0);
                        before
                    })
                })
                .collect();
            assert_eq!(scratch.extra(), 0);
            assert_eq!(scratch.free_count(), 3);
            // At most three tasks saw zeros: one for each buffer.
            assert!(found.iter().filter(|&&v| v == 0.0).count() <= 3);
            assert!(found.iter().all(|&v| (0.0..=64.0).contains(&v)));
        });
    }

    #[test]
    fn a_task_that_finds_none_free_gets_its_own() {
        pool(1).install(|| {
            let scratch = WorkerScratch::new(4, 1);
            scratch.with(|outer| {
                outer.fill(7.0);
                // The one buffer is held: the nested call gets zeros.
                assert_eq!(scratch.with(|inner| inner.to_vec()), vec![0.0; 4]);
            });
            assert_eq!((scratch.extra(), scratch.free_count()), (1, 1));
            assert_eq!(scratch.with(|b| b.to_vec()), vec![7.0; 4]);
        });
        // Outside any pool's workers, buffers are taken all the same.
        let scratch = WorkerScratch::new(4, 1);
        scratch.with(|b| b.fill(2.0));
        assert_eq!(scratch.with(|b| b.to_vec()), vec![2.0; 4]);
        assert_eq!(scratch.extra(), 0);
    }

    #[test]
    fn zero_length_buffers_hold_nothing() {
        let scratch = WorkerScratch::new(0, 8);
        assert!(scratch.is_empty());
        assert_eq!(scratch.with(|b| b.len()), 0);
    }
}
