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
}

/// `y + b` for `y` `(rows, n)` fresh from a product and `b` `(n,)`: in place
/// on the CPU, through candle's broadcast addition elsewhere.
pub(crate) fn add_bias(y: Tensor, b: &Tensor) -> Result<Tensor> {
    if y.device().is_cpu() && y.is_contiguous() && b.is_contiguous() && y.dtype() == b.dtype() {
        y.inplace_op2(b, &BiasAct { relu: false })?;
        Ok(y)
    } else {
        y.broadcast_add(b)
    }
}
