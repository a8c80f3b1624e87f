//! The cross-entropy on a CUDA GPU by its own kernels
//! (`kernels/cross_entropy.cu`), a block per row: each row's loss into a
//! vector of `rows` f64s, and the gradient into the one tensor the logits'
//! size it returns. candle's composed operations, which the GPU ran
//! before, make several tensors that size (the logits widened to f32, then
//! shifted, exponentiated and normalised), which the CPU's row kernels
//! never made.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CpuStorage, CudaStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

use crate::params;

/// The module's name in the device's cache of loaded kernels.
const MODULE: &str = "candle_lean_nn_cross_entropy";

/// A block's threads: eight warps, each thread reading a row's elements
/// `THREADS` apart, so that a warp reads 32 adjacent ones.
const THREADS: u32 = 256;

/// The most blocks launched: a block takes every `BLOCKS`th row past them.
const BLOCKS: usize = 65_535;

/// Whether the kernels apply: contiguous float logits on a CUDA GPU, and
/// targets on the same one.
pub(crate) fn applies(logits: &Tensor, targets: &Tensor) -> bool {
    logits.device().is_cuda()
        && targets.device().same_device(logits.device())
        && logits.is_contiguous()
        && matches!(
            logits.dtype(),
            DType::F32 | DType::F64 | DType::F16 | DType::BF16
        )
        && logits.elem_count() > 0
}

/// Targets as the kernels read them: `u32` class indices on the logits'
/// device, each checked against the logits' classes on the host first (a
/// kernel would read past its row for one that is not). Only
/// [`Targets::new`] makes them, so a launch never takes unchecked ones.
pub(crate) struct Targets(Tensor);

impl Targets {
    /// `targets` checked against `classes`, as `u32`s on their device.
    pub(crate) fn new(targets: &Tensor, classes: usize) -> Result<Self> {
        crate::indices::class_indices(targets, classes)?;
        Ok(Self(targets.to_dtype(DType::U32)?.contiguous()?))
    }

    /// The `len` targets from `start` on, checked as these are.
    pub(crate) fn narrow(&self, start: usize, len: usize) -> Result<Self> {
        Ok(Self(self.0.narrow(0, start, len)?))
    }
}

/// The sum over rows of `logsumexp(z) - z[target]`, an f64 scalar on the
/// logits' device, for logits the kernels apply to.
pub(crate) fn sum(logits: &Tensor, targets: &Targets) -> Result<Tensor> {
    logits
        .apply_op2_no_bwd(&targets.0, &Kernel::Loss)?
        .sum_all()
}

/// `(softmax(logits) - onehot(targets)) * scale`, in the logits' dtype,
/// computed in f32 (f64 for f64 logits), for logits the kernels apply to.
pub(crate) fn grad(logits: &Tensor, targets: &Targets, scale: f64) -> Result<Tensor> {
    logits.apply_op2_no_bwd(&targets.0, &Kernel::Grad { scale })
}

/// One of the two kernels.
enum Kernel {
    /// Each row's loss, as f64: `(rows,)`.
    Loss,
    /// The gradient times `scale`: the logits' shape.
    Grad { scale: f64 },
}

impl CustomOp2 for Kernel {
    fn name(&self) -> &'static str {
        match self {
            Kernel::Loss => "cross-entropy",
            Kernel::Grad { .. } => "cross-entropy-grad",
        }
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("{}: a CUDA GPU's tensors only", self.name())
    }

    fn cuda_fwd(
        &self,
        z: &CudaStorage,
        zl: &Layout,
        t: &CudaStorage,
        tl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (rows, classes) = zl.shape().dims2()?;
        let (Some(zr), Some(tr)) = (zl.contiguous_offsets(), tl.contiguous_offsets()) else {
            bail!(
                "{}: the logits and the targets must be contiguous",
                self.name()
            );
        };
        if zr.1 - zr.0 != rows * classes || tr.1 - tr.0 != rows || t.dtype() != DType::U32 {
            bail!("{}: one u32 class index per row of the logits", self.name());
        }
        let suffix = match z.dtype() {
            d @ (DType::F32 | DType::F64 | DType::F16 | DType::BF16) => d.as_str(),
            d => bail!("{}: float logits only, not {d:?}", self.name()),
        };
        let storage = match z.dtype() {
            DType::F32 => self.launch::<f32>(suffix, (z, zr), (t, tr), (rows, classes))?,
            DType::F64 => self.launch::<f64>(suffix, (z, zr), (t, tr), (rows, classes))?,
            DType::F16 => self.launch::<half::f16>(suffix, (z, zr), (t, tr), (rows, classes))?,
            _ => self.launch::<half::bf16>(suffix, (z, zr), (t, tr), (rows, classes))?,
        };
        let shape = match self {
            Kernel::Loss => Shape::from(rows),
            Kernel::Grad { .. } => zl.shape().clone(),
        };
        Ok((storage, shape))
    }
}

impl Kernel {
    fn launch<T: CudaDType + DeviceRepr + candle_kernel_params::Elem>(
        &self,
        suffix: &str,
        (z, (z0, z1)): (&CudaStorage, (usize, usize)),
        (t, (t0, t1)): (&CudaStorage, (usize, usize)),
        (rows, classes): (usize, usize),
    ) -> Result<CudaStorage> {
        let device = z.device().clone();
        let logits = z.as_cuda_slice::<T>()?.slice(z0..z1);
        let targets = t.as_cuda_slice::<u32>()?.slice(t0..t1);
        let config = LaunchConfig {
            grid_dim: (rows.min(BLOCKS) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        match *self {
            Kernel::Loss => {
                let name = format!("cross_entropy_loss_{suffix}");
                let func =
                    device.get_or_load_custom_func(&name, MODULE, crate::ptx::CROSS_ENTROPY)?;
                // SAFETY: the kernel writes each row's loss.
                let mut loss = unsafe { device.alloc::<f64>(rows)? };
                {
                    let mut args = params::CrossEntropyLoss {
                        loss: loss.as_view_mut(),
                        logits,
                        targets,
                        rows,
                        classes,
                    };
                    let mut launch = func.builder();
                    args.push(&mut launch);
                    // SAFETY: `cross_entropy_loss_T` (`params`' test holds
                    // the arguments to it) reads `rows * classes` logits
                    // and `rows` targets, each a class index (checked by
                    // `Targets::new`), and writes `rows` losses; its block is a
                    // multiple of 32 threads, as its reduction needs.
                    unsafe { launch.launch(config) }.w()?;
                }
                Ok(CudaStorage::wrap_cuda_slice(loss, device))
            }
            Kernel::Grad { scale } => {
                let name = format!("cross_entropy_grad_{suffix}");
                let func =
                    device.get_or_load_custom_func(&name, MODULE, crate::ptx::CROSS_ENTROPY)?;
                // SAFETY: the kernel writes each of the logits' elements.
                let mut out = unsafe { device.alloc::<T>(rows * classes)? };
                {
                    let mut args = params::CrossEntropyGrad {
                        out: out.as_view_mut(),
                        logits,
                        targets,
                        rows,
                        classes,
                        scale,
                    };
                    let mut launch = func.builder();
                    args.push(&mut launch);
                    // SAFETY: as the loss's, writing `rows * classes`
                    // elements of `out`, which holds them.
                    unsafe { launch.launch(config) }.w()?;
                }
                Ok(CudaStorage::wrap_cuda_slice(out, device))
            }
        }
    }
}
