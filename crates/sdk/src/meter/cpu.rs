//! The CPU meter over the counting allocator, and what a meter that cannot
//! measure says.

use super::*;

/// The CPU meter: reads [`CountingAllocator`]'s counters.
#[derive(Debug, Clone, Copy)]
pub struct CpuMeter {
    _private: (),
}

/// Returned when a meter is asked for but cannot measure.
#[derive(Debug, thiserror::Error)]
pub enum MeterError {
    /// The counting allocator is not the global allocator of this process.
    #[error(
        "the counting allocator is not installed: add \
         `#[global_allocator] static A: workbook_sdk::meter::CountingAllocator = \
         workbook_sdk::meter::CountingAllocator;` to the binary (in a Jupyter notebook, use \
         the \"Rust (workbook)\" kernel that `workbook kernel install` installs)"
    )]
    NotInstalled,
    /// The interposer is loaded but does not count this process (only
    /// evcxr's runtime, or a process with `WORKBOOK_HEAP_COUNT=1`).
    #[error(
        "the allocation interposer is loaded but does not count this process: it counts \
         evcxr's runtime (EVCXR_IS_RUNTIME set) or a process started with WORKBOOK_HEAP_COUNT=1"
    )]
    NotCounting,
    /// `LD_PRELOAD` names the interposer, which is not in the process.
    #[error(
        "LD_PRELOAD is `{0}`, but the allocation interposer is not loaded (the file moved or \
         was rebuilt away?): build it (`cargo build --release -p workbook-preload`) and run \
         `workbook kernel install` again, then restart the kernel"
    )]
    PreloadFailed(String),
    /// The CUDA device's memory could not be read.
    #[error("cannot read CUDA memory: {0}")]
    Cuda(String),
}

impl CpuMeter {
    /// A meter over the counting allocator; fails when it is not installed,
    /// since every figure would then read zero.
    pub fn new() -> Result<Self, MeterError> {
        if CountingAllocator::is_installed() {
            Ok(Self { _private: () })
        } else {
            Err(MeterError::NotInstalled)
        }
    }
}

impl Meter for CpuMeter {
    fn name(&self) -> &'static str {
        "cpu-allocator"
    }

    fn snapshot(&self) -> MemorySnapshot {
        raw::counts().snapshot()
    }

    fn push_peak(&self) {
        push_cpu_frame();
    }

    fn pop_peak(&self) {
        pop_cpu_frame();
    }
}
