//! Timing that holds up on a shared machine.
//!
//! Wall time measures everything else the machine is doing too: on two busy
//! cores one variant can look twice as slow as another only because it ran
//! while something else did. The CPU time this process spends, over all its
//! threads, counts the work a variant does, and other programs barely move
//! it. Plugins report both and compare variants by CPU time.

use std::time::Instant;

/// Seconds of CPU time this process has used, over all its threads.
pub fn process_cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant
    // every supported platform defines.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return f64::NAN;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Wall and CPU seconds of one run of something.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timed {
    /// Elapsed wall-clock seconds.
    pub wall: f64,
    /// CPU seconds of this process, all threads.
    pub cpu: f64,
}

/// Runs `f` and times it both ways.
pub fn timed<R>(f: impl FnOnce() -> R) -> (R, Timed) {
    let (wall, cpu) = (Instant::now(), process_cpu_seconds());
    let out = f();
    let t = Timed {
        wall: wall.elapsed().as_secs_f64(),
        cpu: process_cpu_seconds() - cpu,
    };
    (out, t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_work_costs_cpu_time_and_sleep_does_not() {
        let (_, busy) = timed(|| (0..20_000_000u64).fold(0u64, |a, b| a.wrapping_add(b * b)));
        assert!(busy.cpu > 0.0 && busy.wall > 0.0);
        let (_, idle) = timed(|| std::thread::sleep(std::time::Duration::from_millis(50)));
        assert!(idle.wall >= 0.05);
        assert!(idle.cpu < 0.02, "sleeping used {} s of CPU", idle.cpu);
    }
}
