//! Adding the bias in place, and ReLU with it.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, InplaceOp2, Layout, Result, Tensor};
use rayon::prelude::*;

use crate::cpu::{bias_act_row, ROWS_PER_TASK};

/// `row += bias` for every row of a contiguous `(.., n)` tensor, then
/// ReLU in place if asked, rows in parallel (f32 rows vectorised).
pub(crate) struct BiasAct {
    pub relu: bool,
}

impl InplaceOp2 for BiasAct {
    fn name(&self) -> &'static str {
        "bias-act"
    }

    fn cpu_fwd(&self, y: &mut CpuStorage, yl: &Layout, b: &CpuStorage, bl: &Layout) -> Result<()> {
        let (Some((ys, ye)), Some((bs, be))) = (yl.contiguous_offsets(), bl.contiguous_offsets())
        else {
            bail!("bias-act: the output and the bias must be contiguous");
        };
        let n = be - bs;
        if n == 0 || (ye - ys) % n != 0 {
            bail!("bias-act: rows of {} elements, a bias of {n}", ye - ys);
        }
        let relu = self.relu;
        macro_rules! go {
            ($y:expr, $b:expr) => {{
                let b = &$b[bs..be];
                $y[ys..ye]
                    .par_chunks_mut(n * ROWS_PER_TASK)
                    .for_each(|rows| {
                        for row in rows.chunks_exact_mut(n) {
                            for (v, b) in row.iter_mut().zip(b) {
                                let z = *v + *b;
                                let zero = Default::default();
                                *v = if relu && z <= zero { zero } else { z };
                            }
                        }
                    })
            }};
        }
        match (y, b) {
            (CpuStorage::F32(y), CpuStorage::F32(b)) => {
                let b = &b[bs..be];
                y[ys..ye]
                    .par_chunks_mut(n * ROWS_PER_TASK)
                    .for_each(|rows| {
                        for row in rows.chunks_exact_mut(n) {
                            bias_act_row(row, b, relu);
                        }
                    })
            }
            (CpuStorage::F64(y), CpuStorage::F64(b)) => go!(y, b),
            (CpuStorage::F16(y), CpuStorage::F16(b)) => go!(y, b),
            (CpuStorage::BF16(y), CpuStorage::BF16(b)) => go!(y, b),
            (y, b) => bail!("bias-act: output {:?}, bias {:?}", y.dtype(), b.dtype()),
        }
        Ok(())
    }

    /// candle's own kernels with `y`'s buffer as their output: the bias's
    /// broadcast addition, then ReLU. The launches of `y.broadcast_add(b)`
    /// and `relu()`, so the same bits, without their new tensors.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        y: &mut candle_core::CudaStorage,
        yl: &Layout,
        b: &candle_core::CudaStorage,
        bl: &Layout,
    ) -> Result<()> {
        let bl = bl.broadcast_as(yl.shape().clone())?;
        candle_inplace::assign(candle_inplace::Binary::Add, y, yl, b, &bl)?;
        if self.relu {
            candle_inplace::relu(y, yl)?;
        }
        Ok(())
    }
}

/// `y + b` for `y` `(rows, n)` fresh from a product and `b` `(n,)`, then
/// ReLU if asked. The bias is added in place on the CPU and, with the
/// `cuda` feature, on a CUDA GPU, where ReLU is in place too (candle's
/// `relu` kernel over the sum); elsewhere, candle's broadcast addition.
/// ReLU is candle's `relu` wherever it is not on the GPU.
pub(crate) fn add_bias(y: Tensor, b: &Tensor, relu: bool) -> Result<Tensor> {
    // A bias of `(n,)`, `(1, n)`...: the last dimension alone.
    let n = y.dims().last().copied();
    let same = b.is_contiguous()
        && b.rank() <= y.rank()
        && y.dtype() == b.dtype()
        && b.dims().last().copied() == n
        && Some(b.elem_count()) == n;
    #[cfg(feature = "cuda")]
    if same && candle_inplace::writable(&y) && y.device().same_device(b.device()) {
        y.inplace_op2(b, &BiasAct { relu })?;
        return Ok(y);
    }
    let z = if same && y.device().is_cpu() && b.device().is_cpu() && y.is_contiguous() {
        y.inplace_op2(b, &BiasAct { relu: false })?;
        y
    } else {
        y.broadcast_add(b)?
    };
    if relu {
        z.relu()
    } else {
        Ok(z)
    }
}
