//! The counters, for an allocation interposer that keeps them in place of
//! [`CountingAllocator`] (the `workbook-preload` library, in a Jupyter
//! kernel). Nothing here allocates, so it may be called from inside an
//! allocator.

use std::sync::atomic::{AtomicU64, Ordering};

use super::*;

/// Counts `bytes` allocated under `tag`.
pub fn allocated(tag: u8, bytes: u64) {
    record_alloc(tag, bytes)
}

/// Counts `bytes` freed that were allocated under `tag`.
pub fn freed(tag: u8, bytes: u64) {
    record_free(tag, bytes)
}

/// The tag of an allocation under `category` (0 to [`CATEGORIES`] - 1)
/// and `residency` (0 device, 1 host), or `None` out of range: for an
/// interposer that keeps the thread's tags itself.
pub fn tag_of(category: u8, residency: u8) -> Option<u8> {
    (usize::from(category) < CATEGORIES && residency <= 1)
        .then(|| category + CATEGORIES as u8 * residency)
}

/// Opens a peak frame of these counters ([`Meter::push_peak`]); false,
/// and nothing opened, when frames already nest [`MAX_PEAK_FRAMES`]
/// deep.
pub fn push_frame() -> bool {
    try_push_cpu_frame()
}

/// Closes one ([`Meter::pop_peak`]).
pub fn pop_frame() {
    pop_cpu_frame()
}

/// Every counter at one moment, laid out for a C interface. An
/// interposer reports its size ([`symbols::LAYOUT`]); a reader whose
/// size differs does not read it.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Bytes live, by category.
    pub current: [u64; CATEGORIES],
    /// The highest total.
    pub peak: u64,
    /// The split at that peak.
    pub peak_by_category: [u64; CATEGORIES],
    /// Each category's own highest.
    pub peak_each: [u64; CATEGORIES],
    /// Host-resident bytes live, by category.
    pub host: [u64; CATEGORIES],
    /// Each category's highest on the device.
    pub device_peak_each: [u64; CATEGORIES],
    /// Each category's highest on the host.
    pub host_peak_each: [u64; CATEGORIES],
    /// Blocks live.
    pub live_blocks: u64,
    /// The most blocks live at once.
    pub peak_blocks: u64,
    /// The highest device-resident total at one moment.
    pub device_peak: u64,
}

/// Reads the counters.
pub fn counts() -> Counts {
    let load = |a: &[AtomicU64; CATEGORIES]| -> [u64; CATEGORIES] {
        std::array::from_fn(|i| a[i].load(Ordering::Relaxed))
    };
    // The device half (tags 0..7) or the host half (7..14) of a tag array.
    let half = |a: &[AtomicU64; 2 * CATEGORIES], host: bool| -> [u64; CATEGORIES] {
        std::array::from_fn(|i| a[i + CATEGORIES * usize::from(host)].load(Ordering::Relaxed))
    };
    Counts {
        current: load(&CURRENT),
        peak: PEAK.load(Ordering::Relaxed),
        peak_by_category: load(&PEAK_BY_CATEGORY),
        peak_each: load(&PEAK_EACH),
        host: half(&CURRENT_TAG, true),
        device_peak_each: half(&PEAK_EACH_TAG, false),
        host_peak_each: half(&PEAK_EACH_TAG, true),
        live_blocks: BLOCKS.load(Ordering::Relaxed),
        peak_blocks: PEAK_BLOCKS.load(Ordering::Relaxed),
        device_peak: DEVICE_PEAK.load(Ordering::Relaxed),
    }
}

impl Counts {
    /// As a meter's snapshot.
    pub fn snapshot(&self) -> MemorySnapshot {
        MemorySnapshot {
            current: ByCategory(self.current),
            peak: self.peak,
            peak_by_category: ByCategory(self.peak_by_category),
            peak_each: ByCategory(self.peak_each),
            host: ByCategory(self.host),
            device_peak_each: ByCategory(self.device_peak_each),
            host_peak_each: ByCategory(self.host_peak_each),
            live_blocks: self.live_blocks,
            peak_blocks: self.peak_blocks,
            device_peak: self.device_peak,
            pool: None,
        }
    }
}

/// The names the interposer exports its counters under; a new layout of
/// [`Counts`] takes a new version.
pub mod symbols {
    /// `extern "C" fn() -> usize`: the size of its [`Counts`](super::Counts).
    pub const LAYOUT: &std::ffi::CStr = c"workbook_heap_v2_layout";
    /// `extern "C" fn() -> bool`: whether it counts this process.
    pub const COUNTING: &std::ffi::CStr = c"workbook_heap_v2_counting";
    /// `extern "C" fn(*mut Counts)`.
    pub const COUNTS: &std::ffi::CStr = c"workbook_heap_v2_counts";
    /// `extern "C" fn() -> bool`: false when frames nest too deep.
    pub const PUSH_FRAME: &std::ffi::CStr = c"workbook_heap_v2_push_frame";
    /// `extern "C" fn()`.
    pub const POP_FRAME: &std::ffi::CStr = c"workbook_heap_v2_pop_frame";
    /// `extern "C" fn(which: u32, value: u8) -> u8`: `which` 0 the
    /// category, 1 the residency; a value out of range is not set.
    pub const SWAP_TAG: &std::ffi::CStr = c"workbook_heap_v2_swap_tag";
    /// `extern "C" fn(which: u32) -> u8`.
    pub const GET_TAG: &std::ffi::CStr = c"workbook_heap_v2_get_tag";
}
