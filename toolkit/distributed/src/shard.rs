//! How a batch's rows are split over the ranks, evenly or not.

use std::ops::Range;

use candle_core::{Result, Tensor};

/// One rank's rows of a batch of `batch` rows over `ranks` ranks: the
/// first `batch % ranks` ranks take one row more, so any rank count up to
/// the batch works.
///
/// Each rank's mean loss is weighted by [`weight`](Self::weight), its rows
/// × N / batch, so that the gradients averaged over the ranks (what DDP's
/// all-reduce and ZeRO's reduce-scatter compute) equal the whole batch's
/// mean, as `candle-accumulate`'s `add_weighted` does for micro-batches of
/// unequal size. For an even split the weight is exactly 1.
///
/// ```
/// use candle_distributed::Shard;
/// let rows = (0..3)
///     .map(|r| Ok(Shard::new(8, 3, r)?.rows()))
///     .collect::<candle_core::Result<Vec<_>>>()?;
/// assert_eq!(rows, [0..3, 3..6, 6..8]);
/// assert_eq!(Shard::new(8, 3, 2)?.weight(), 0.75);
/// assert_eq!(Shard::new(8, 4, 1)?.weight(), 1.0);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    batch: usize,
    ranks: usize,
    rank: usize,
}

impl Shard {
    /// `rank`'s share of `batch` rows over `ranks`: an error unless `rank`
    /// is one of the ranks and every rank has a row (a rank without one
    /// would average its loss over none: NaN, which the all-reduce would
    /// hand every rank).
    pub fn new(batch: usize, ranks: usize, rank: usize) -> Result<Self> {
        if ranks == 0 {
            candle_core::bail!("0 ranks; allowed: at least 1");
        }
        if rank >= ranks {
            candle_core::bail!(
                "rank {rank} of {ranks} ranks; allowed: a rank from 0 to ranks - 1 \
                 (`Shard::new(batch, ranks, rank)`)"
            );
        }
        if batch < ranks {
            candle_core::bail!(
                "a batch of {batch} rows over {ranks} ranks leaves a rank without a row; \
                 allowed: at least as many rows as ranks"
            );
        }
        Ok(Self { batch, ranks, rank })
    }

    /// The rows this rank trains on.
    pub fn rows(&self) -> Range<usize> {
        let (each, extra) = (self.batch / self.ranks, self.batch % self.ranks);
        let start = self.rank * each + self.rank.min(extra);
        let len = each + usize::from(self.rank < extra);
        start.min(self.batch)..(start + len).min(self.batch)
    }

    /// What this rank's mean loss is multiplied by: its rows × ranks /
    /// batch.
    pub fn weight(&self) -> f64 {
        self.rows().len() as f64 * self.ranks as f64 / self.batch as f64
    }

    /// This rank's rows of `t` (split along its first dimension).
    pub fn narrow(&self, t: &Tensor) -> Result<Tensor> {
        let rows = self.rows();
        t.narrow(0, rows.start, rows.len())
    }

    /// `loss`, this rank's mean, weighted for averaging over the ranks.
    pub fn weigh(&self, loss: &Tensor) -> Result<Tensor> {
        loss.affine(self.weight(), 0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::Shard;

    #[test]
    fn every_row_is_one_ranks_and_the_weights_average_to_one() {
        for batch in 1..40 {
            for ranks in 1..=batch {
                let shards: Vec<Shard> = (0..ranks)
                    .map(|r| Shard::new(batch, ranks, r).unwrap())
                    .collect();
                let mut next = 0;
                for s in &shards {
                    assert_eq!(s.rows().start, next, "batch {batch}, {ranks} ranks");
                    assert!(!s.rows().is_empty());
                    next = s.rows().end;
                }
                assert_eq!(next, batch);
                let mean: f64 = shards.iter().map(Shard::weight).sum::<f64>() / ranks as f64;
                assert!(
                    (mean - 1.0).abs() < 1e-12,
                    "batch {batch}, {ranks} ranks: {mean}"
                );
                if batch % ranks == 0 {
                    assert!(shards.iter().all(|s| s.weight() == 1.0));
                }
            }
        }
    }

    #[test]
    fn a_rank_outside_the_ranks_or_without_a_row_is_an_error() {
        let first = |e: candle_core::Error| e.to_string().lines().next().unwrap().to_string();
        // Rank and ranks swapped.
        assert_eq!(
            first(Shard::new(8, 1, 3).unwrap_err()),
            "rank 3 of 1 ranks; allowed: a rank from 0 to ranks - 1 \
             (`Shard::new(batch, ranks, rank)`)"
        );
        assert_eq!(
            first(Shard::new(8, 0, 0).unwrap_err()),
            "0 ranks; allowed: at least 1"
        );
        assert_eq!(
            first(Shard::new(2, 4, 0).unwrap_err()),
            "a batch of 2 rows over 4 ranks leaves a rank without a row; allowed: at least \
             as many rows as ranks"
        );
    }
}
