//! The one rule every plan keeps: a predicted or measured peak, grown by
//! the plan's margin, must stay within the budget. The margin absorbs what
//! a prediction or a calibration cannot see (allocator rounding, a
//! framework's workspace), so a plan that fits on paper fits on the device.

/// Whether a step holding `peak` bytes fits `budget` with `margin` room:
/// `peak × (1 + margin) ≤ budget`.
pub fn fits(peak: u64, budget: u64, margin: f64) -> bool {
    peak as f64 * (1.0 + margin) <= budget as f64
}

/// The budget a step holding `peak` bytes needs with `margin` room, in whole
/// bytes: the least budget [`fits`] accepts it under (up to the rounding of
/// an `f64`, exact below 2^53 bytes).
pub fn room(peak: u64, margin: f64) -> u64 {
    (peak as f64 * (1.0 + margin)).ceil() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peak_fits_exactly_at_its_room_and_not_a_byte_below() {
        for (peak, margin) in [(1000, 0.05), (1 << 30, 0.1), (7, 0.0), (3, 0.5)] {
            let need = room(peak, margin);
            assert!(fits(peak, need, margin), "{peak} at {margin} fits {need}");
            assert!(
                !fits(peak, need - 1, margin),
                "{peak} at {margin} overflows {}",
                need - 1
            );
        }
        assert_eq!(room(1000, 0.05), 1050);
        assert_eq!(room(3, 0.5), 5);
    }
}
