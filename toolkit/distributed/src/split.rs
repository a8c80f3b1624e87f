//! How a tensor's elements are split over the ranks.

use std::ops::Range;

use candle_core::{DType, Result, Tensor};

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
