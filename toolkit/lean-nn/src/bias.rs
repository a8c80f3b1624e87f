//! Adding the bias in place.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, InplaceOp2, Layout, Result, Tensor};

/// `rows += bias` for every row of a contiguous `(.., n)` tensor.
struct AddBias;

impl InplaceOp2 for AddBias {
    fn name(&self) -> &'static str {
        "add-bias"
    }

    fn cpu_fwd(&self, y: &mut CpuStorage, yl: &Layout, b: &CpuStorage, bl: &Layout) -> Result<()> {
        let (Some((ys, ye)), Some((bs, be))) = (yl.contiguous_offsets(), bl.contiguous_offsets())
        else {
            bail!("add-bias: the output and the bias must be contiguous");
        };
        let n = be - bs;
        if n == 0 || (ye - ys) % n != 0 {
            bail!("add-bias: rows of {} elements, a bias of {n}", ye - ys);
        }
        macro_rules! go {
            ($y:expr, $b:expr) => {
                for row in $y[ys..ye].chunks_exact_mut(n) {
                    for (v, b) in row.iter_mut().zip(&$b[bs..be]) {
                        *v += *b;
                    }
                }
            };
        }
        match (y, b) {
            (CpuStorage::F32(y), CpuStorage::F32(b)) => go!(y, b),
            (CpuStorage::F64(y), CpuStorage::F64(b)) => go!(y, b),
            (CpuStorage::F16(y), CpuStorage::F16(b)) => go!(y, b),
            (CpuStorage::BF16(y), CpuStorage::BF16(b)) => go!(y, b),
            (y, b) => bail!("add-bias: output {:?}, bias {:?}", y.dtype(), b.dtype()),
        }
        Ok(())
    }
}

/// `y + b` for `y` `(rows, n)` fresh from a product and `b` `(n,)`: in place
/// on the CPU, through candle's broadcast addition elsewhere.
pub(crate) fn add_bias(y: Tensor, b: &Tensor) -> Result<Tensor> {
    if y.device().is_cpu() && y.is_contiguous() && b.is_contiguous() && y.dtype() == b.dtype() {
        y.inplace_op2(b, &AddBias)?;
        Ok(y)
    } else {
        y.broadcast_add(b)
    }
}
