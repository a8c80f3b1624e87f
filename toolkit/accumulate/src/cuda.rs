//! `sum += g` on a CUDA GPU: candle's own addition kernel (`badd`), launched
//! with the sum's buffer as both its left operand and its output. The kernel
//! reads an element of each operand and then writes that element, so this is
//! the launch `sum + g` makes, with the same bits, without the new tensor.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{kernel_name, kernels, CudaDType, WrapErr};
use candle_core::{bail, CudaStorage, DType, Result, WithDType};

/// Adds elements `g0..g1` of `g` into elements `s0..s1` of `s`.
pub(crate) fn add_assign(
    s: &mut CudaStorage,
    (s0, s1): (usize, usize),
    g: &CudaStorage,
    (g0, g1): (usize, usize),
) -> Result<()> {
    let n = s1 - s0;
    if n != g1 - g0 || s.dtype() != g.dtype() {
        bail!("add-assign: sum and gradient of one size and dtype only");
    }
    if n == 0 {
        return Ok(());
    }
    // See `inplace::add_assign`: 2^30 stays clear of the kernel's 32-bit
    // grid stride wrapping round.
    let count = match u32::try_from(n) {
        Ok(count) if count <= 1 << 30 => count,
        _ => bail!("add-assign: at most 2^30 elements at once on a GPU, not {n}"),
    };
    fn go<T: CudaDType + WithDType + DeviceRepr>(
        s: &mut CudaStorage,
        (s0, s1): (usize, usize),
        g: &CudaStorage,
        (g0, g1): (usize, usize),
        count: u32,
    ) -> Result<()> {
        let n = s1 - s0;
        let device = s.device().clone();
        let func = device.get_or_load_func(&kernel_name::<T>("badd"), &kernels::BINARY)?;
        let stream = device.cuda_stream();
        let g = g.as_cuda_slice::<T>()?.slice(g0..g1);
        let mut sum = s.as_cuda_slice_mut::<T>()?.slice_mut(s0..s1);
        // One address for the left operand and the output; the guard orders
        // the launch after earlier work on the buffer, as a kernel argument's
        // does.
        let (sum_ptr, _in_order) = sum.device_ptr_mut(&stream);
        let (dims, no_strides) = (1usize, 0usize);
        let mut launch = func.builder();
        launch
            .arg(&n)
            .arg(&dims)
            // A null layout: both operands contiguous.
            .arg(&no_strides)
            .arg(&sum_ptr)
            .arg(&g)
            .arg(&sum_ptr);
        // SAFETY: `badd_T(numel, num_dims, dims_and_strides, lhs, rhs, out)`
        // reads `n` elements of `lhs` and `rhs` and writes `n` of `out`; both
        // buffers hold `n` elements of `T`, and each element is read before
        // the same thread writes it.
        unsafe { launch.launch(LaunchConfig::for_num_elems(count)) }.w()?;
        Ok(())
    }
    let (sr, gr) = ((s0, s1), (g0, g1));
    match s.dtype() {
        DType::F32 => go::<f32>(s, sr, g, gr, count),
        DType::F64 => go::<f64>(s, sr, g, gr, count),
        DType::F16 => go::<half::f16>(s, sr, g, gr, count),
        DType::BF16 => go::<half::bf16>(s, sr, g, gr, count),
        d => bail!("add-assign: float gradients only; this one is {d:?}"),
    }
}
