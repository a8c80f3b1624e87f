//! One rank of N rehearsed in a single process: the collectives move the
//! buffers a real rank would, and the peers are stand-ins.

use candle_core::Result;

use crate::comm::Engine;

/// Rank 0 of `size` ranks whose peers are stand-ins holding this rank's
/// data: an all-reduce or reduce-scatter sums `size` copies of it, an
/// all-gather repeats this rank's block in every place.
///
/// Every collective takes and fills buffers of exactly the lengths a real
/// rank's would, so a step run over it allocates, to the byte, what one
/// rank of a real job allocates around the collectives (the communication
/// library's own buffers are its business, on a real rank too), and its
/// [`Traffic`](crate::Traffic) counts what that rank would send: the way to
/// measure a rank's memory for N ranks on one machine before starting any
/// (`workbook plan --ranks N` does). The values are not a real job's: the blocks gathered from the
/// stand-ins are copies of this rank's own, so the parameters outside its
/// block are wrong after a sharded step.
///
/// ```
/// use candle_distributed::{Comm, Rehearsal};
/// let comm = Comm::new(Rehearsal::new(4)?);
/// let mut out = vec![0f32; 2];
/// comm.reduce_scatter_sum(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], &mut out)?;
/// assert_eq!(out, [4.0, 8.0]);
/// assert_eq!(comm.traffic().reduce_scatter.sent, 3 * 2 * 4);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Rehearsal {
    size: usize,
}

impl Rehearsal {
    /// Rank 0 of `size` ranks (at least 1).
    pub fn new(size: usize) -> Result<Self> {
        if size == 0 {
            candle_core::bail!("a job of 0 ranks");
        }
        Ok(Self { size })
    }
}

impl Engine for Rehearsal {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_reduce_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        let n = self.size as f32;
        for (r, s) in recv.iter_mut().zip(send) {
            *r = s * n;
        }
        Ok(())
    }
    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        let n = self.size as f32;
        // Rank 0 receives the first block.
        for (r, s) in recv.iter_mut().zip(send) {
            *r = s * n;
        }
        Ok(())
    }
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        for chunk in recv.chunks_mut(send.len().max(1)) {
            chunk.copy_from_slice(&send[..chunk.len()]);
        }
        Ok(())
    }
    fn broadcast(&self, _: &mut [f32], _: usize) -> Result<()> {
        Ok(())
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
    fn describe(&self) -> String {
        format!("rank 0 of {} rehearsed in one process", self.size)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use candle_core::{DType, Device, Tensor, Var};
    use candle_nn::ParamsAdamW;

    use super::*;
    use crate::{Comm, Split, ZeroAdamW};

    #[test]
    fn collectives_fill_what_a_rank_receives() -> Result<()> {
        let comm = Comm::new(Rehearsal::new(3)?);
        let mut all = vec![1f32, -2.0];
        comm.all_reduce_sum(&mut all)?;
        assert_eq!(all, [3.0, -6.0]);
        let mut whole = vec![0f32; 6];
        comm.all_gather(&[5.0, 6.0], &mut whole)?;
        assert_eq!(whole, [5.0, 6.0, 5.0, 6.0, 5.0, 6.0]);
        // A buffer of the wrong length is refused as with real ranks.
        let mut short = vec![0f32; 5];
        assert!(comm.all_gather(&[5.0, 6.0], &mut short).is_err());
        assert!(Rehearsal::new(0).is_err());
        Ok(())
    }

    #[test]
    fn zero_state_and_traffic_are_those_of_one_rank_of_n() -> Result<()> {
        let dev = Device::Cpu;
        let sizes = [10usize, 7, 64];
        for ranks in [1usize, 2, 4, 8] {
            let comm = Arc::new(Comm::new(Rehearsal::new(ranks)?));
            let vars: Vec<Var> = sizes
                .iter()
                .map(|&n| Var::from_tensor(&Tensor::ones(n, DType::F32, &dev)?))
                .collect::<Result<_>>()?;
            let mut opt = ZeroAdamW::new(Arc::clone(&comm), vars.clone(), ParamsAdamW::default())?;
            // The ranks' check of their variables: two all-gathers, of two
            // whole numbers and of one per variable, three f32 each.
            let set_up = comm.traffic();
            assert_eq!(
                set_up.all_gather.sent,
                ((ranks - 1) * (2 + sizes.len()) * 3 * 4) as u64,
                "{ranks} ranks"
            );
            let blocks: usize = sizes.iter().map(|&n| Split::new(n, ranks).block()).sum();
            // Two moments per element of this rank's blocks.
            assert_eq!(opt.state_bytes(), (2 * 4 * blocks) as u64);
            let mut grads = candle_core::backprop::GradStore::default();
            for v in &vars {
                grads.insert(
                    v.as_tensor(),
                    Tensor::ones(v.elem_count(), DType::F32, &dev)?,
                );
            }
            opt.step(&grads)?;
            // One reduce-scatter and one all-gather per tensor, each
            // sending (N - 1) blocks.
            let t = comm.traffic().since(&set_up);
            let expected = ((ranks - 1) * blocks * 4) as u64;
            assert_eq!(t.reduce_scatter.sent, expected, "{ranks} ranks");
            assert_eq!(t.all_gather.sent, expected, "{ranks} ranks");
            // Identical stand-ins: the mean gradient is this rank's, so
            // this rank's block moved as one AdamW step on ones moves it.
            let first = vars[0].as_tensor().to_vec1::<f32>()?;
            assert!(
                (first[0] - (1.0 - 1e-3 * (1.0 + 1e-2))).abs() < 1e-5,
                "{first:?}"
            );
        }
        Ok(())
    }

    #[test]
    fn the_mean_over_identical_stand_ins_is_this_ranks_own_block() -> Result<()> {
        let dev = Device::Cpu;
        let comm = Comm::new(Rehearsal::new(4)?);
        let grad = Tensor::arange(1f32, 11.0, &dev)?;
        let mean = crate::split::reduce_scatter_mean(&comm, &grad, Split::new(10, 4), &dev)?;
        // Rank 0's block of 3: the sum over 4 copies, divided by 4.
        assert_eq!(mean.to_vec1::<f32>()?, [1.0, 2.0, 3.0]);
        Ok(())
    }
}
