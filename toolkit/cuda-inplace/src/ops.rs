//! Tensor-level operations on top of the launches.

use candle_core::{bail, CpuStorage, CudaStorage, InplaceOp2, Layout, Result, Tensor};

use crate::launch::{assign, Binary};

/// `sum += g`: candle's addition kernel with `sum`'s buffer as its output,
/// the launch (and so the bits) of `sum + g` without the new tensor. Both
/// on one CUDA GPU, of one shape and dtype; `sum` contiguous (see
/// [`writable`](crate::writable)) and held by nothing else.
pub fn add_assign(sum: &Tensor, g: &Tensor) -> Result<()> {
    if sum.shape() != g.shape() {
        bail!(
            "add-assign: a sum of shape {:?} and an addend of shape {:?}",
            sum.dims(),
            g.dims()
        );
    }
    sum.inplace_op2(g, &AddAssign)
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
