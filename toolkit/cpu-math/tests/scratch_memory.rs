//! A parallel loop on `WorkerScratch` makes no buffer inside its tasks,
//! whichever workers run them.

use candle_cpu_math::WorkerScratch;
use candle_toolkit_alloc_count::{measure, Counting};
use rayon::prelude::*;

#[global_allocator]
static ALLOC: Counting = Counting;

#[test]
fn a_loop_on_worker_scratch_allocates_nothing_in_its_tasks() {
    const LEN: usize = 100_000;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .build()
        .unwrap();
    pool.install(|| {
        let (scratch, made) = measure(|| WorkerScratch::new(LEN, 256));
        // Four buffers of 400,000 bytes (four workers, 256 tasks), whatever
        // runs afterwards.
        assert!(made.held >= 4 * 4 * LEN as isize, "{made:?}");
        let task = |i: usize| {
            scratch.with(|b| {
                b[i % LEN] = i as f32;
                b[LEN - 1]
            })
        };
        // Every worker started and the pool settled before measuring.
        let _: f32 = (0..256).into_par_iter().map(task).sum();
        for _ in 0..10 {
            let (_, usage) = measure(|| (0..256).into_par_iter().map(task).sum::<f32>());
            // A buffer made by any of the 256 tasks would be 400,000 bytes;
            // rayon's own bookkeeping stays far below one.
            assert!(usage.allocated < 4 * LEN as u64, "{usage:?}");
        }
        assert_eq!(scratch.extra(), 0);
    });
}
