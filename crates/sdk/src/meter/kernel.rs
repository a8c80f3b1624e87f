//! The meter of a process counted by the `workbook-preload` interposer (a
//! Jupyter kernel's), and the look-up of the interposer's exports.

use super::*;

/// The interposer's exports, when this process has one.
#[derive(Clone, Copy)]
pub(super) struct Interposer {
    pub(super) counting: unsafe extern "C" fn() -> bool,
    pub(super) counts: unsafe extern "C" fn(*mut raw::Counts),
    pub(super) push_frame: unsafe extern "C" fn() -> bool,
    pub(super) pop_frame: unsafe extern "C" fn(),
    pub(super) swap_tag: unsafe extern "C" fn(u32, u8) -> u8,
    pub(super) get_tag: unsafe extern "C" fn(u32) -> u8,
}

/// The `workbook-preload` interposer loaded in this process, if any (looked
/// up once). Never called from inside the allocator: the look-up may
/// allocate.
pub(super) fn interposer() -> Option<&'static Interposer> {
    static FOUND: std::sync::OnceLock<Option<Interposer>> = std::sync::OnceLock::new();
    FOUND
        .get_or_init(|| {
            #[cfg(unix)]
            {
                use raw::symbols::*;
                let find = |name: &std::ffi::CStr| {
                    // SAFETY: dlsym with a NUL-terminated name.
                    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
                    (!p.is_null()).then_some(p)
                };
                // SAFETY: each symbol is the interposer's export of the
                // signature documented in `raw::symbols`, same version.
                type Counts = unsafe extern "C" fn(*mut raw::Counts);
                type Layout = unsafe extern "C" fn() -> usize;
                type Flag = unsafe extern "C" fn() -> bool;
                type Frame = unsafe extern "C" fn();
                type SwapTag = unsafe extern "C" fn(u32, u8) -> u8;
                type GetTag = unsafe extern "C" fn(u32) -> u8;
                type Sym = *mut libc::c_void;
                unsafe {
                    // Another layout of the counters is another interposer's.
                    let layout = std::mem::transmute::<Sym, Layout>(find(LAYOUT)?);
                    if layout() != std::mem::size_of::<raw::Counts>() {
                        return None;
                    }
                    Some(Interposer {
                        counting: std::mem::transmute::<Sym, Flag>(find(COUNTING)?),
                        counts: std::mem::transmute::<Sym, Counts>(find(COUNTS)?),
                        push_frame: std::mem::transmute::<Sym, Flag>(find(PUSH_FRAME)?),
                        pop_frame: std::mem::transmute::<Sym, Frame>(find(POP_FRAME)?),
                        swap_tag: std::mem::transmute::<Sym, SwapTag>(find(SWAP_TAG)?),
                        get_tag: std::mem::transmute::<Sym, GetTag>(find(GET_TAG)?),
                    })
                }
            }
            #[cfg(not(unix))]
            None
        })
        .as_ref()
}

/// The meter of a process counted by the `workbook-preload` interposer (a
/// Jupyter kernel started by `workbook kernel install`'s kernel spec):
/// exact as [`CpuMeter`], over the interposer's one set of counters.
#[derive(Debug, Clone, Copy)]
pub struct KernelMeter {
    _private: (),
}

impl KernelMeter {
    /// The meter, when this process has the interposer and it counts.
    pub fn new() -> Result<Self, MeterError> {
        match interposer() {
            // SAFETY: the interposer's export, no arguments.
            Some(i) if unsafe { (i.counting)() } => Ok(Self { _private: () }),
            Some(_) => Err(MeterError::NotCounting),
            None => match std::env::var("LD_PRELOAD") {
                Ok(p) if p.contains("workbook_preload") => Err(MeterError::PreloadFailed(p)),
                _ => Err(MeterError::NotInstalled),
            },
        }
    }
}

impl Meter for KernelMeter {
    fn name(&self) -> &'static str {
        "cpu-interposer"
    }

    fn snapshot(&self) -> MemorySnapshot {
        let mut counts = raw::Counts::default();
        if let Some(i) = interposer() {
            // SAFETY: the export fills the `Counts` it is given.
            unsafe { (i.counts)(&mut counts) };
        }
        counts.snapshot()
    }

    fn push_peak(&self) {
        if let Some(i) = interposer() {
            // SAFETY: the interposer's export, no arguments.
            let opened = unsafe { (i.push_frame)() };
            assert!(opened, "memory regions nest at most {MAX_PEAK_FRAMES} deep");
        }
    }

    fn pop_peak(&self) {
        if let Some(i) = interposer() {
            // SAFETY: the interposer's export, no arguments.
            unsafe { (i.pop_frame)() }
        }
    }
}
