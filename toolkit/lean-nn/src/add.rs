//! Adding one tensor into another in place.

use candle_core::{bail, CpuStorage, DType, InplaceOp2, Layout, Result, Tensor};
use rayon::prelude::*;

use crate::cpu::add_row;

/// Elements per parallel task.
const SPAN: usize = 1 << 16;

/// `sum += g`, element by element, in the sum's storage.
struct AddInto;

impl InplaceOp2 for AddInto {
    fn name(&self) -> &'static str {
        "add-into"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, sl: &Layout, g: &CpuStorage, gl: &Layout) -> Result<()> {
        let (Some((s0, s1)), Some((g0, g1))) = (sl.contiguous_offsets(), gl.contiguous_offsets())
        else {
            bail!("add-into: the sum and the addend must be contiguous");
        };
        match (s, g) {
            (CpuStorage::F32(s), CpuStorage::F32(g)) if s1 - s0 == g1 - g0 => {
                s[s0..s1]
                    .par_chunks_mut(SPAN)
                    .zip(g[g0..g1].par_chunks(SPAN))
                    .for_each(|(s, g)| add_row(s, g));
                Ok(())
            }
            _ => bail!("add-into: f32 tensors of one size only"),
        }
    }
}

/// `sum + g`, added into `sum`'s storage when both are contiguous f32 of
/// one shape on the CPU (`sum` must be held by nothing else), through
/// candle's addition otherwise.
pub(crate) fn add_into(sum: Tensor, g: &Tensor) -> Result<Tensor> {
    let fits = sum.device().is_cpu()
        && g.device().is_cpu()
        && sum.dtype() == DType::F32
        && g.dtype() == DType::F32
        && sum.shape() == g.shape()
        && sum.is_contiguous()
        && g.is_contiguous();
    if fits {
        sum.inplace_op2(g, &AddInto)?;
        Ok(sum)
    } else {
        sum + g
    }
}
