//! Getting a device ready before anything is measured.

use candle_core::{DType, Device, Result, Tensor};

use crate::meter::Category;

/// Runs a few matrix products of each float dtype so that one-time
/// allocations (gemm's per-thread packing buffers, thread pools) happen
/// before anything is measured.
pub fn warm_up(device: &Device) -> Result<()> {
    let _other = Category::Other.enter();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for n in [8, 64, 512] {
            let a = Tensor::ones((n, n), dtype, device)?;
            let _ = a
                .matmul(&a)?
                .sum_all()?
                .to_dtype(DType::F32)?
                .to_scalar::<f32>()?;
        }
    }
    Ok(())
}
