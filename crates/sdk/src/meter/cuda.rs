//! The meter of a CUDA device: its stream-ordered memory pool, the analogue
//! of `torch.cuda.memory_allocated` and `max_memory_allocated`.
//!
//! candle allocates CUDA memory through cudarc with `cuMemAllocAsync` when the
//! device supports memory pools, so the device's default pool sees every
//! tensor. Its `USED_MEM_CURRENT` and `USED_MEM_HIGH` attributes are the bytes
//! handed out now and at most since the last reset; `RESERVED_MEM_*` is what
//! the pool holds from the driver, the analogue of `memory_reserved`. Where
//! pools are unsupported, the meter falls back to the driver's free and total
//! memory, whose peak is only seen when a snapshot is taken.
//!
//! The pool does not know what a buffer is for. So that a GPU run splits its
//! bytes by [`Category`] as the CPU run does, this module also interposes the
//! driver's allocation entry points that cudarc links to (`cuMemAllocAsync`,
//! `cuMemFreeAsync`, `cuMemAlloc_v2`, `cuMemFree_v2`): each call goes on to
//! the driver's own function (found with `dlsym(RTLD_NEXT)`) and its bytes are
//! counted under the category current on the calling thread, with the free
//! charged to what allocated the buffer. The counts land in the counting
//! allocator's device half; the heap is then all host memory. The pool's own
//! figures ([`PoolReading`]) go beside them into every snapshot, and so into
//! each region's and cell's report, as the check that every buffer was
//! counted. When no allocation was seen through the interposer (a cudarc
//! built with `dynamic-loading` bypasses it), the meter reports the pool's
//! bytes under [`Category::Other`] instead. The interposer also holds a cell
//! to its device cap ([`set_device_limit`](super::set_device_limit)).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::cudarc::driver::{sys, CudaStream};

use super::{ByCategory, Category, CpuMeter, MemorySnapshot, Meter, MeterError, PoolReading};

/// How device memory is read.
#[derive(Debug, Clone, Copy)]
enum Source {
    /// The device's default memory pool.
    Pool(sys::CUmemoryPool),
    /// `cuMemGetInfo`: total minus free, above what was used at the start.
    FreeTotal { baseline: u64 },
}

// The pool handle is an opaque driver handle, valid for the context's life
// and usable from any thread with the context bound.
unsafe impl Send for Source {}
unsafe impl Sync for Source {}

/// Device memory from the CUDA memory pool, host memory from the counting
/// allocator.
pub struct CudaMeter {
    stream: Arc<CudaStream>,
    source: Source,
    host: CpuMeter,
    /// The highest device figure seen by a snapshot (the free/total fallback).
    sampled_peak: AtomicU64,
    /// The pool's high-water mark can only be reset to zero, not restored:
    /// the enclosing frames' device peaks are kept here instead, and the
    /// innermost frame's floor is laid under every reading.
    pool_frames: Mutex<PoolFrames>,
}

/// The pool's peaks of the open frames; see [`Meter::push_peak`].
#[derive(Default)]
struct PoolFrames {
    /// The device peak each enclosing frame had reached when the next one
    /// opened.
    saved: Vec<u64>,
    /// A floor for the innermost frame's peak: the peaks of the frames it
    /// enclosed and that have closed.
    floor: u64,
}

fn check(r: sys::CUresult, what: &str) -> Result<(), MeterError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(MeterError::Cuda(format!("{what} failed: {r:?}")))
    }
}

impl CudaMeter {
    /// A meter for the device `stream` runs on. The counting allocator must
    /// be installed, for host memory.
    pub fn new(stream: Arc<CudaStream>) -> Result<Self, MeterError> {
        let host = CpuMeter::new()?;
        let ctx = stream.context().clone();
        ctx.bind_to_thread()
            .map_err(|e| MeterError::Cuda(format!("binding the CUDA context: {e}")))?;
        let source = if ctx.has_async_alloc() {
            let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
            // SAFETY: the context is bound; `pool` is a valid out pointer.
            check(
                unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) },
                "cuDeviceGetDefaultMemPool",
            )?;
            // With the default threshold of zero the pool hands its free
            // memory back to the driver at every synchronisation, and the
            // meter synchronises at every mark: the next allocations would
            // pay for mapping it again. Keeping it, as PyTorch's caching
            // allocator does, makes `reserved` mean what `memory_reserved`
            // means and keeps the meter out of the timings.
            Self::set_attribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                u64::MAX,
            )?;
            Source::Pool(pool)
        } else {
            let (free, total) = ctx
                .mem_get_info()
                .map_err(|e| MeterError::Cuda(format!("cuMemGetInfo: {e}")))?;
            Source::FreeTotal {
                baseline: (total - free) as u64,
            }
        };
        super::set_heap_is_host(true);
        let meter = Self {
            stream,
            source,
            host,
            sampled_peak: AtomicU64::new(0),
            pool_frames: Mutex::new(PoolFrames {
                saved: Vec::with_capacity(super::MAX_PEAK_FRAMES),
                floor: 0,
            }),
        };
        meter.reset_device_peak()?;
        Ok(meter)
    }

    fn set_attribute(
        pool: sys::CUmemoryPool,
        attr: sys::CUmemPool_attribute,
        mut value: u64,
    ) -> Result<(), MeterError> {
        // SAFETY: the attributes set here are 64-bit values (cuuint64_t).
        check(
            unsafe { sys::cuMemPoolSetAttribute(pool, attr, (&mut value as *mut u64).cast()) },
            "cuMemPoolSetAttribute",
        )
    }

    fn attribute(
        pool: sys::CUmemoryPool,
        attr: sys::CUmemPool_attribute,
    ) -> Result<u64, MeterError> {
        let mut value: u64 = 0;
        // SAFETY: these attributes are 64-bit values (cuuint64_t).
        check(
            unsafe { sys::cuMemPoolGetAttribute(pool, attr, (&mut value as *mut u64).cast()) },
            "cuMemPoolGetAttribute",
        )?;
        Ok(value)
    }

    /// Reads device memory, after waiting for the work queued on the stream:
    /// a stream-ordered free only counts once the stream reaches it.
    pub fn device(&self) -> Result<PoolReading, MeterError> {
        self.stream
            .synchronize()
            .map_err(|e| MeterError::Cuda(format!("synchronising the stream: {e}")))?;
        use sys::CUmemPool_attribute as A;
        match self.source {
            Source::Pool(pool) => Ok(PoolReading {
                used: Self::attribute(pool, A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
                used_high: Self::attribute(pool, A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
                reserved: Self::attribute(pool, A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            }),
            Source::FreeTotal { baseline } => {
                let (free, total) = self
                    .stream
                    .context()
                    .mem_get_info()
                    .map_err(|e| MeterError::Cuda(format!("cuMemGetInfo: {e}")))?;
                let used = ((total - free) as u64).saturating_sub(baseline);
                let high = self
                    .sampled_peak
                    .fetch_max(used, Ordering::Relaxed)
                    .max(used);
                Ok(PoolReading {
                    used,
                    used_high: high,
                    reserved: used,
                })
            }
        }
    }

    fn reset_device_peak(&self) -> Result<(), MeterError> {
        match self.source {
            Source::Pool(pool) => {
                // Zero is the one value the high-water mark can be set to:
                // it then restarts from the current use.
                Self::set_attribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                    0,
                )
            }
            Source::FreeTotal { .. } => {
                let now = self.device()?.used;
                self.sampled_peak.store(now, Ordering::Relaxed);
                Ok(())
            }
        }
    }
}

/// A snapshot of device and host together: device bytes under
/// [`Category::Other`], host-resident bytes (see
/// [`Residency`](super::Residency)) from the allocator by category.
fn combine(device: PoolReading, host: &MemorySnapshot) -> MemorySnapshot {
    let mut on_device = ByCategory::default();
    on_device.0[Category::Other as usize] = device.used;
    let mut device_high = ByCategory::default();
    device_high.0[Category::Other as usize] = device.used_high;
    let add = |a: &ByCategory, b: &ByCategory| ByCategory(std::array::from_fn(|i| a.0[i] + b.0[i]));
    MemorySnapshot {
        current: add(&on_device, &host.host),
        // The device's peak and the host's are not known to coincide: their
        // sum bounds the joint peak from above.
        peak: device.used_high + host.host_peak_each.total(),
        peak_by_category: add(&device_high, &host.host_peak_each),
        peak_each: add(&device_high, &host.host_peak_each),
        host: host.host,
        device_peak_each: device_high,
        host_peak_each: host.host_peak_each,
        live_blocks: host.live_blocks,
        peak_blocks: host.peak_blocks,
        device_peak: device.used_high,
        pool: Some(device),
    }
}

impl Meter for CudaMeter {
    fn name(&self) -> &'static str {
        match self.source {
            Source::Pool(_) => "cuda-pool",
            Source::FreeTotal { .. } => "cuda-free-total",
        }
    }

    fn snapshot(&self) -> MemorySnapshot {
        let pool = self.frame_reading();
        let counted = self.host.snapshot();
        if interposed::SEEN.load(Ordering::Relaxed) > 0 {
            // Device bytes by category from the interposer, host bytes from
            // the heap: the counting allocator's snapshot holds both.
            MemorySnapshot {
                pool: Some(pool),
                ..counted
            }
        } else {
            combine(pool, &counted)
        }
    }

    fn push_peak(&self) {
        self.host.push_peak();
        let reached = self.frame_reading().used_high;
        let mut frames = self.frames();
        frames.saved.push(reached);
        frames.floor = 0;
        // A peak that was not reset would be read as the new frame's.
        self.reset_device_peak()
            .unwrap_or_else(|e| panic!("resetting the CUDA pool's peak: {e}"));
    }

    fn pop_peak(&self) {
        self.host.pop_peak();
        let inner = self.frame_reading().used_high;
        let mut frames = self.frames();
        let outer = frames.saved.pop().unwrap_or(0);
        frames.floor = outer.max(inner);
    }
}

impl CudaMeter {
    fn frames(&self) -> std::sync::MutexGuard<'_, PoolFrames> {
        self.pool_frames.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The pool's figures for the innermost open frame: its high-water mark
    /// includes the peaks of the frames it enclosed that have closed.
    fn frame_reading(&self) -> PoolReading {
        // A figure that cannot be read must not read as zero: the panic
        // becomes the cell's error, and the cells before it keep theirs.
        let mut pool = self
            .device()
            .unwrap_or_else(|e| panic!("reading CUDA memory: {e}"));
        pool.used_high = pool.used_high.max(self.frames().floor);
        pool
    }
}

/// The driver's allocation functions, wrapped to count their bytes.
mod interposed {
    use super::*;
    use std::ffi::CStr;
    use std::sync::OnceLock;

    use sys::{CUdeviceptr, CUresult, CUstream};

    /// Allocations counted through the interposer since the process began.
    pub(super) static SEEN: AtomicU64 = AtomicU64::new(0);

    /// Live buffers: address -> (bytes, tag).
    fn live() -> &'static Mutex<HashMap<CUdeviceptr, (u64, u8)>> {
        static LIVE: OnceLock<Mutex<HashMap<CUdeviceptr, (u64, u8)>>> = OnceLock::new();
        LIVE.get_or_init(Default::default)
    }

    fn allocated(ptr: CUdeviceptr, bytes: usize) {
        let tag = crate::meter::device_allocated(bytes as u64);
        SEEN.fetch_add(1, Ordering::Relaxed);
        // The map's own growth is bookkeeping, not the caller's memory.
        let _other = Category::Other.enter();
        live()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(ptr, (bytes as u64, tag));
    }

    fn freed(ptr: CUdeviceptr) {
        let entry = live()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&ptr);
        if let Some((bytes, tag)) = entry {
            crate::meter::device_freed(tag, bytes);
        }
    }

    /// The next definition of `name` after this executable: the driver's.
    fn next<F: Copy>(name: &CStr) -> Option<F> {
        // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name; the result
        // is the driver's function of the signature the caller names.
        let f = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) };
        if f.is_null() {
            None
        } else {
            Some(unsafe { std::mem::transmute_copy::<*mut libc::c_void, F>(&f) })
        }
    }

    const NOT_FOUND: CUresult = CUresult::CUDA_ERROR_NOT_FOUND;
    /// What a full card answers; past `--max-memory`, so does the meter.
    const OUT_OF_MEMORY: CUresult = CUresult::CUDA_ERROR_OUT_OF_MEMORY;

    type AllocAsync = unsafe extern "C" fn(*mut CUdeviceptr, usize, CUstream) -> CUresult;
    type FreeAsync = unsafe extern "C" fn(CUdeviceptr, CUstream) -> CUresult;
    type Alloc = unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult;
    type Free = unsafe extern "C" fn(CUdeviceptr) -> CUresult;

    /// # Safety
    /// As the driver's `cuMemAllocAsync`.
    #[no_mangle]
    pub unsafe extern "C" fn cuMemAllocAsync(
        dptr: *mut CUdeviceptr,
        bytesize: usize,
        stream: CUstream,
    ) -> CUresult {
        static REAL: OnceLock<Option<AllocAsync>> = OnceLock::new();
        let Some(real) = *REAL.get_or_init(|| next(c"cuMemAllocAsync")) else {
            return NOT_FOUND;
        };
        if !crate::meter::device_admits(bytesize as u64) {
            return OUT_OF_MEMORY;
        }
        let r = unsafe { real(dptr, bytesize, stream) };
        if r == CUresult::CUDA_SUCCESS {
            allocated(unsafe { *dptr }, bytesize);
        }
        r
    }

    /// # Safety
    /// As the driver's `cuMemFreeAsync`.
    #[no_mangle]
    pub unsafe extern "C" fn cuMemFreeAsync(dptr: CUdeviceptr, stream: CUstream) -> CUresult {
        static REAL: OnceLock<Option<FreeAsync>> = OnceLock::new();
        let Some(real) = *REAL.get_or_init(|| next(c"cuMemFreeAsync")) else {
            return NOT_FOUND;
        };
        freed(dptr);
        unsafe { real(dptr, stream) }
    }

    /// # Safety
    /// As the driver's `cuMemAlloc_v2`.
    #[no_mangle]
    pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
        static REAL: OnceLock<Option<Alloc>> = OnceLock::new();
        let Some(real) = *REAL.get_or_init(|| next(c"cuMemAlloc_v2")) else {
            return NOT_FOUND;
        };
        if !crate::meter::device_admits(bytesize as u64) {
            return OUT_OF_MEMORY;
        }
        let r = unsafe { real(dptr, bytesize) };
        if r == CUresult::CUDA_SUCCESS {
            allocated(unsafe { *dptr }, bytesize);
        }
        r
    }

    /// # Safety
    /// As the driver's `cuMemFree_v2`.
    #[no_mangle]
    pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
        static REAL: OnceLock<Option<Free>> = OnceLock::new();
        let Some(real) = *REAL.get_or_init(|| next(c"cuMemFree_v2")) else {
            return NOT_FOUND;
        };
        freed(dptr);
        unsafe { real(dptr) }
    }
}
