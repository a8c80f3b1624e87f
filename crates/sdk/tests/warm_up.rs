//! The device's warm-up leaves no one-time allocation to a measured step:
//! gemm's packing buffer, made by each thread at its first product, exists
//! on the calling thread and on every thread of the pool afterwards.
//!
//! Its own test binary: no other test may have made the buffers first.

use candle_core::Device;
use gemm_common::gemm::L2_SLAB;
use workbook_sdk::meter::{Category, CountingAllocator, CpuMeter, Meter};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// A category nothing else in this process allocates under.
const PROBE: Category = Category::Gradients;

fn probe_bytes() -> u64 {
    CpuMeter::new().unwrap().snapshot().current.get(PROBE)
}

/// Touches this thread's packing buffer under [`PROBE`]: made now (and
/// counted there) if the thread had none.
fn touch() {
    let _probe = PROBE.enter();
    L2_SLAB.with(|_| ());
}

#[test]
fn the_warm_up_makes_every_threads_packing_buffer() {
    // The probe sees a buffer made: a thread that never multiplied.
    let before = probe_bytes();
    let fresh = std::thread::spawn(move || {
        touch();
        probe_bytes() - before
    })
    .join()
    .unwrap();
    assert!(
        fresh >= 64 << 10,
        "a new thread's buffer is the size of an L2 cache, not {fresh} bytes"
    );
    // The thread ended and freed it.
    assert_eq!(probe_bytes(), before);

    workbook_sdk::device::warm_up(&Device::Cpu).unwrap();
    let before = probe_bytes();
    touch();
    rayon::broadcast(|_| touch());
    assert_eq!(
        probe_bytes() - before,
        0,
        "every thread of the pool ({}) and the caller have theirs",
        rayon::current_num_threads()
    );
    // A later warm-up, on a thread the first never saw (the pool's part
    // has run): that caller's buffer too.
    let made = std::thread::spawn(|| {
        workbook_sdk::device::warm_up(&Device::Cpu).unwrap();
        let before = probe_bytes();
        touch();
        probe_bytes() - before
    })
    .join()
    .unwrap();
    assert_eq!(made, 0, "a new caller's buffer is made by its warm-up");
}
