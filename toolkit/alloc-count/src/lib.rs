//! A counting global allocator for the toolkit's memory tests and benches:
//! bytes live, the most live at once, and bytes allocated, around a closure.
//!
//! A test binary installs it and measures one thing at a time (the counts
//! are process-wide: keep a measuring test alone in its file, or take
//! turns):
//!
//! ```
//! use candle_toolkit_alloc_count::{measure, Counting};
//! #[global_allocator]
//! static ALLOC: Counting = Counting;
//! # fn main() {
//! let (v, usage) = measure(|| vec![0u8; 1000]);
//! assert!(usage.peak >= 1000 && usage.held >= 1000 && usage.allocated >= 1000);
//! drop(v);
//! # }
//! ```
#![warn(missing_docs)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, AtomicU64, Ordering::Relaxed};

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);
static ALLOCATED: AtomicU64 = AtomicU64::new(0);

/// The system allocator, counting.
pub struct Counting;

/// Counts `size` new bytes live.
fn count_alloc(size: usize) {
    let size = size as isize;
    PEAK.fetch_max(LIVE.fetch_add(size, Relaxed) + size, Relaxed);
    ALLOCATED.fetch_add(size as u64, Relaxed);
}

// SAFETY: every call is forwarded to the system allocator unchanged, so a
// program measured does what it does without the count: a zeroed block is
// the system's (`calloc`, which can take fresh pages already zero instead
// of writing zeros over a plain block) and a block that grows is the
// system's `realloc`.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            count_alloc(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            count_alloc(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if p.is_null() {
            return p;
        }
        if p == ptr {
            // Grown or shrunk in place: one block throughout.
            let change = new_size as isize - layout.size() as isize;
            PEAK.fetch_max(LIVE.fetch_add(change, Relaxed) + change, Relaxed);
            ALLOCATED.fetch_add(new_size.saturating_sub(layout.size()) as u64, Relaxed);
        } else {
            // Moved: the new block was made while the old one held its
            // contents, as `alloc`, copy and `dealloc` would.
            count_alloc(new_size);
            LIVE.fetch_sub(layout.size() as isize, Relaxed);
        }
        p
    }
}

/// What a closure did to the heap, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// The most live at once above the start.
    pub peak: isize,
    /// Live at the end above the start (what the closure's result holds).
    pub held: isize,
    /// Allocated in all, freed or not.
    pub allocated: u64,
}

/// Bytes live now.
pub fn live() -> isize {
    LIVE.load(Relaxed)
}

/// Runs `f` and reports its [`Usage`].
pub fn measure<R>(f: impl FnOnce() -> R) -> (R, Usage) {
    let start = LIVE.load(Relaxed);
    PEAK.store(start, Relaxed);
    let allocated = ALLOCATED.load(Relaxed);
    let r = f();
    let usage = Usage {
        peak: PEAK.load(Relaxed) - start,
        held: LIVE.load(Relaxed) - start,
        allocated: ALLOCATED.load(Relaxed) - allocated,
    };
    (r, usage)
}
