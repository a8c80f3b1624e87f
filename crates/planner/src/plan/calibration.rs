//! A recipe's measured steps and the peak and time they predict at any
//! batch and micro-batch.

use serde::Serialize;

use workbook_models::Recipe;

use crate::stage::Stage;

/// The measured steps of one recipe in one dtype.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Calibration {
    /// The recipe.
    pub recipe: Recipe,
    /// Whether every layer is checkpointed.
    pub checkpointed: bool,
    /// The dtype's name.
    pub dtype: &'static str,
    /// How the ranks share the training (none: one process).
    pub stage: Option<Stage>,
    /// The batches measured: 1, 2, 4 and the doublings that follow where
    /// bf16's products need them (see the module).
    pub batches: Vec<usize>,
    /// Peak at each of `batches` (per rank).
    pub peaks: Vec<u64>,
    /// Step time at each of `batches`, seconds.
    pub seconds: Vec<f64>,
    /// At each of `batches`, the peak of each stretch of the step between
    /// two of its backward's marks
    /// ([`StepReport::phases`](crate::step::StepReport::phases)): a moment whose
    /// own line is steeper overtakes the step's peak at a larger batch.
    pub phase_peaks: Vec<Vec<u64>>,
    /// Bytes of the parameters' gradients held at the start of each
    /// stretch, where the calibrated step collected them as its backward
    /// handed them over
    /// ([`StepReport::phase_grads`](crate::step::StepReport::phase_grads));
    /// empty where it did not.
    pub phase_grads: Vec<u64>,
    /// Bytes of the whole model's parameters in the dtype (what DDP and
    /// stages 1 and 2 hold on each rank; under stage 3 a rank holds its f32
    /// blocks of them instead).
    pub param_bytes: u64,
    /// Bytes of the gradient sum held while micro-batches accumulate: the
    /// parameters' size, or under ZeRO stages 2 and 3 this rank's f32
    /// blocks.
    pub sum_bytes: u64,
    /// Bytes of one sequence's tokens and targets: the whole batch's are
    /// held while its micro-batches run one after another.
    pub batch_bytes_per_sequence: u64,
}

impl Calibration {
    /// The indices in `batches` of the two calibrated batches whose line
    /// predicts a micro-batch of `m >= 2`: the pair around it, or past the
    /// last, the last two.
    fn segment(&self, m: usize) -> (usize, usize) {
        let last = self.batches.len().saturating_sub(1).max(2);
        let mut i = 1;
        while i + 1 < last && self.batches.get(i + 1).is_some_and(|&b| b < m) {
            i += 1;
        }
        (i, i + 1)
    }

    /// The peak's line through the calibrated batches `i` and `j`: what it
    /// holds whatever the batch, and what each sequence adds.
    fn line(&self, (i, j): (usize, usize)) -> (u64, u64) {
        self.line_of(&self.peaks, (i, j))
    }

    /// The line through `peaks[i]` at batch `i`'s size and `peaks[j]`.
    fn line_of(&self, peaks: &[u64], (i, j): (usize, usize)) -> (u64, u64) {
        let span = (self.batches[j] - self.batches[i]).max(1) as u64;
        let per = peaks[j].saturating_sub(peaks[i]) / span;
        let fixed = peaks[i].saturating_sub(self.batches[i] as u64 * per);
        (fixed, per)
    }

    /// Each stretch's peak at `m` sequences: measured at one, on its own
    /// line through the calibrated batches `segment` past that, where every
    /// calibrated step had the same stretches.
    fn stretches_at(&self, m: usize, segment: (usize, usize)) -> Option<Vec<u64>> {
        let count = self.phase_peaks.first()?.len();
        if self.phase_peaks.len() != self.batches.len()
            || self.phase_peaks.iter().any(|p| p.len() != count)
        {
            return None;
        }
        if m <= 1 {
            return Some(self.phase_peaks[0].clone());
        }
        Some(
            (0..count)
                .map(|k| {
                    let peaks: Vec<u64> = self.phase_peaks.iter().map(|p| p[k]).collect();
                    let (fixed, per) = self.line_of(&peaks, segment);
                    fixed.saturating_add((m as u64).saturating_mul(per))
                })
                .collect(),
        )
    }

    /// What each sequence adds to the peak past the last calibrated batch
    /// (on the line through the last two).
    pub fn per_sequence(&self) -> u64 {
        self.line(self.segment(usize::MAX)).1
    }

    /// What the peak's line past the last calibrated batch holds whatever
    /// the batch.
    pub fn fixed(&self) -> u64 {
        self.line(self.segment(usize::MAX)).0
    }

    /// The two batches whose line [`fixed`](Self::fixed) and
    /// [`per_sequence`](Self::per_sequence) give.
    pub fn last_line(&self) -> (usize, usize) {
        let (i, j) = self.segment(usize::MAX);
        (self.batches[i], self.batches[j])
    }

    /// The predicted peak of one micro-batch of `micro` sequences.
    fn micro_peak(&self, micro: usize) -> u64 {
        match micro {
            0 | 1 => self.peaks[0],
            m => {
                let segment = self.segment(m);
                let (fixed, per) = self.line(segment);
                let whole = fixed.saturating_add((m as u64).saturating_mul(per));
                let stretches = self.stretches_at(m, segment).unwrap_or_default();
                whole.max(stretches.into_iter().max().unwrap_or(0))
            }
        }
    }

    /// The predicted peak of a micro-batch of `micro` after the first,
    /// the gradient sum beside it. Where the calibrated steps collected the
    /// gradients as the backward handed them over, each stretch holds the
    /// sum instead of the gradients made before it (a later micro-batch adds
    /// each into the sum as it is made): counting both over-predicted
    /// micro-batches of one sequence by 5 to 12%. Elsewhere, the micro-batch's
    /// peak and the whole sum.
    fn later_micro_peak(&self, micro: usize) -> u64 {
        let whole = || self.micro_peak(micro).saturating_add(self.sum_bytes);
        let Some(stretches) = self.stretches_at(micro, self.segment(micro)) else {
            return whole();
        };
        if self.phase_grads.len() != stretches.len() {
            return whole();
        }
        stretches
            .iter()
            .zip(&self.phase_grads)
            .map(|(&peak, &grads)| peak.saturating_sub(grads))
            .max()
            .unwrap_or(0)
            .saturating_add(self.sum_bytes)
    }

    /// The predicted peak of a step of `batch` in micro-batches of `micro`:
    /// the first micro-batch's, or a later one's with the gradient sum
    /// beside it (the later micro-batches are `micro` again, or only the
    /// rest of the batch when there are two), whichever is higher; the
    /// whole batch's tokens are held throughout.
    pub fn peak(&self, batch: usize, micro: usize) -> u64 {
        let micro = micro.clamp(1, batch.max(1));
        if micro == batch {
            return self.micro_peak(micro);
        }
        let later = if batch / micro >= 2 {
            micro
        } else {
            batch - micro
        };
        let tokens = (batch - micro) as u64 * self.batch_bytes_per_sequence;
        self.micro_peak(micro).max(self.later_micro_peak(later)) + tokens
    }

    /// The predicted time of such a step: each micro-batch's time on the
    /// line through the calibrated batches around it, as its peak (measured
    /// for one sequence), the update's
    /// share of the fixed time counted each time, which errs on the slow
    /// side.
    pub fn seconds(&self, batch: usize, micro: usize) -> f64 {
        let micro = micro.clamp(1, batch.max(1));
        let time = |m: usize| match m {
            1 => self.seconds[0],
            m => {
                let (i, j) = self.segment(m);
                let span = (self.batches[j] - self.batches[i]).max(1) as f64;
                let per = ((self.seconds[j] - self.seconds[i]) / span).max(0.0);
                let fixed = (self.seconds[i] - self.batches[i] as f64 * per).max(0.0);
                fixed + per * m as f64
            }
        };
        let (whole, rest) = (batch / micro, batch % micro);
        whole as f64 * time(micro) + if rest > 0 { time(rest) } else { 0.0 }
    }
}

/// The largest micro-batch below `batch` whose predicted step `fits`, by
/// bisection rather than by trying every size (a batch may be 10^11).
/// [`Calibration::peak`] has two regimes. Past half the batch, the later
/// micro-batch is the remainder: the first micro-batch's peak grows with
/// `m` and the later one's shrinks, so the sizes that fit form a range and
/// its top is where the first stops fitting. Up to half the batch, every
/// micro-batch is `m` and the peak grows with it.
pub(super) fn largest_micro(
    c: &Calibration,
    batch: usize,
    fits: impl Fn(u64) -> bool,
) -> Option<usize> {
    // The last m in lo..=hi for which `ok` holds, where it holds up to a
    // point and not past it.
    let last = |lo: usize, hi: usize, ok: &dyn Fn(usize) -> bool| -> Option<usize> {
        if lo > hi || !ok(lo) {
            return None;
        }
        let (mut good, mut bad) = (lo, hi + 1);
        while bad - good > 1 {
            let mid = good + (bad - good) / 2;
            if ok(mid) {
                good = mid;
            } else {
                bad = mid;
            }
        }
        Some(good)
    };
    let half = batch / 2;
    let tokens = |m: usize| (batch - m) as u64 * c.batch_bytes_per_sequence;
    let first_fits = |m: usize| fits(c.micro_peak(m).saturating_add(tokens(m)));
    if let Some(m) = last(half + 1, batch.saturating_sub(1), &first_fits) {
        if fits(c.peak(batch, m)) {
            return Some(m);
        }
    }
    last(1, half, &|m| fits(c.peak(batch, m)))
}
