//! Measuring memory: categories, snapshots, the [`Meter`] trait and the CPU
//! counting allocator behind [`CpuMeter`].
//!
//! Every byte a cell reports comes from a meter, never from a formula. On the
//! CPU that is [`CountingAllocator`], a global allocator that counts what it
//! hands out; candle keeps CPU tensor data in `Vec`s, so every tensor passes
//! through it. A CUDA meter reads the device memory pool instead; plugins see
//! only the [`Meter`] trait and never know which one they have.
//!
//! # Attribution by category
//!
//! Each allocation is tagged with the [`Category`] current on the allocating
//! thread (see [`Category::enter`]). The tag lives in a small header in front of
//! the block, so a free is charged to the category that allocated it, wherever
//! it is freed.
//!
//! # In a Jupyter kernel
//!
//! A process whose global allocator is not ours (evcxr's kernel, which runs
//! each notebook cell as a library of its own, each with its own copy of
//! this crate) is counted by the `workbook-preload` library instead:
//! loaded with `LD_PRELOAD`, it takes the C allocator's place, keeps the
//! same counters with the same headers (through [`raw`]), and exports them.
//! [`KernelMeter`] reads them, and the tags set here ([`Category::enter`],
//! [`Residency::enter`], [`swap_tags`]) are set there too, so every cell's
//! copy of this crate shares one set of counters.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod device_cap;
mod kernel;
mod snapshot;

pub use cpu::{CpuMeter, MeterError};
pub use device_cap::{
    device_admits, device_held, device_limit, set_device_limit, take_device_refusal, DeviceRefusal,
};
use kernel::interposer;
pub use kernel::KernelMeter;
pub use snapshot::{ByCategory, MemorySnapshot, PoolReading, CATEGORIES};

/// What a block of memory holds, in the sense of PyTorch's memory timeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    /// Model weights and biases.
    Parameters,
    /// Gradients produced by a backward pass, and accumulated gradients.
    Gradients,
    /// Optimizer state, such as AdamW's two moments.
    OptimizerState,
    /// Activations saved by the forward pass and temporaries of the backward.
    Activations,
    /// Input batches and targets.
    Inputs,
    /// Buffers that a collective (all-reduce, all-gather...) sends from or
    /// receives into.
    Communication,
    /// Everything not tagged otherwise.
    Other,
}

impl Category {
    /// All categories, in the order tables and plots show them.
    pub const ALL: [Category; CATEGORIES] = [
        Category::Parameters,
        Category::Gradients,
        Category::OptimizerState,
        Category::Activations,
        Category::Inputs,
        Category::Communication,
        Category::Other,
    ];

    /// The name used in JSON and tables.
    pub fn name(self) -> &'static str {
        match self {
            Category::Parameters => "parameters",
            Category::Gradients => "gradients",
            Category::OptimizerState => "optimizer_state",
            Category::Activations => "activations",
            Category::Inputs => "inputs",
            Category::Communication => "communication",
            Category::Other => "other",
        }
    }

    fn index(self) -> usize {
        self as usize
    }

    /// Tags every allocation made on this thread with `self` until the guard is
    /// dropped; the previous tag is restored then, so scopes nest.
    #[must_use = "the category applies only while the guard lives"]
    pub fn enter(self) -> CategoryGuard {
        let previous = set_tag(Tag::Category, self as u8);
        CategoryGuard { previous }
    }

    /// Runs `f` with allocations tagged as `self`.
    pub fn scope<R>(self, f: impl FnOnce() -> R) -> R {
        let _guard = self.enter();
        f()
    }

    /// The category that allocations on this thread are tagged with now.
    pub fn current() -> Category {
        let tag = match interposer() {
            // SAFETY: the interposer's export, with its documented signature.
            Some(i) => unsafe { (i.get_tag)(Tag::Category as u32) },
            None => current_category(),
        };
        Category::ALL[tag as usize % CATEGORIES]
    }
}

/// Restores the previous category when dropped; see [`Category::enter`].
#[derive(Debug)]
pub struct CategoryGuard {
    previous: u8,
}

impl Drop for CategoryGuard {
    fn drop(&mut self) {
        set_tag(Tag::Category, self.previous);
    }
}

/// Where a block would live: on the accelerator or in host memory.
///
/// On a CPU-only run both are the same RAM, and offloading code still copies
/// what it would copy between them: the tag records which side each copy
/// stands for, so the meter can show the shift. On a GPU the device side is
/// read from the device's memory pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Residency {
    /// Device memory (the default).
    Device,
    /// Host memory.
    Host,
}

impl Residency {
    /// Tags allocations on this thread as living on `self` until the guard
    /// is dropped; scopes nest.
    #[must_use = "the residency applies only while the guard lives"]
    pub fn enter(self) -> ResidencyGuard {
        let previous = set_tag(Tag::Residency, self as u8);
        ResidencyGuard { previous }
    }

    /// Runs `f` with allocations tagged as living on `self`.
    pub fn scope<R>(self, f: impl FnOnce() -> R) -> R {
        let _guard = self.enter();
        f()
    }
}

/// Tags allocations on this thread with `category` and `residency`, and
/// returns the previous tags packed for [`restore_tags`]: the two halves of
/// a scope whose guard cannot be held (an observer's enter and leave).
pub fn swap_tags(category: Category, residency: Residency) -> u64 {
    let c = set_tag(Tag::Category, category as u8);
    let r = set_tag(Tag::Residency, residency as u8);
    u64::from(c) | (u64::from(r) << 8)
}

/// Restores tags that [`swap_tags`] returned.
pub fn restore_tags(previous: u64) {
    set_tag(Tag::Category, (previous & 0xff) as u8);
    set_tag(Tag::Residency, ((previous >> 8) & 0xff) as u8);
}

/// The two tags of this thread's allocations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
enum Tag {
    Category = 0,
    Residency = 1,
}

/// Sets one of this thread's tags, here and in the interposer when there
/// is one (whose value, the one that counts then, is returned as the
/// previous one).
fn set_tag(which: Tag, value: u8) -> u8 {
    let cell = match which {
        Tag::Category => &CURRENT_CATEGORY,
        Tag::Residency => &CURRENT_RESIDENCY,
    };
    let local = cell.try_with(|c| c.replace(value)).unwrap_or(0);
    match interposer() {
        // SAFETY: the interposer's export, with its documented signature.
        Some(i) => unsafe { (i.swap_tag)(which as u32, value) },
        None => local,
    }
}

/// Restores the previous residency when dropped; see [`Residency::enter`].
#[derive(Debug)]
pub struct ResidencyGuard {
    previous: u8,
}

impl Drop for ResidencyGuard {
    fn drop(&mut self) {
        set_tag(Tag::Residency, self.previous);
    }
}

/// A source of memory measurements.
///
/// Implemented by [`CpuMeter`] (the counting allocator) and, in builds with
/// CUDA, by a meter over the device's memory pool. Plugins take `&dyn Meter`
/// through their context and never name an implementation.
pub trait Meter: Send + Sync {
    /// A short name for reports, such as `cpu-allocator`.
    fn name(&self) -> &'static str;
    /// Reads the counters. Implementations synchronise the device first.
    /// The peaks are those of the innermost open frame (see
    /// [`Meter::push_peak`]), or of the whole process when none is open.
    fn snapshot(&self) -> MemorySnapshot;
    /// Opens a peak frame: from now on the peaks restart from what is live,
    /// so the next snapshot's peak is local to the frame. The enclosing
    /// frame's peaks are kept aside, not lost.
    fn push_peak(&self);
    /// Closes the innermost frame: the enclosing frame's peaks become the
    /// higher of their own and the closed frame's, so an outer measurement is
    /// a true high-water mark of everything inside it.
    fn pop_peak(&self);
}

/// How deep peak frames (regions inside regions inside a cell) may nest.
pub const MAX_PEAK_FRAMES: usize = 32;

thread_local! {
    static CURRENT_CATEGORY: Cell<u8> = const { Cell::new(Category::Other as u8) };
    static CURRENT_RESIDENCY: Cell<u8> = const { Cell::new(Residency::Device as u8) };
}

fn current_category() -> u8 {
    CURRENT_CATEGORY
        .try_with(|c| c.get())
        .unwrap_or(Category::Other as u8)
}

/// Set when tensors live on a GPU: the heap is then host memory whatever the
/// residency asked for, and the device's bytes come from [`device_allocated`].
static HEAP_IS_HOST: AtomicBool = AtomicBool::new(false);

/// The header's tag: the category, plus CATEGORIES for host residency.
fn current_tag() -> u8 {
    let residency = if HEAP_IS_HOST.load(Ordering::Relaxed) {
        Residency::Host as u8
    } else {
        CURRENT_RESIDENCY.try_with(|c| c.get()).unwrap_or(0)
    };
    current_category() + CATEGORIES as u8 * residency
}

/// Counts `bytes` of device memory allocated outside the heap (a GPU buffer)
/// under the current thread's category, as device-resident. Returns the tag
/// to give [`device_freed`] when the buffer is freed, so that the free is
/// charged to what allocated it.
pub fn device_allocated(bytes: u64) -> u8 {
    let tag = current_category();
    record_alloc(tag, bytes);
    OUTSIDE_HEAP.fetch_add(bytes, Ordering::Relaxed);
    tag
}

/// Counts the free of a buffer counted by [`device_allocated`].
pub fn device_freed(tag: u8, bytes: u64) {
    record_free(tag, bytes);
    OUTSIDE_HEAP.fetch_sub(bytes, Ordering::Relaxed);
}

/// Bytes counted by [`device_allocated`] and not yet freed: device memory,
/// which the heap's cap ([`set_limit`]) does not apply to.
static OUTSIDE_HEAP: AtomicU64 = AtomicU64::new(0);

/// Declares that tensors live on a GPU: from now on the heap counts as host
/// memory, and device memory is what [`device_allocated`] reports.
pub fn set_heap_is_host(on: bool) {
    HEAP_IS_HOST.store(on, Ordering::Relaxed);
}

static INSTALLED: AtomicBool = AtomicBool::new(false);
/// The most bytes the counting allocator hands out at once; 0 for no limit.
static LIMIT: AtomicU64 = AtomicU64::new(0);

/// Caps the heap bytes counted live at once at `bytes` (`None`: no cap;
/// device buffers counted by [`device_allocated`] are not held to it). An
/// allocation that would pass it fails as if the system had no memory left,
/// which Rust reports as `memory allocation of N bytes failed` and answers by
/// aborting: a cell asking for more than the machine has fails at once, in
/// its own worker process, rather than driving the machine into swap or the
/// kernel's out-of-memory killer.
pub fn set_limit(bytes: Option<u64>) {
    LIMIT.store(bytes.unwrap_or(0), Ordering::Relaxed);
}

/// The cap set by [`set_limit`], if any.
pub fn limit() -> Option<u64> {
    match LIMIT.load(Ordering::Relaxed) {
        0 => None,
        l => Some(l),
    }
}
static CURRENT: [AtomicU64; CATEGORIES] = [const { AtomicU64::new(0) }; CATEGORIES];
static TOTAL: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);
static PEAK_BY_CATEGORY: [AtomicU64; CATEGORIES] = [const { AtomicU64::new(0) }; CATEGORIES];
static PEAK_EACH: [AtomicU64; CATEGORIES] = [const { AtomicU64::new(0) }; CATEGORIES];
/// By tag: category, and residency (device below CATEGORIES, host above).
static CURRENT_TAG: [AtomicU64; 2 * CATEGORIES] = [const { AtomicU64::new(0) }; 2 * CATEGORIES];
static PEAK_EACH_TAG: [AtomicU64; 2 * CATEGORIES] = [const { AtomicU64::new(0) }; 2 * CATEGORIES];
static BLOCKS: AtomicU64 = AtomicU64::new(0);
static PEAK_BLOCKS: AtomicU64 = AtomicU64::new(0);
/// Device-resident bytes live, and their highest at one moment.
static DEVICE_TOTAL: AtomicU64 = AtomicU64::new(0);
static DEVICE_PEAK: AtomicU64 = AtomicU64::new(0);

/// The peaks of an enclosing frame, kept while an inner frame is open.
#[derive(Clone, Copy)]
struct SavedPeaks {
    peak: u64,
    peak_by_category: [u64; CATEGORIES],
    peak_each: [u64; CATEGORIES],
    peak_each_tag: [u64; 2 * CATEGORIES],
    peak_blocks: u64,
    device_peak: u64,
}

impl SavedPeaks {
    const ZERO: Self = Self {
        peak: 0,
        peak_by_category: [0; CATEGORIES],
        peak_each: [0; CATEGORIES],
        peak_each_tag: [0; 2 * CATEGORIES],
        peak_blocks: 0,
        device_peak: 0,
    };
}

/// The stack of enclosing frames: a fixed array, so that opening a frame
/// allocates nothing and never shows in what it measures.
struct Frames {
    depth: usize,
    saved: [SavedPeaks; MAX_PEAK_FRAMES],
}

static FRAMES: std::sync::Mutex<Frames> = std::sync::Mutex::new(Frames {
    depth: 0,
    saved: [SavedPeaks::ZERO; MAX_PEAK_FRAMES],
});

fn frames() -> std::sync::MutexGuard<'static, Frames> {
    FRAMES.lock().unwrap_or_else(|e| e.into_inner())
}

fn load_all<const N: usize>(a: &[AtomicU64; N]) -> [u64; N] {
    std::array::from_fn(|i| a[i].load(Ordering::Relaxed))
}

fn restart_peaks() {
    PEAK.store(TOTAL.load(Ordering::Relaxed), Ordering::Relaxed);
    for (i, current) in CURRENT.iter().enumerate() {
        let now = current.load(Ordering::Relaxed);
        PEAK_BY_CATEGORY[i].store(now, Ordering::Relaxed);
        PEAK_EACH[i].store(now, Ordering::Relaxed);
    }
    for (peak, current) in PEAK_EACH_TAG.iter().zip(CURRENT_TAG.iter()) {
        peak.store(current.load(Ordering::Relaxed), Ordering::Relaxed);
    }
    PEAK_BLOCKS.store(BLOCKS.load(Ordering::Relaxed), Ordering::Relaxed);
    DEVICE_PEAK.store(DEVICE_TOTAL.load(Ordering::Relaxed), Ordering::Relaxed);
}

/// Opens a frame of the counting allocator's peaks; see [`Meter::push_peak`].
///
/// # Panics
/// When frames nest deeper than [`MAX_PEAK_FRAMES`].
fn push_cpu_frame() {
    assert!(
        try_push_cpu_frame(),
        "memory regions nest at most {MAX_PEAK_FRAMES} deep"
    );
}

/// [`push_cpu_frame`], false instead of a panic when frames nest too deep.
fn try_push_cpu_frame() -> bool {
    let mut frames = frames();
    let depth = frames.depth;
    if depth >= MAX_PEAK_FRAMES {
        return false;
    }
    frames.saved[depth] = SavedPeaks {
        peak: PEAK.load(Ordering::Relaxed),
        peak_by_category: load_all(&PEAK_BY_CATEGORY),
        peak_each: load_all(&PEAK_EACH),
        peak_each_tag: load_all(&PEAK_EACH_TAG),
        peak_blocks: PEAK_BLOCKS.load(Ordering::Relaxed),
        device_peak: DEVICE_PEAK.load(Ordering::Relaxed),
    };
    frames.depth += 1;
    restart_peaks();
    true
}

/// Closes a frame, folding its peaks into the enclosing one's; a pop with no
/// frame open leaves the process-wide peaks as they are.
fn pop_cpu_frame() {
    let mut frames = frames();
    if frames.depth == 0 {
        return;
    }
    frames.depth -= 1;
    let outer = frames.saved[frames.depth];
    if outer.peak >= PEAK.load(Ordering::Relaxed) {
        // The enclosing frame's own peak was higher: it and its split stand.
        PEAK.store(outer.peak, Ordering::Relaxed);
        for (slot, v) in PEAK_BY_CATEGORY.iter().zip(outer.peak_by_category) {
            slot.store(v, Ordering::Relaxed);
        }
    }
    for (slot, v) in PEAK_EACH.iter().zip(outer.peak_each) {
        slot.fetch_max(v, Ordering::Relaxed);
    }
    for (slot, v) in PEAK_EACH_TAG.iter().zip(outer.peak_each_tag) {
        slot.fetch_max(v, Ordering::Relaxed);
    }
    PEAK_BLOCKS.fetch_max(outer.peak_blocks, Ordering::Relaxed);
    DEVICE_PEAK.fetch_max(outer.device_peak, Ordering::Relaxed);
}

/// The header in front of each block: big enough for the tag, and a multiple
/// of every alignment up to 16 so the block stays aligned.
const HEADER: usize = 16;

fn outer(layout: Layout) -> Option<(Layout, usize)> {
    let offset = layout.align().max(HEADER);
    let size = layout.size().checked_add(offset)?;
    let outer = Layout::from_size_align(size, layout.align().max(HEADER)).ok()?;
    Some((outer, offset))
}

fn record_alloc(tag: u8, size: u64) {
    let cat = tag as usize % CATEGORIES;
    let mine = CURRENT[cat].fetch_add(size, Ordering::Relaxed) + size;
    PEAK_EACH[cat].fetch_max(mine, Ordering::Relaxed);
    let tagged = CURRENT_TAG[tag as usize].fetch_add(size, Ordering::Relaxed) + size;
    PEAK_EACH_TAG[tag as usize].fetch_max(tagged, Ordering::Relaxed);
    let total = TOTAL.fetch_add(size, Ordering::Relaxed) + size;
    let blocks = BLOCKS.fetch_add(1, Ordering::Relaxed) + 1;
    PEAK_BLOCKS.fetch_max(blocks, Ordering::Relaxed);
    if (tag as usize) < CATEGORIES {
        let device = DEVICE_TOTAL.fetch_add(size, Ordering::Relaxed) + size;
        DEVICE_PEAK.fetch_max(device, Ordering::Relaxed);
    }
    if total > PEAK.load(Ordering::Relaxed) && PEAK.fetch_max(total, Ordering::Relaxed) < total {
        for (peak, current) in PEAK_BY_CATEGORY.iter().zip(CURRENT.iter()) {
            peak.store(current.load(Ordering::Relaxed), Ordering::Relaxed);
        }
    }
}

fn record_free(tag: u8, size: u64) {
    CURRENT[tag as usize % CATEGORIES].fetch_sub(size, Ordering::Relaxed);
    CURRENT_TAG[tag as usize].fetch_sub(size, Ordering::Relaxed);
    TOTAL.fetch_sub(size, Ordering::Relaxed);
    BLOCKS.fetch_sub(1, Ordering::Relaxed);
    if (tag as usize) < CATEGORIES {
        DEVICE_TOTAL.fetch_sub(size, Ordering::Relaxed);
    }
}

/// A global allocator that counts the bytes it hands out, by [`Category`].
///
/// Install it in a binary (or a test binary) to make [`CpuMeter`] work:
///
/// ```ignore
/// #[global_allocator]
/// static ALLOC: workbook_sdk::meter::CountingAllocator = workbook_sdk::meter::CountingAllocator;
/// ```
///
/// It counts the sizes callers ask for, so a 1000 x 1000 f32 tensor moves the
/// count by exactly 4,000,000 bytes of data (the header is not counted).
#[derive(Debug, Default, Clone, Copy)]
pub struct CountingAllocator;

// SAFETY: every block handed out is a `System` block of the `outer` layout,
// offset by `offset` bytes, which keeps the caller's alignment; the tag byte
// sits in the header, inside the `System` block, just before the caller's part.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        self.alloc_with(layout, |l| unsafe { System.alloc(l) })
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        self.alloc_with(layout, |l| unsafe { System.alloc_zeroed(l) })
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let Some((outer, offset)) = outer(layout) else {
            return;
        };
        let tag = unsafe { *ptr.sub(1) };
        record_free(tag, layout.size() as u64);
        unsafe { System.dealloc(ptr.sub(offset), outer) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let Some((old_outer, offset)) = outer(layout) else {
            return std::ptr::null_mut();
        };
        let Some(new_outer_size) = new_size.checked_add(offset) else {
            return std::ptr::null_mut();
        };
        if new_size > layout.size() && over_limit((new_size - layout.size()) as u64) {
            return std::ptr::null_mut();
        }
        // A block that grows stays what it was: keep its tag.
        let tag = unsafe { *ptr.sub(1) };
        let base = unsafe { System.realloc(ptr.sub(offset), old_outer, new_outer_size) };
        if base.is_null() {
            return base;
        }
        record_free(tag, layout.size() as u64);
        record_alloc(tag, new_size as u64);
        unsafe { base.add(offset) }
    }
}

/// Whether `more` bytes on top of what the heap holds would pass the cap.
fn over_limit(more: u64) -> bool {
    let limit = LIMIT.load(Ordering::Relaxed);
    limit != 0 && {
        let heap = TOTAL
            .load(Ordering::Relaxed)
            .saturating_sub(OUTSIDE_HEAP.load(Ordering::Relaxed));
        heap.saturating_add(more) > limit
    }
}

impl CountingAllocator {
    unsafe fn alloc_with(&self, layout: Layout, f: impl FnOnce(Layout) -> *mut u8) -> *mut u8 {
        INSTALLED.store(true, Ordering::Relaxed);
        let Some((outer, offset)) = outer(layout) else {
            return std::ptr::null_mut();
        };
        if over_limit(layout.size() as u64) {
            return std::ptr::null_mut();
        }
        let base = f(outer);
        if base.is_null() {
            return base;
        }
        let tag = current_tag();
        // SAFETY: `offset >= 1` and the outer block is `offset + size` long.
        unsafe {
            let user = base.add(offset);
            *user.sub(1) = tag;
            record_alloc(tag, layout.size() as u64);
            user
        }
    }

    /// Whether this allocator is the process's global allocator.
    pub fn is_installed() -> bool {
        INSTALLED.load(Ordering::Relaxed)
    }
}

pub mod raw;
