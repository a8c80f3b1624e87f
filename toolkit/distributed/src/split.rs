//! How a tensor's elements are split over the ranks.

use std::ops::Range;

use candle_core::{DType, Device, Result, Shape, Tensor, Var};
use candle_observe::{scope, Kind, Place};

use crate::Comm;

/// A tensor of `len` elements split over `ranks` in equal contiguous
/// blocks, the last padded with zeros: ZeRO's partition of one parameter.
///
/// ```
/// use candle_distributed::Split;
/// let s = Split::new(10, 4);
/// assert_eq!((s.block(), s.padded()), (3, 12));
/// assert_eq!(s.range(3), 9..10);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Split {
    len: usize,
    ranks: usize,
}

impl Split {
    /// `len` elements over `ranks` (at least one).
    pub fn new(len: usize, ranks: usize) -> Self {
        Self {
            len,
            ranks: ranks.max(1),
        }
    }

    /// The tensor's elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the tensor is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The elements of each rank's block.
    pub fn block(&self) -> usize {
        self.len.div_ceil(self.ranks)
    }

    /// The elements of all blocks together.
    pub fn padded(&self) -> usize {
        self.block() * self.ranks
    }

    /// The elements of the tensor that `rank`'s block holds (padding left
    /// out).
    pub fn range(&self, rank: usize) -> Range<usize> {
        let start = (rank * self.block()).min(self.len);
        start..((rank + 1) * self.block()).min(self.len)
    }
}

/// `t`'s elements as `f32`, in a communication buffer of `padded` elements.
pub(crate) fn flat_f32(comm: &Comm, t: &Tensor, padded: usize) -> Result<Vec<f32>> {
    let mut buf = comm.buffer(padded);
    comm.within_buffers(|| -> Result<()> {
        let values = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        buf[..values.len()].copy_from_slice(&values);
        Ok(())
    })?;
    Ok(buf)
}

/// This rank's block of `t` (split by `split`) as `f32`, zeros past the
/// tensor's end, in a communication buffer.
pub(crate) fn own_block(comm: &Comm, t: &Tensor, split: Split) -> Result<Vec<f32>> {
    let range = split.range(comm.rank());
    let mut block = comm.buffer(split.block());
    if !range.is_empty() {
        let mine = comm.within_buffers(|| {
            t.flatten_all()?
                .narrow(0, range.start, range.len())?
                .to_dtype(DType::F32)?
                .to_vec1::<f32>()
        })?;
        block[..mine.len()].copy_from_slice(&mine);
    }
    Ok(block)
}

/// Reduce-scatters `grad` (split by `split`): this rank's block of its mean
/// over the ranks, in f32 on `device`, allocated as gradients.
pub(crate) fn reduce_scatter_mean(
    comm: &Comm,
    grad: &Tensor,
    split: Split,
    device: &Device,
) -> Result<Tensor> {
    let send = flat_f32(comm, grad, split.padded())?;
    let mut recv = comm.buffer(split.block());
    comm.reduce_scatter_sum(&send, &mut recv)?;
    drop(send);
    let scale = 1.0 / comm.size() as f32;
    let _grads = scope(comm.observer(), Kind::Gradients, Place::Device);
    let mean: Vec<f32> = recv.iter().map(|x| x * scale).collect();
    Tensor::from_vec(mean, split.block(), device)
}

/// All-gathers every rank's `block` (split by `split`) into the whole
/// tensor of `shape` in `dtype` on `device`, allocated as `kind`.
pub(crate) fn all_gather_whole(
    comm: &Comm,
    block: &Var,
    split: Split,
    shape: &Shape,
    dtype: DType,
    device: &Device,
    kind: Kind,
) -> Result<Tensor> {
    let send = comm.within_buffers(|| block.to_vec1::<f32>())?;
    let mut full = comm.buffer(split.padded());
    comm.all_gather(&send, &mut full)?;
    drop(send);
    let _whole = scope(comm.observer(), kind, Place::Device);
    Tensor::from_slice(&full[..split.len()], shape, device)?.to_dtype(dtype)
}
