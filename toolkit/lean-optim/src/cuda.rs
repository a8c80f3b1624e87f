//! The AdamW update's kernels on a CUDA GPU (`kernels/adamw.cu`): the same
//! arithmetic as the CPU's, launched on the tensors' own buffers.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CudaStorage, DType, Layout, Result};

use crate::kernel::{range, AdamWStep};
use crate::params;

mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

/// The module's name in the device's cache of loaded kernels.
const MODULE: &str = "candle_lean_optim_adamw";

fn suffix(dtype: DType) -> Result<&'static str> {
    // The kernels are named by candle's name for the dtype.
    Ok(match dtype {
        d @ (DType::F32 | DType::F64 | DType::F16 | DType::BF16) => d.as_str(),
        d => bail!("AdamW updates float parameters; this one is {d:?}"),
    })
}

/// A grid-stride launch over `n` elements.
fn config(n: usize) -> Result<LaunchConfig> {
    match u32::try_from(n) {
        Ok(n) => Ok(LaunchConfig::for_num_elems(n)),
        Err(_) => bail!(
            "AdamW's kernels take at most {} elements per tensor",
            u32::MAX
        ),
    }
}

/// `dst <- a dst + b g` (the first moment) or `dst <- a dst + b g²` (the
/// second), `kernel` naming which.
pub(crate) fn moment(
    kernel: &str,
    dst: &mut CudaStorage,
    dl: &Layout,
    g: &CudaStorage,
    gl: &Layout,
    (a, b): (f64, f64),
) -> Result<()> {
    let (ds, de) = range(dl, "optimizer state")?;
    let (gs, ge) = range(gl, "gradient")?;
    let n = de - ds;
    if n != ge - gs {
        bail!("state of {n} elements, gradient of {}", ge - gs);
    }
    if dst.dtype() != g.dtype() {
        bail!(
            "AdamW: state is {:?}, gradient {:?}: both must be the same float type",
            dst.dtype(),
            g.dtype()
        );
    }
    if n == 0 {
        return Ok(());
    }
    let name = format!("adamw_{kernel}_{}", suffix(dst.dtype())?);
    fn go<T: CudaDType + candle_kernel_params::Elem>(
        name: &str,
        dst: &mut CudaStorage,
        (ds, de): (usize, usize),
        g: &CudaStorage,
        (gs, ge): (usize, usize),
        (a, b): (f64, f64),
    ) -> Result<()> {
        let n = de - ds;
        let func = dst
            .device()
            .get_or_load_custom_func(name, MODULE, ptx::ADAMW)?;
        let mut args = params::Moment {
            dst: dst.as_cuda_slice_mut::<T>()?.slice_mut(ds..de),
            g: g.as_cuda_slice::<T>()?.slice(gs..ge),
            n,
            a,
            b,
        };
        let mut launch = func.builder();
        args.push(&mut launch);
        // SAFETY: the kernel reads and writes `n` elements of each view,
        // which holds that many, with the argument types it declares
        // (`params`' test holds them to it).
        unsafe { launch.launch(config(n)?) }.w()?;
        Ok(())
    }
    let (d, s) = ((ds, de), (gs, ge));
    match dst.dtype() {
        DType::F32 => go::<f32>(&name, dst, d, g, s, (a, b)),
        DType::F64 => go::<f64>(&name, dst, d, g, s, (a, b)),
        DType::F16 => go::<half::f16>(&name, dst, d, g, s, (a, b)),
        _ => go::<half::bf16>(&name, dst, d, g, s, (a, b)),
    }
}

/// `theta <- theta (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)`.
pub(crate) fn theta(
    t: &mut CudaStorage,
    tl: &Layout,
    m: &CudaStorage,
    ml: &Layout,
    v: &CudaStorage,
    vl: &Layout,
    s: &AdamWStep,
) -> Result<()> {
    let (ts, te) = range(tl, "parameter")?;
    let (ms, me) = range(ml, "first moment")?;
    let (vs, ve) = range(vl, "second moment")?;
    let n = te - ts;
    if n != me - ms || n != ve - vs {
        bail!("parameter and moments differ in size");
    }
    if m.dtype() != t.dtype() || v.dtype() != t.dtype() {
        bail!(
            "AdamW: parameter is {:?}; parameter and moments must be the same float type",
            t.dtype()
        );
    }
    if n == 0 {
        return Ok(());
    }
    let name = format!("adamw_theta_{}", suffix(t.dtype())?);
    let k = s.theta_constants();
    fn go<T: CudaDType + candle_kernel_params::Elem>(
        name: &str,
        t: &mut CudaStorage,
        (ts, te): (usize, usize),
        (m, ms): (&CudaStorage, usize),
        (v, vs): (&CudaStorage, usize),
        k: &[f64; 5],
    ) -> Result<()> {
        let n = te - ts;
        let func = t
            .device()
            .get_or_load_custom_func(name, MODULE, ptx::ADAMW)?;
        let [scale_m, scale_v, decay, lr, eps] = *k;
        let mut args = params::Theta {
            theta: t.as_cuda_slice_mut::<T>()?.slice_mut(ts..te),
            m: m.as_cuda_slice::<T>()?.slice(ms..ms + n),
            v: v.as_cuda_slice::<T>()?.slice(vs..vs + n),
            n,
            scale_m,
            scale_v,
            decay,
            lr,
            eps,
        };
        let mut launch = func.builder();
        args.push(&mut launch);
        // SAFETY: as in `moment`, `n` elements of each of three views.
        unsafe { launch.launch(config(n)?) }.w()?;
        Ok(())
    }
    match t.dtype() {
        DType::F32 => go::<f32>(&name, t, (ts, te), (m, ms), (v, vs), &k),
        DType::F64 => go::<f64>(&name, t, (ts, te), (m, ms), (v, vs), &k),
        DType::F16 => go::<half::f16>(&name, t, (ts, te), (m, ms), (v, vs), &k),
        _ => go::<half::bf16>(&name, t, (ts, te), (m, ms), (v, vs), &k),
    }
}
