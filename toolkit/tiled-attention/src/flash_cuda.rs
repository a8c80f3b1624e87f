//! The tiled attention on a CUDA GPU: four kernels of its own
//! (`kernels/flash_*.cu`) where the composed path launches several
//! operations per block. The forward writes the output and the log-sum-exp;
//! the backward writes `rowsum(dO * O)`, then dK and dV (each key block's,
//! summed over its group's query heads), then dQ. Besides the inputs, a
//! call holds its outputs and, in the backward, one f32 per query row
//! (and a contiguous copy of any input that is not contiguous).

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Device, Result, Shape, Storage, Tensor};

use crate::config::FlashConfig;
use crate::flash_params as params;
use crate::flash_plan::{plan, Launch, Plan};
use crate::forward::Forward;
use crate::shapes::Dims;

mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

/// The launches for a call on a CUDA GPU, or `None` where the kernels do
/// not apply (`flash_plan::plan`) and the composed path runs.
pub(crate) fn applies(q: &Tensor, dims: &Dims) -> Option<Plan> {
    if !q.device().is_cuda() {
        return None;
    }
    plan(dims, q.dtype())
}

/// The module holding a plan's kernels and its name in the device's cache.
fn module(plan: &Plan) -> (&'static str, &'static str) {
    match plan.padded {
        32 => ("candle_tiled_attention_flash_32", ptx::FLASH_32),
        64 => ("candle_tiled_attention_flash_64", ptx::FLASH_64),
        _ => ("candle_tiled_attention_flash_128", ptx::FLASH_128),
    }
}

fn config(launch: &Launch) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (launch.grid.0, launch.grid.1, 1),
        block_dim: (launch.block, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn device(t: &Tensor) -> Result<CudaDevice> {
    match t.device() {
        Device::Cuda(d) => Ok(d.clone()),
        other => bail!("tiled attention's CUDA kernels: a tensor is on {other:?}"),
    }
}

/// A contiguous tensor's elements on the GPU.
fn view<'a, T: CudaDType>(storage: &'a Storage, t: &Tensor) -> Result<CudaView<'a, T>> {
    let Storage::Cuda(s) = storage else {
        bail!("tiled attention's CUDA kernels: a tensor is not on a CUDA GPU");
    };
    let Some((start, end)) = t.layout().contiguous_offsets() else {
        bail!("tiled attention's CUDA kernels: a tensor is not contiguous");
    };
    Ok(s.as_cuda_slice::<T>()?.slice(start..end))
}

/// A new tensor over a buffer a kernel wrote.
fn wrap<T: CudaDType>(slice: CudaSlice<T>, dev: &CudaDevice, shape: impl Into<Shape>) -> Tensor {
    let storage = CudaStorage::wrap_cuda_slice(slice, dev.clone());
    Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false)
}

/// What every kernel but `delta` takes after its tensors: `nq, nk, d, dv,
/// q_heads, group` (i32, which `plan` checked they fit), the scale and
/// whether the mask is causal.
#[derive(Clone, Copy)]
struct Sizes {
    nq: i32,
    nk: i32,
    d: i32,
    dv: i32,
    hq: i32,
    group: i32,
    scale: f32,
    causal: i32,
}

impl Sizes {
    fn of(dims: &Dims, s: f64, causal: bool) -> Self {
        let n = |x: usize| x as i32;
        Self {
            nq: n(dims.nq),
            nk: n(dims.nk),
            d: n(dims.d),
            dv: n(dims.dv),
            hq: n(dims.q_heads),
            group: n(dims.group()),
            scale: s as f32,
            causal: i32::from(causal),
        }
    }
}

/// The forward: `(batch, q_heads, nq, dv)` in the inputs' dtype and the
/// f32 log-sum-exp of each row.
pub(crate) fn forward(
    [q, k, v]: [&Tensor; 3],
    dims: &Dims,
    plan: &Plan,
    cfg: &FlashConfig,
    s: f64,
) -> Result<Forward> {
    let [q, k, v] = [q, k, v].map(|t| t.detach().contiguous());
    let qkv = [&q?, &k?, &v?];
    let (out, lse) = match qkv[0].dtype() {
        DType::F32 => forward_typed::<f32>(qkv, dims, plan, cfg, s)?,
        DType::F16 => forward_typed::<half::f16>(qkv, dims, plan, cfg, s)?,
        _ => forward_typed::<half::bf16>(qkv, dims, plan, cfg, s)?,
    };
    Ok(Forward {
        out,
        lse,
        cfg: *cfg,
        inputs: crate::forward::shapes_of(qkv[0], qkv[1], qkv[2]),
    })
}

fn forward_typed<T: CudaDType + DeviceRepr + candle_kernel_params::Elem>(
    [q, k, v]: [&Tensor; 3],
    dims: &Dims,
    plan: &Plan,
    cfg: &FlashConfig,
    s: f64,
) -> Result<(Tensor, Tensor)> {
    let dev = device(q)?;
    let (name, ptx) = module(plan);
    let func = dev.get_or_load_custom_func(&plan.forward.name, name, ptx)?;
    let rows = dims.rows() * dims.nq;
    // SAFETY (both): the kernel writes every element, each row of `out`
    // (`dv` elements) and of `lse` (one) for each of the `rows` queries.
    let mut out = unsafe { dev.alloc::<T>(rows * dims.dv)? };
    let mut lse = unsafe { dev.alloc::<f32>(rows)? };
    {
        let [gq, gk, gv] = [q, k, v].map(|x| x.storage_and_layout().0);
        let (qv, kv, vv) = (view::<T>(&gq, q)?, view::<T>(&gk, k)?, view::<T>(&gv, v)?);
        let Sizes {
            nq,
            nk,
            d,
            dv,
            hq,
            group,
            scale,
            causal,
        } = Sizes::of(dims, s, cfg.causal);
        let mut args = params::Forward {
            q: qv,
            k: kv,
            v: vv,
            out: out.as_view_mut(),
            lse: lse.as_view_mut(),
            nq,
            nk,
            d,
            dv,
            hq,
            group,
            scale,
            causal,
        };
        let mut launch = func.builder();
        args.push(&mut launch);
        // SAFETY: the arguments are those `flash_forward_<D>_<T>` declares
        // (`flash_params`' test holds them to it); q, k and v are
        // contiguous `(batch, heads, n, width)` of the sizes passed, and the
        // grid is `plan`'s for these sizes.
        unsafe { launch.launch(config(&plan.forward)) }.w()?;
    }
    let shape = (dims.batch, dims.q_heads, dims.nq, dims.dv);
    Ok((
        wrap(out, &dev, shape),
        wrap(lse, &dev, (dims.batch, dims.q_heads, dims.nq)),
    ))
}

/// The backward: dQ, dK and dV in the inputs' dtype.
pub(crate) fn backward(
    [q, k, v]: [&Tensor; 3],
    fwd: &Forward,
    d_out: &Tensor,
    dims: &Dims,
    plan: &Plan,
    s: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dtype = q.dtype();
    let [q, k, v, o] = [q, k, v, &fwd.out].map(|t| t.detach().contiguous());
    let (q, k, v, o) = (q?, k?, v?, o?);
    let d_out = d_out.detach().to_dtype(dtype)?.contiguous()?;
    let lse = fwd.lse.detach().to_dtype(DType::F32)?.contiguous()?;
    let t = Inputs {
        q: &q,
        k: &k,
        v: &v,
        o: &o,
        d_out: &d_out,
        lse: &lse,
    };
    match dtype {
        DType::F32 => backward_typed::<f32>(t, dims, plan, fwd.cfg.causal, s),
        DType::F16 => backward_typed::<half::f16>(t, dims, plan, fwd.cfg.causal, s),
        _ => backward_typed::<half::bf16>(t, dims, plan, fwd.cfg.causal, s),
    }
}

/// The backward's tensors, contiguous.
struct Inputs<'a> {
    q: &'a Tensor,
    k: &'a Tensor,
    v: &'a Tensor,
    o: &'a Tensor,
    d_out: &'a Tensor,
    lse: &'a Tensor,
}

fn backward_typed<T: CudaDType + DeviceRepr + candle_kernel_params::Elem>(
    t: Inputs,
    dims: &Dims,
    plan: &Plan,
    causal: bool,
    s: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dev = device(t.q)?;
    let (name, ptx) = module(plan);
    let load = |launch: &Launch| dev.get_or_load_custom_func(&launch.name, name, ptx);
    let rows = dims.rows() * dims.nq;
    let keys = dims.batch * dims.kv_heads * dims.nk;
    // SAFETY (all four): `delta` writes each of the `rows` rows; the
    // key/value kernel every element of dK (`d` per key row) and dV (`dv`),
    // the query kernel every element of dQ (`d` per query row).
    let mut delta = unsafe { dev.alloc::<f32>(rows)? };
    let mut dq = unsafe { dev.alloc::<T>(rows * dims.d)? };
    let mut dk = unsafe { dev.alloc::<T>(keys * dims.d)? };
    let mut dv = unsafe { dev.alloc::<T>(keys * dims.dv)? };
    {
        let [gq, gk, gv, go, gd, gl] =
            [t.q, t.k, t.v, t.o, t.d_out, t.lse].map(|x| x.storage_and_layout().0);
        // Each launch's own views of the inputs.
        let q = || view::<T>(&gq, t.q);
        let k = || view::<T>(&gk, t.k);
        let v = || view::<T>(&gv, t.v);
        let d_out = || view::<T>(&gd, t.d_out);
        let lse = || view::<f32>(&gl, t.lse);
        let sz = Sizes::of(dims, s, causal);

        let func = load(&plan.delta)?;
        let mut args = params::Delta {
            d_out: d_out()?,
            out: view::<T>(&go, t.o)?,
            dl: delta.as_view_mut(),
            rows,
            dv: sz.dv,
        };
        let mut launch = func.builder();
        args.push(&mut launch);
        // SAFETY: `flash_delta_<D>_<T>(d_out, out, delta, rows, dv)` reads
        // `rows` rows of `dv` elements of each and writes `rows` floats.
        unsafe { launch.launch(config(&plan.delta)) }.w()?;

        let func = load(&plan.backward_kv)?;
        let mut args = params::BackwardKv {
            q: q()?,
            k: k()?,
            v: v()?,
            d_out: d_out()?,
            lse: lse()?,
            dl: delta.as_view(),
            dk: dk.as_view_mut(),
            dv_out: dv.as_view_mut(),
            nq: sz.nq,
            nk: sz.nk,
            d: sz.d,
            dv: sz.dv,
            hq: sz.hq,
            group: sz.group,
            scale: sz.scale,
            causal: sz.causal,
        };
        let mut launch = func.builder();
        args.push(&mut launch);
        // SAFETY: the arguments `flash_backward_kv_<D>_<T>` declares, of the
        // sizes passed; the grid is `plan`'s.
        unsafe { launch.launch(config(&plan.backward_kv)) }.w()?;

        let func = load(&plan.backward_q)?;
        let mut args = params::BackwardQ {
            q: q()?,
            k: k()?,
            v: v()?,
            d_out: d_out()?,
            lse: lse()?,
            dl: delta.as_view(),
            dq: dq.as_view_mut(),
            nq: sz.nq,
            nk: sz.nk,
            d: sz.d,
            dv: sz.dv,
            hq: sz.hq,
            group: sz.group,
            scale: sz.scale,
            causal: sz.causal,
        };
        let mut launch = func.builder();
        args.push(&mut launch);
        // SAFETY: as above, for `flash_backward_q_<D>_<T>`.
        unsafe { launch.launch(config(&plan.backward_q)) }.w()?;
    }
    drop(delta);
    let (b, hq, hkv) = (dims.batch, dims.q_heads, dims.kv_heads);
    Ok((
        wrap(dq, &dev, (b, hq, dims.nq, dims.d)),
        wrap(dk, &dev, (b, hkv, dims.nk, dims.d)),
        wrap(dv, &dev, (b, hkv, dims.nk, dims.dv)),
    ))
}
