//! f32 scratch for the tasks of a parallel loop, one buffer per worker.

use std::sync::Mutex;

/// An f32 buffer of one length for each worker thread of the current rayon
/// pool, all made before a parallel loop starts.
///
/// A buffer a loop's task makes for itself (`for_each_init`'s, or a `vec!`
/// in the closure) exists once for each worker that happens to be inside a
/// task at that moment, which the scheduler decides: the loop's peak memory
/// then differs from run to run. These are made up front, one per worker,
/// so a loop holds the same bytes every run, and no task allocates.
///
/// ```
/// use candle_cpu_math::WorkerScratch;
/// use rayon::prelude::*;
///
/// let rows = vec![1f32; 8 * 100];
/// let scratch = WorkerScratch::new(100);
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
/// ```
pub struct WorkerScratch {
    buffers: Vec<Mutex<Vec<f32>>>,
    len: usize,
}

impl WorkerScratch {
    /// A buffer of `len` for each worker of the current pool (the global
    /// pool outside one).
    pub fn new(len: usize) -> Self {
        let buffers = (0..rayon::current_num_threads())
            .map(|_| Mutex::new(vec![0f32; len]))
            .collect();
        Self { buffers, len }
    }

    /// The length of each buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffers are empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `f` on the calling worker's buffer, as the last task on this worker
    /// left it. On a thread outside the pool the buffers were made for, or
    /// when the worker's buffer is in use further up its stack (`f` ran a
    /// parallel loop of its own), `f` gets a new buffer of zeros instead.
    pub fn with<R>(&self, f: impl FnOnce(&mut [f32]) -> R) -> R {
        let own = rayon::current_thread_index().and_then(|i| self.buffers.get(i));
        match own.map(|m| m.try_lock()) {
            Some(Ok(mut buffer)) => f(&mut buffer),
            _ => f(&mut vec![0f32; self.len]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    #[test]
    fn each_worker_has_a_buffer_of_its_own() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        pool.install(|| {
            let scratch = WorkerScratch::new(5);
            assert_eq!((scratch.buffers.len(), scratch.len()), (3, 5));
            // Each task leaves its index in its worker's buffer and finds
            // what the last task on that worker left there.
            let seen: Vec<(usize, f32)> = (0..64)
                .into_par_iter()
                .map(|i| {
                    scratch.with(|b| {
                        assert_eq!(b.len(), 5);
                        let before = b[0];
                        b.fill(i as f32);
                        (rayon::current_thread_index().unwrap(), before)
                    })
                })
                .collect();
            assert!(seen.iter().all(|&(w, _)| w < 3));
            let left: Vec<f32> = scratch
                .buffers
                .iter()
                .map(|m| m.lock().unwrap()[0])
                .collect();
            assert!(left.iter().all(|&v| (0.0..64.0).contains(&v)));
        });
    }

    #[test]
    fn outside_the_pool_or_nested_a_buffer_is_made() {
        let scratch = WorkerScratch::new(4);
        // On the test's own thread, no worker of the pool.
        assert_eq!(scratch.with(|b| b.to_vec()), vec![0.0; 4]);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        pool.install(|| {
            let scratch = WorkerScratch::new(4);
            scratch.with(|outer| {
                outer.fill(7.0);
                // The worker's buffer is held: the nested call gets zeros.
                assert_eq!(scratch.with(|inner| inner.to_vec()), vec![0.0; 4]);
            });
            assert_eq!(scratch.with(|b| b.to_vec()), vec![7.0; 4]);
        });
    }

    #[test]
    fn zero_length_buffers_hold_nothing() {
        let scratch = WorkerScratch::new(0);
        assert!(scratch.is_empty());
        assert_eq!(scratch.with(|b| b.len()), 0);
    }
}
