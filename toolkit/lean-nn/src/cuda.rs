//! An activation's gradient on a CUDA GPU in one kernel
//! (`kernels/activation.cu`): `g * act'(saved)` with the arithmetic, and
//! the roundings, of the composed operations in `linear.rs`, into one new
//! tensor where they make one per operation (GELU's derivative six in f32).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CpuStorage, CudaStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

use crate::linear::Activation;
use crate::params;

/// The module's name in the device's cache of loaded kernels.
const MODULE: &str = "candle_lean_nn_activation";

/// `g * act'(saved)` from a ReLU's output or GELU's input `saved`, when
/// both are contiguous, of one shape and float dtype, on one CUDA GPU, with
/// at most `u32::MAX` elements; `None` otherwise (and for the identity).
pub(crate) fn act_grad(g: &Tensor, saved: &Tensor, act: Activation) -> Result<Option<Tensor>> {
    let kernel = match act {
        Activation::Relu => "relu_grad",
        Activation::Gelu => "gelu_grad",
        Activation::Identity => return Ok(None),
    };
    let applies = g.device().is_cuda()
        && g.device().same_device(saved.device())
        && g.is_contiguous()
        && saved.is_contiguous()
        && g.shape() == saved.shape()
        && g.dtype() == saved.dtype()
        && matches!(
            g.dtype(),
            DType::F32 | DType::F64 | DType::F16 | DType::BF16
        )
        && g.elem_count() > 0
        && u32::try_from(g.elem_count()).is_ok();
    if !applies {
        return Ok(None);
    }
    g.apply_op2_no_bwd(saved, &ActGrad { kernel }).map(Some)
}

/// `g * act'(saved)` into a new tensor.
struct ActGrad {
    kernel: &'static str,
}

impl CustomOp2 for ActGrad {
    fn name(&self) -> &'static str {
        "activation-grad"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("activation-grad: a CUDA GPU's tensors only")
    }

    fn cuda_fwd(
        &self,
        g: &CudaStorage,
        gl: &Layout,
        s: &CudaStorage,
        sl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (Some(gr), Some(sr)) = (gl.contiguous_offsets(), sl.contiguous_offsets()) else {
            bail!("activation-grad: the gradient and the saved tensor must be contiguous");
        };
        if gr.1 - gr.0 != sr.1 - sr.0 || g.dtype() != s.dtype() {
            bail!("activation-grad: a gradient and a saved tensor of one size and dtype only");
        }
        // The kernels are named by candle's name for the dtype.
        let suffix = match g.dtype() {
            d @ (DType::F32 | DType::F64 | DType::F16 | DType::BF16) => d.as_str(),
            d => bail!("activation-grad: float tensors only, not {d:?}"),
        };
        let name = format!("{}_{suffix}", self.kernel);
        fn go<T: CudaDType + DeviceRepr + candle_kernel_params::Elem>(
            name: &str,
            (g, (g0, g1)): (&CudaStorage, (usize, usize)),
            (s, (s0, s1)): (&CudaStorage, (usize, usize)),
        ) -> Result<CudaStorage> {
            let n = g1 - g0;
            let device = g.device().clone();
            let func = device.get_or_load_custom_func(name, MODULE, crate::ptx::ACTIVATION)?;
            // SAFETY: the kernel writes each of the `n` elements.
            let mut out = unsafe { device.alloc::<T>(n)? };
            {
                let mut args = params::ActGrad {
                    out: out.as_view_mut(),
                    g: g.as_cuda_slice::<T>()?.slice(g0..g1),
                    saved: s.as_cuda_slice::<T>()?.slice(s0..s1),
                    n,
                };
                let mut launch = func.builder();
                args.push(&mut launch);
                // SAFETY: `<act>_grad_T(out, g, saved, n)` (`params`' test
                // holds the arguments to it) reads `n` elements of `g` and
                // `saved` and writes `n` of `out`, each holding `n` elements
                // of `T`; `n` fits the launch's u32 (checked by `act_grad`).
                unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }.w()?;
            }
            Ok(CudaStorage::wrap_cuda_slice(out, device))
        }
        let storage = match g.dtype() {
            DType::F32 => go::<f32>(&name, (g, gr), (s, sr))?,
            DType::F64 => go::<f64>(&name, (g, gr), (s, sr))?,
            DType::F16 => go::<half::f16>(&name, (g, gr), (s, sr))?,
            _ => go::<half::bf16>(&name, (g, gr), (s, sr))?,
        };
        Ok((storage, gl.shape().clone()))
    }
}
