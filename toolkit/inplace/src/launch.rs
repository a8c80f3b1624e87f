//! The launches.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};
use candle_core::cuda_backend::{kernel_name, kernels, CudaDType, SlicePtrOrNull, WrapErr};
use candle_core::{bail, CudaStorage, DType, Layout, Result, Tensor, WithDType};
use candle_kernel_params::Elem;

use crate::params::{self, name};
use crate::plan::{self, Grid, MAX_ELEMENTS};

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
            Binary::Add => name::ADD,
            Binary::Sub => name::SUB,
            Binary::Mul => name::MUL,
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

impl From<Grid> for LaunchConfig {
    fn from(g: Grid) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (g.blocks, 1, 1),
            block_dim: (g.threads.0, g.threads.1, 1),
            shared_mem_bytes: 0,
        }
    }
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
    let Some(plan) = plan::binary(name, (ol, out.dtype()), (rl, rhs.dtype()))? else {
        return Ok(());
    };
    fn go<T: CudaDType + WithDType + Elem>(
        name: &str,
        out: &mut CudaStorage,
        rhs: &CudaStorage,
        plan: plan::Binary,
    ) -> Result<()> {
        let (o0, o1) = plan.out;
        let device = out.device().clone();
        let stream = device.cuda_stream();
        let func = device.get_or_load_func(&kernel_name::<T>(name), &kernels::BINARY)?;
        let info = match plan.dims_and_strides {
            None => SlicePtrOrNull::Null,
            Some(info) => SlicePtrOrNull::params_from_vec(&device, info)?,
        };
        let (info_ptr, _info_in_order) = match &info {
            SlicePtrOrNull::Ptr(info) => {
                let (ptr, in_order) = info.device_ptr(&stream);
                (ptr, Some(in_order))
            }
            SlicePtrOrNull::Cached(info) => {
                let (ptr, in_order) = info.device_ptr(&stream);
                (ptr, Some(in_order))
            }
            SlicePtrOrNull::Null => (0, None),
        };
        let rhs = rhs.as_cuda_slice::<T>()?.slice(plan.rhs_start..);
        let mut out = out.as_cuda_slice_mut::<T>()?.slice_mut(o0..o1);
        // One address for the left operand and the output. The guards order
        // the launch after earlier work on the buffers, as a kernel
        // argument's does.
        let (out_ptr, _in_order) = out.device_ptr_mut(&stream);
        let mut args = params::BinaryAssign::<T> {
            numel: o1 - o0,
            num_dims: plan.num_dims,
            dims_and_strides: info_ptr,
            lhs: out_ptr,
            rhs,
            out: out_ptr,
        };
        let mut launch = func.builder();
        args.push(&mut launch);
        // SAFETY: `b<op>_T(numel, num_dims, dims_and_strides, lhs, rhs, out)`
        // reads `numel` elements of the contiguous `lhs` and `rhs`'s
        // elements at its strides (a layout of `numel` elements, checked by
        // the plan), and writes `numel` of `out`; `out` holds `numel`
        // elements of `T`, each read as `lhs` by the thread that then
        // writes it.
        unsafe { launch.launch(plan.grid.into()) }.w()?;
        Ok(())
    }
    by_dtype!(out.dtype(), name, go(name, out, rhs, plan))
}

/// `out = out * mul`, as `tensor * mul` computes it: candle's `affine`
/// kernel in its in-place mode (no input), with the `mul` and `add` that
/// `tensor * mul` passes it.
pub fn scale(out: &mut CudaStorage, ol: &Layout, mul: f64) -> Result<()> {
    let Some(plan) = plan::in_place(ol, "scale")? else {
        return Ok(());
    };
    fn go<T: CudaDType + WithDType + Elem>(
        out: &mut CudaStorage,
        plan: plan::InPlace,
        mul: f64,
    ) -> Result<()> {
        let affine = (T::from_f64(mul), T::from_f64(0.0));
        without_input::<T>(out, plan, (name::AFFINE, &kernels::AFFINE), Some(affine))
    }
    by_dtype!(out.dtype(), "scale", go(out, plan, mul))
}

/// `out = max(out, 0)`: candle's `urelu` kernel in its in-place mode (no
/// input).
pub fn relu(out: &mut CudaStorage, ol: &Layout) -> Result<()> {
    let Some(plan) = plan::in_place(ol, "relu")? else {
        return Ok(());
    };
    fn go<T: CudaDType + WithDType + Elem>(
        out: &mut CudaStorage,
        plan: plan::InPlace,
    ) -> Result<()> {
        without_input::<T>(out, plan, (name::RELU, &kernels::UNARY), None)
    }
    by_dtype!(out.dtype(), "relu", go(out, plan))
}

/// candle's element-wise kernel `name` (of `module`) over the plan's
/// elements of `out` in the kernels' in-place mode: `(numel, num_dims,
/// info, inp, out)` with a null `info` (contiguous) and a null `inp`, so
/// each element is read from `out` and written back by one thread; then
/// `affine`'s `mul` and `add`, when given.
fn without_input<T: CudaDType + WithDType + Elem>(
    out: &mut CudaStorage,
    plan: plan::InPlace,
    (name, module): (&str, &kernels::Module),
    affine: Option<(T, T)>,
) -> Result<()> {
    let (o0, o1) = plan.out;
    let device = out.device().clone();
    let stream = device.cuda_stream();
    let func = device.get_or_load_func(&kernel_name::<T>(name), module)?;
    let mut out = out.as_cuda_slice_mut::<T>()?.slice_mut(o0..o1);
    // The guard orders the launch after earlier work on the buffer, as a
    // kernel argument's does.
    let (out_ptr, _in_order) = out.device_ptr_mut(&stream);
    let (numel, num_dims, info, inp, out) = (o1 - o0, 1, 0, 0, out_ptr);
    // Both live as long as the launch that borrows one of them.
    let mut unary = params::UnaryInPlace::<T> {
        numel,
        num_dims,
        info,
        inp,
        out,
    };
    let mut with_affine = affine.map(|(mul, add)| params::AffineInPlace::<T> {
        numel,
        num_dims,
        info,
        inp,
        out,
        mul,
        add,
    });
    let mut launch = func.builder();
    match &mut with_affine {
        Some(args) => args.push(&mut launch),
        None => unary.push(&mut launch),
    }
    // SAFETY: `unary_T(numel, num_dims, info, inp, out)` and
    // `affine_T(numel, num_dims, info, inp, out, mul, add)` with a null
    // `info` and a null `inp` read and write `numel` elements of `out`,
    // which holds `numel` elements of `T`.
    unsafe { launch.launch(plan.grid.into()) }.w()?;
    Ok(())
}

/// The softmax over the last dimension, written over its input: the launch
/// of candle-nn's `softmax_last_dim` (one warp per row), with its output
/// its input.
pub fn softmax_last_dim(out: &mut CudaStorage, ol: &Layout) -> Result<()> {
    let Some(plan) = plan::softmax(ol)? else {
        return Ok(());
    };
    fn go<T: CudaDType + WithDType + Elem>(
        out: &mut CudaStorage,
        plan: plan::Softmax,
    ) -> Result<()> {
        let (o0, o1) = plan.out;
        let device = out.device().clone();
        let stream = device.cuda_stream();
        let func = device.get_or_load_func(&kernel_name::<T>(name::SOFTMAX), &kernels::REDUCE)?;
        let mut out = out.as_cuda_slice_mut::<T>()?.slice_mut(o0..o1);
        let (out_ptr, _in_order) = out.device_ptr_mut(&stream);
        let mut args = params::SoftmaxInPlace::<T> {
            src: out_ptr,
            dst: out_ptr,
            n_cols: plan.n_cols,
        };
        let mut launch = func.builder();
        args.push(&mut launch);
        // SAFETY: `softmax_T(src, dst, n_cols)` reads and writes the rows'
        // `rows * n_cols` elements, which `out` holds (at most 2^30, so its
        // `int` indices hold them); each is read and then written by the
        // one thread of its row's warp that owns its column.
        unsafe { launch.launch(plan.grid.into()) }.w()?;
        Ok(())
    }
    by_dtype!(out.dtype(), "softmax", go(out, plan))
}
