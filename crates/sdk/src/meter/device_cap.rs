//! The cap on device memory: `--max-memory` for a cell on a GPU. It holds
//! the bytes handed out, what `torch.cuda.memory_allocated` counts, where
//! `torch.cuda.set_per_process_memory_fraction` holds what the caching
//! allocator reserves.
//!
//! The heap's cap ([`set_limit`](super::set_limit)) cannot hold a GPU cell:
//! its tensors are not on the heap. The CUDA meter's interposer asks
//! [`device_admits`] before each device allocation and answers
//! `CUDA_ERROR_OUT_OF_MEMORY` when the bytes counted on the device would
//! pass the cap, as the card itself does when it is full. candle turns
//! that into an error, which fails the cell; [`take_device_refusal`] then
//! tells the worker what was refused, to say so in the cell's error.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use super::OUTSIDE_HEAP;

/// The most device bytes counted at once; 0 for no cap.
static DEVICE_LIMIT: AtomicU64 = AtomicU64::new(0);
/// The first allocation refused since the last [`take_device_refusal`].
static REFUSED: Mutex<Option<DeviceRefusal>> = Mutex::new(None);

/// A device allocation the cap refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRefusal {
    /// The bytes asked for.
    pub bytes: u64,
    /// The bytes the device held (as counted) when they were asked for.
    pub held: u64,
    /// The cap.
    pub limit: u64,
}

impl fmt::Display for DeviceRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let size = |b: u64| bytesize::ByteSize::b(b).display().iec().to_string();
        write!(
            f,
            "out of memory on the device: {} more, with {} held, would pass the {} a cell may \
             hold here (`--max-memory`)",
            size(self.bytes),
            size(self.held),
            size(self.limit)
        )
    }
}

/// Caps the device bytes counted by [`device_allocated`](super::device_allocated)
/// at `bytes` (`None`: no cap but the card's own). A refused allocation fails
/// as on a full card.
pub fn set_device_limit(bytes: Option<u64>) {
    DEVICE_LIMIT.store(bytes.unwrap_or(0), Ordering::Relaxed);
}

/// The cap set by [`set_device_limit`], if any.
pub fn device_limit() -> Option<u64> {
    match DEVICE_LIMIT.load(Ordering::Relaxed) {
        0 => None,
        l => Some(l),
    }
}

/// The device bytes counted now: what the cap is held against.
pub fn device_held() -> u64 {
    OUTSIDE_HEAP.load(Ordering::Relaxed)
}

/// Whether `bytes` more on the device stay within the cap. A refusal is kept
/// for [`take_device_refusal`] (the first one, which is what failed). As
/// with the heap's cap, two threads allocating at once may each pass the
/// check: the cap can be passed by the last of them, never by a run of
/// allocations.
pub fn device_admits(bytes: u64) -> bool {
    let Some(limit) = device_limit() else {
        return true;
    };
    let held = device_held();
    if held.saturating_add(bytes) <= limit {
        return true;
    }
    let mut refused = REFUSED.lock().unwrap_or_else(|e| e.into_inner());
    refused.get_or_insert(DeviceRefusal { bytes, held, limit });
    false
}

/// The first allocation the cap refused since the last call, if any.
pub fn take_device_refusal() -> Option<DeviceRefusal> {
    REFUSED.lock().unwrap_or_else(|e| e.into_inner()).take()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_says_what_was_asked_held_and_allowed() {
        let r = DeviceRefusal {
            bytes: 3 << 20,
            held: 1 << 30,
            limit: 1 << 30,
        };
        assert_eq!(
            r.to_string(),
            "out of memory on the device: 3.0 MiB more, with 1.0 GiB held, would pass the \
             1.0 GiB a cell may hold here (`--max-memory`)"
        );
    }
}
