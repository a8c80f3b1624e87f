//! The launches.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{kernel_name, kernels, CudaDType, SlicePtrOrNull, WrapErr};
use candle_core::{bail, CudaStorage, DType, Layout, Result, Tensor, WithDType};

/// The most elements one launch writes in place. candle's element-wise
/// kernels index with 32 bits and step by the whole grid: past 2^31
/// elements a step wraps round to an element already written, harmless when
/// the output is a new tensor, not when it is an operand.
pub const MAX_ELEMENTS: usize = 1 << 30;

/// Whether `t` can be the output of these launches: on a CUDA GPU, of a
/// float dtype (f32, f64, f16, bf16), contiguous, with 1 to
/// [`MAX_ELEMENTS`] elements. (It must also be held by nothing else, which
/// only its owner knows.)
pub fn writable(t: &Tensor) -> bool {
    t.device().is_cuda()
        && matches!(
            t.dtype(),
            DType::F32 | DType::F64 | DType::F16 | DType::BF16
        )
        && t.is_contiguous()
        && (1..=MAX_ELEMENTS).contains(&t.elem_count())
}

/// candle's binary kernels that [`assign`] launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Binary {
    /// `badd`: `out + rhs`.
    Add,
    /// `bsub`: `out - rhs`.
    Sub,
    /// `bmul`: `out * rhs`.
    Mul,
}

impl Binary {
    fn kernel(self) -> &'static str {
        match self {
            Binary::Add => "badd",
            Binary::Sub => "bsub",
            Binary::Mul => "bmul",
        }
    }
}

/// `f::<T>(args)` for the float dtype `dtype`.
macro_rules! by_dtype {
    ($dtype:expr, $name:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F64 => $f::<f64>($($arg),*),
            DType::F16 => $f::<half::f16>($($arg),*),
            DType::BF16 => $f::<half::bf16>($($arg),*),
            d => bail!("{}: f32, f64, f16 or bf16, got {d:?}", $name),
        }
    };
}

/// The contiguous element range of the output's layout, checked against
/// [`MAX_ELEMENTS`].
fn output_range(l: &Layout, op: &str) -> Result<(usize, usize)> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("{op} in place: the output must be contiguous");
    };
    if end - start > MAX_ELEMENTS {
        bail!(
            "{op} in place: at most 2^30 elements at once on a GPU, not {}",
            end - start
        );
    }
    Ok((start, end))
}

/// `out = out OP rhs` with candle's binary kernel for `op`: `out` is the
/// left operand and the output, contiguous; `rhs` has `out`'s shape and
/// dtype, contiguous or broadcast (`broadcast_as`), and its layout's
/// strides are passed as candle's `binary_map` passes them. As candle's
/// own storage operations do, this trusts each layout to lie within its
/// storage, which a tensor's layout does.
pub fn assign(
    op: Binary,
    out: &mut CudaStorage,
    ol: &Layout,
    rhs: &CudaStorage,
    rl: &Layout,
) -> Result<()> {
    let name = op.kernel();
    if rl.shape() != ol.shape() {
        bail!(
            "{name} in place: an operand of shape {:?} for an output of shape {:?}",
            rl.dims(),
            ol.dims()
        );
    }
    if rhs.dtype() != out.dtype() {
        bail!(
            "{name} in place: a {:?} operand for a {:?} output",
            rhs.dtype(),
            out.dtype()
        );
    }
    let range = output_range(ol, name)?;
    if range.0 == range.1 {
        return Ok(());
    }
    fn go<T: CudaDType + WithDType + DeviceRepr>(
        name: &str,
        out: &mut CudaStorage,
        ol: &Layout,
        (o0, o1): (usize, usize),
        rhs: &CudaStorage,
        rl: &Layout,
    ) -> Result<()> {
        let n = o1 - o0;
        let device = out.device().clone();
        let stream = device.cuda_stream();
        let func = device.get_or_load_func(&kernel_name::<T>(name), &kernels::BINARY)?;
        let info = if rl.is_contiguous() {
            SlicePtrOrNull::Null
        } else {
            let info = [ol.dims(), ol.stride(), rl.stride()].concat();
            SlicePtrOrNull::params_from_vec(&device, info)?
        };
        let rhs = rhs.as_cuda_slice::<T>()?.slice(rl.start_offset()..);
        let mut out = out.as_cuda_slice_mut::<T>()?.slice_mut(o0..o1);
        // One address for the left operand and the output. The guard orders
        // the launch after earlier work on the buffer, as a kernel
        // argument's does.
        let (out_ptr, _in_order) = out.device_ptr_mut(&stream);
        let dims = ol.dims().len();
        let mut launch = func.builder();
        launch.arg(&n).arg(&dims);
        info.builder_arg(&mut launch);
        launch.arg(&out_ptr).arg(&rhs).arg(&out_ptr);
        // SAFETY: `b<op>_T(numel, num_dims, dims_and_strides, lhs, rhs, out)`
        // reads `n` elements of the contiguous `lhs` and `rhs`'s elements at
        // its strides (a layout of `n` elements, checked above), and writes
        // `n` of `out`; `out` holds `n` elements of `T`, each read as `lhs`
        // by the thread that then writes it.
        unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }.w()?;
        Ok(())
    }
    by_dtype!(out.dtype(), name, go(name, out, ol, range, rhs, rl))
}

/// `out = out * mul`, as `tensor * mul` computes it: candle's `affine`
/// kernel in its in-place mode (no input), with the `mul` and `add` that
/// `tensor * mul` passes it.
pub fn scale(out: &mut CudaStorage, ol: &Layout, mul: f64) -> Result<()> {
    let range = output_range(ol, "scale")?;
    fn go<T: CudaDType + WithDType + DeviceRepr>(
        out: &mut CudaStorage,
        range: (usize, usize),
        mul: f64,
    ) -> Result<()> {
        let affine = (T::from_f64(mul), T::from_f64(0.0));
        without_input::<T>(out, range, ("affine", &kernels::AFFINE), Some(affine))
    }
    by_dtype!(out.dtype(), "scale", go(out, range, mul))
}

/// `out = max(out, 0)`: candle's `urelu` kernel in its in-place mode (no
/// input).
pub fn relu(out: &mut CudaStorage, ol: &Layout) -> Result<()> {
    let range = output_range(ol, "relu")?;
    fn go<T: CudaDType + WithDType + DeviceRepr>(
        out: &mut CudaStorage,
        range: (usize, usize),
    ) -> Result<()> {
        without_input::<T>(out, range, ("urelu", &kernels::UNARY), None)
    }
    by_dtype!(out.dtype(), "relu", go(out, range))
}

/// candle's element-wise kernel `name` (of `module`) over elements
/// `o0..o1` of `out` in the kernels' in-place mode: `(numel, num_dims,
/// info, inp, out)` with a null `info` (contiguous) and a null `inp`, so
/// each element is read from `out` and written back by one thread; then
/// `affine`'s `mul` and `add`, when given.
fn without_input<T: CudaDType + WithDType + DeviceRepr>(
    out: &mut CudaStorage,
    (o0, o1): (usize, usize),
    (name, module): (&str, &kernels::Module),
    affine: Option<(T, T)>,
) -> Result<()> {
    let n = o1 - o0;
    if n == 0 {
        return Ok(());
    }
    let device = out.device().clone();
    let stream = device.cuda_stream();
    let func = device.get_or_load_func(&kernel_name::<T>(name), module)?;
    let mut out = out.as_cuda_slice_mut::<T>()?.slice_mut(o0..o1);
    // The guard orders the launch after earlier work on the buffer, as a
    // kernel argument's does.
    let (out_ptr, _in_order) = out.device_ptr_mut(&stream);
    let (dims, no_layout, no_input) = (1usize, 0usize, 0usize);
    let mut launch = func.builder();
    launch
        .arg(&n)
        .arg(&dims)
        .arg(&no_layout)
        .arg(&no_input)
        .arg(&out_ptr);
    if let Some((mul, add)) = &affine {
        launch.arg(mul).arg(add);
    }
    // SAFETY: `unary_T(numel, num_dims, info, inp, out)` and
    // `affine_T(numel, num_dims, info, inp, out, mul, add)` with a null
    // `info` and a null `inp` read and write `n` elements of `out`, which
    // holds `n` elements of `T`.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }.w()?;
    Ok(())
}

/// The softmax over the last dimension, written over its input: the launch
/// of candle-nn's `softmax_last_dim` (one warp per row), with its output
/// its input.
pub fn softmax_last_dim(out: &mut CudaStorage, ol: &Layout) -> Result<()> {
    let range = output_range(ol, "softmax")?;
    let ncols = ol.dims().last().copied().unwrap_or(1);
    if range.0 == range.1 || ncols == 0 {
        return Ok(());
    }
    fn go<T: CudaDType + WithDType + DeviceRepr>(
        out: &mut CudaStorage,
        (o0, o1): (usize, usize),
        ncols: usize,
    ) -> Result<()> {
        let rows = (o1 - o0) / ncols;
        let device = out.device().clone();
        let stream = device.cuda_stream();
        let func = device.get_or_load_func(&kernel_name::<T>("softmax"), &kernels::REDUCE)?;
        let mut out = out.as_cuda_slice_mut::<T>()?.slice_mut(o0..o1);
        let (out_ptr, _in_order) = out.device_ptr_mut(&stream);
        let ncols = ncols as i32;
        let mut launch = func.builder();
        launch.arg(&out_ptr).arg(&out_ptr).arg(&ncols);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (1, 32, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `softmax_T(src, dst, n_cols)` reads and writes `rows *
        // ncols` elements, which `out` holds (at most 2^30, so its `int`
        // indices hold them); each is read and then written by the one
        // thread of its row's warp that owns its column.
        unsafe { launch.launch(cfg) }.w()?;
        Ok(())
    }
    by_dtype!(out.dtype(), "softmax", go(out, range, ncols))
}
