//! What the memory tests share.

use candle_core::{DType, Device, Result, Tensor};

/// Has every thread of rayon's pool make `gemm`'s packing buffers, which it
/// keeps per thread, with an `n x n` f32 product. An unmeasured run of the
/// code under test does not do it: on a busy machine a thread it never
/// reached can take a task in the measured run, and its new buffers (about
/// 2 MB) would be counted.
pub fn warm_pool(n: usize) -> Result<()> {
    rayon::broadcast(|_| {
        let a = Tensor::ones((n, n), DType::F32, &Device::Cpu)?;
        a.matmul(&a).map(drop)
    })
    .into_iter()
    .collect()
}
