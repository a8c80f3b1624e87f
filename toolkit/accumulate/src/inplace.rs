//! Adding a gradient into the sum in place.

use candle_core::{bail, CpuStorage, DType, InplaceOp2, Layout, Result, Tensor};

/// `sum += g`, element by element, in the sum's own storage.
struct AddAssign;

impl InplaceOp2 for AddAssign {
    fn name(&self) -> &'static str {
        "add-assign"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, sl: &Layout, g: &CpuStorage, gl: &Layout) -> Result<()> {
        let (Some((s0, s1)), Some((g0, g1))) = (sl.contiguous_offsets(), gl.contiguous_offsets())
        else {
            bail!("add-assign: the sum and the gradient must be contiguous");
        };
        match (s, g) {
            (CpuStorage::F32(s), CpuStorage::F32(g)) if s1 - s0 == g1 - g0 => {
                for (a, b) in s[s0..s1].iter_mut().zip(&g[g0..g1]) {
                    *a += *b;
                }
                Ok(())
            }
            _ => bail!("add-assign: f32 sum and gradient of one size only"),
        }
    }
}

/// Adds `g` into `sum`'s storage when both are contiguous and of one shape
/// and dtype on one device: f32 on the CPU; f32, f64, f16 or bf16 on a CUDA
/// GPU (with the `cuda` feature). The sum must be held by nothing else.
/// Returns whether it did. The same additions as `sum + g`, so the same
/// bits.
pub(crate) fn add_assign(sum: &Tensor, g: &Tensor) -> Result<bool> {
    let on_cpu = sum.device().is_cpu()
        && g.device().is_cpu()
        && sum.dtype() == DType::F32
        && g.dtype() == DType::F32
        && sum.shape() == g.shape()
        && sum.is_contiguous()
        && g.is_contiguous();
    if !on_cpu {
        // On a CUDA GPU, candle's own addition kernel with the sum's buffer
        // as its output.
        return candle_cuda_inplace::add_assign(sum, g);
    }
    sum.inplace_op2(g, &AddAssign)?;
    Ok(true)
}
