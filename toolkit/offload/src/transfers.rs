//! Counting the copies between device and host.

use std::time::Instant;

use candle_core::{Device, Result, Tensor, Var};

/// Bytes and time of the copies between device and host.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Transfers {
    /// Bytes copied to the host.
    pub to_host_bytes: u64,
    /// Bytes copied to the device.
    pub to_device_bytes: u64,
    /// Seconds spent copying.
    pub seconds: f64,
}

impl Transfers {
    /// Bytes copied either way.
    pub fn bytes(&self) -> u64 {
        self.to_host_bytes + self.to_device_bytes
    }

    /// What was copied since `earlier`, a copy of these counters (zero
    /// where `earlier` is not earlier).
    pub fn since(&self, earlier: &Transfers) -> Transfers {
        Transfers {
            to_host_bytes: self.to_host_bytes.saturating_sub(earlier.to_host_bytes),
            to_device_bytes: self.to_device_bytes.saturating_sub(earlier.to_device_bytes),
            seconds: (self.seconds - earlier.seconds).max(0.0),
        }
    }

    /// Copies `t` to `host` as a new variable: one copy when `t` is
    /// already there, else the transfer and the variable's own copy.
    pub fn to_host_var(&mut self, t: &Tensor, host: &Device) -> Result<Var> {
        let start = Instant::now();
        let var = if t.device().same_device(host) {
            // `from_tensor` of a plain tensor copies it: that is the copy.
            Var::from_tensor(&t.detach())?
        } else {
            Var::from_tensor(&t.detach().to_device(host)?)?
        };
        self.seconds += start.elapsed().as_secs_f64();
        self.to_host_bytes += (t.elem_count() * t.dtype().size_in_bytes()) as u64;
        Ok(var)
    }

    fn copy(&mut self, t: &Tensor, to: &Device) -> Result<(Tensor, u64)> {
        let start = Instant::now();
        // Data, not autograd history; and a transfer is a copy even when
        // host and device are the same memory (a CPU-only run), so that
        // what it costs shows.
        let t = t.detach();
        let out = if t.device().same_device(to) {
            t.copy()?
        } else {
            t.to_device(to)?
        };
        self.seconds += start.elapsed().as_secs_f64();
        Ok((out, (t.elem_count() * t.dtype().size_in_bytes()) as u64))
    }

    /// Copies `t` to `host`.
    pub fn to_host(&mut self, t: &Tensor, host: &Device) -> Result<Tensor> {
        let (out, bytes) = self.copy(t, host)?;
        self.to_host_bytes += bytes;
        Ok(out)
    }

    /// Copies `t` to `device`.
    pub fn to_device(&mut self, t: &Tensor, device: &Device) -> Result<Tensor> {
        let (out, bytes) = self.copy(t, device)?;
        self.to_device_bytes += bytes;
        Ok(out)
    }
}
