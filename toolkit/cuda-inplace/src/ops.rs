//! Tensor-level operations on top of the launches.

use candle_core::{bail, CpuStorage, CudaStorage, InplaceOp2, Layout, Result, Tensor};

use crate::launch::{assign, writable, Binary};

/// `sum += g` where it can be done in place on a CUDA GPU: candle's
/// addition kernel with `sum`'s buffer as its output, the launch (and so
/// the bits) of `sum + g` without the new tensor. It can when both are on
/// one CUDA GPU, of one shape and dtype, `g` contiguous and `sum`
/// [`writable`]; `sum` must also be held by nothing else, which only its
/// owner knows. Returns whether it did.
pub fn add_assign(sum: &Tensor, g: &Tensor) -> Result<bool> {
    let fits = writable(sum)
        && sum.device().same_device(g.device())
        && sum.dtype() == g.dtype()
        && sum.shape() == g.shape()
        && g.is_contiguous();
    if fits {
        sum.inplace_op2(g, &AddAssign)?;
    }
    Ok(fits)
}

/// `sum += g` on a CUDA GPU.
struct AddAssign;

impl InplaceOp2 for AddAssign {
    fn name(&self) -> &'static str {
        "add-assign-cuda"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
        bail!("add-assign-cuda: tensors on a CUDA GPU only")
    }

    fn cuda_fwd(
        &self,
        s: &mut CudaStorage,
        sl: &Layout,
        g: &CudaStorage,
        gl: &Layout,
    ) -> Result<()> {
        assign(Binary::Add, s, sl, g, gl)
    }
}
