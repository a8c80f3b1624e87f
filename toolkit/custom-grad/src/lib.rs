//! A backward of your own for a tensor computed with candle's operations.
//!
//! candle's custom operations (`CustomOp1` to `CustomOp3`) take a forward
//! written against raw storage, per device. Often the forward is best
//! written with candle's own tensor operations and only the backward needs
//! to differ: a backward that recomputes instead of keeping (FlashAttention),
//! that fetches weights from elsewhere (offload), or that skips a product
//! whose output was kept, a parameter gathered from its shards whose
//! gradient goes back to them. [`with_backward1`], [`with_backward2`] and
//! [`with_backward3`] take the output computed beforehand, detached, and
//! return it as one operation of candle's autograd over the given inputs,
//! whose backward is the given one.
//!
//! The forward hands candle a copy of the output's storage (candle's custom
//! operations must return storage of their own), so the output briefly
//! exists twice; the precomputed tensor is dropped right after.
//!
//! The backward is given its inputs and output detached. A gradient computed
//! from a tensor still in the graph would be in the graph too, and would
//! keep what it was computed from alive until candle's backward ends: for a
//! weight's gradient, the whole upstream gradient of its layer. So these
//! operations have first derivatives only: a second derivative through them
//! (candle's `CANDLE_GRAD_DO_NOT_DETACH`) finds no graph behind their
//! gradients.
//!
//! ```
//! use candle_core::{Device, Result, Tensor, Var};
//! use candle_custom_grad::{with_backward2, Backward2};
//!
//! /// `a * b`, whose backward claims the gradient of `a + b`.
//! struct AsIfSum;
//! impl Backward2 for AsIfSum {
//!     fn backward(&self, _: &Tensor, _: &Tensor, _: &Tensor, g: &Tensor)
//!         -> Result<(Option<Tensor>, Option<Tensor>)> {
//!         Ok((Some(g.clone()), Some(g.clone())))
//!     }
//! }
//!
//! let dev = Device::Cpu;
//! let (a, b) = (Var::new(&[2f32], &dev)?, Var::new(&[3f32], &dev)?);
//! let out = (a.as_tensor() * b.as_tensor())?.detach();
//! let y = with_backward2(out, [&a, &b], AsIfSum)?;
//! assert_eq!(y.to_vec1::<f32>()?, [6.0]);
//! let grads = y.sum_all()?.backward()?;
//! assert_eq!(grads.get(&a).unwrap().to_vec1::<f32>()?, [1.0]);
//! # Ok::<(), candle_core::Error>(())
//! ```
#![warn(missing_docs)]

mod direct;
pub mod kept;

pub use direct::{DirectBackward, DirectGrads};

use std::sync::Mutex;

use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp1, CustomOp2, CustomOp3, Layout, MetalStorage, Result,
    Shape, Storage, Tensor,
};

/// The backward of an operation of one input: the gradient of `a` (`None`
/// for none) from the output `out` and its gradient `grad`.
pub trait Backward1: Send + Sync {
    /// The input's gradient.
    fn backward(&self, a: &Tensor, out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>>;

    /// The tensors this backward keeps beside its input and output. See
    /// [`Backward2::kept`].
    fn kept(&self) -> Vec<Tensor> {
        Vec::new()
    }
}

/// The backward of an operation of two inputs: the gradients of `a` and
/// `b` (`None` for an input that gets none) from the output `out` and its
/// gradient `grad`.
pub trait Backward2: Send + Sync {
    /// The inputs' gradients.
    fn backward(
        &self,
        a: &Tensor,
        b: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)>;

    /// The tensors this backward keeps beside its inputs and output (which
    /// the graph holds already), for a ledger of what a graph holds. See
    /// [`kept`].
    fn kept(&self) -> Vec<Tensor> {
        Vec::new()
    }
}

/// The backward of an operation of three inputs.
pub trait Backward3: Send + Sync {
    /// The inputs' gradients.
    fn backward(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)>;

    /// The tensors this backward keeps beside its inputs and output. See
    /// [`Backward2::kept`].
    fn kept(&self) -> Vec<Tensor> {
        Vec::new()
    }
}

/// The precomputed output, handed to candle once as storage.
struct Handover {
    out: Mutex<Option<Tensor>>,
    shape: Shape,
}

impl Handover {
    fn new(out: Tensor) -> Self {
        let shape = out.shape().clone();
        Self {
            out: Mutex::new(Some(out.detach())),
            shape,
        }
    }

    fn take(&self) -> Result<(Storage, Shape)> {
        let out = self
            .out
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| {
                candle_core::Error::Msg("a custom backward's forward ran twice".into())
            })?;
        // candle reads the returned storage as contiguous from 0.
        let out = if out.layout().is_contiguous() && out.layout().start_offset() == 0 {
            out
        } else {
            out.force_contiguous()?
        };
        let (storage, layout) = out.storage_and_layout();
        Ok((storage.try_clone(layout)?, self.shape.clone()))
    }

    fn cpu(&self) -> Result<(CpuStorage, Shape)> {
        match self.take()? {
            (Storage::Cpu(s), shape) => Ok((s, shape)),
            _ => bail!("the precomputed output is not on the CPU, where the inputs are"),
        }
    }

    fn cuda(&self) -> Result<(CudaStorage, Shape)> {
        match self.take()? {
            (Storage::Cuda(s), shape) => Ok((s, shape)),
            _ => bail!("the precomputed output is not on the CUDA device, where the inputs are"),
        }
    }

    fn metal(&self) -> Result<(MetalStorage, Shape)> {
        match self.take()? {
            (Storage::Metal(s), shape) => Ok((s, shape)),
            _ => bail!("the precomputed output is not on the Metal device, where the inputs are"),
        }
    }
}

struct Op1<B> {
    out: Handover,
    backward: B,
}

impl<B: Backward1> CustomOp1 for Op1<B> {
    fn name(&self) -> &'static str {
        "custom-backward"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        self.out.cpu()
    }

    fn cuda_fwd(&self, _: &CudaStorage, _: &Layout) -> Result<(CudaStorage, Shape)> {
        self.out.cuda()
    }

    fn metal_fwd(&self, _: &MetalStorage, _: &Layout) -> Result<(MetalStorage, Shape)> {
        self.out.metal()
    }

    fn bwd(&self, a: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        self.backward.backward(&a.detach(), &res.detach(), grad)
    }
}

struct Op2<B> {
    out: Handover,
    backward: B,
}

impl<B: Backward2> CustomOp2 for Op2<B> {
    fn name(&self) -> &'static str {
        "custom-backward"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.out.cpu()
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.out.cuda()
    }

    fn metal_fwd(
        &self,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
    ) -> Result<(MetalStorage, Shape)> {
        self.out.metal()
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        self.backward
            .backward(&a.detach(), &b.detach(), &res.detach(), grad)
    }
}

struct Op3<B> {
    out: Handover,
    backward: B,
}

impl<B: Backward3> CustomOp3 for Op3<B> {
    fn name(&self) -> &'static str {
        "custom-backward"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.out.cpu()
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.out.cuda()
    }

    fn metal_fwd(
        &self,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
    ) -> Result<(MetalStorage, Shape)> {
        self.out.metal()
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.backward
            .backward(&a.detach(), &b.detach(), &c.detach(), &res.detach(), grad)
    }
}

/// Checks that `out` is on the inputs' device (`a`'s), and returns what
/// the backward keeps when a ledger is recording.
fn before_apply(
    out: &Tensor,
    a: &Tensor,
    kept_by_backward: impl FnOnce() -> Vec<Tensor>,
) -> Result<Vec<Tensor>> {
    if !out.device().same_device(a.device()) {
        bail!(
            "the output is on {:?}, the inputs on {:?}",
            out.device(),
            a.device()
        );
    }
    Ok(if kept::is_recording() {
        kept_by_backward()
    } else {
        Vec::new()
    })
}

/// `out`, computed beforehand from `a`, as one operation of candle's
/// autograd over it whose backward is `backward`. `out` may differ from `a`
/// in shape and dtype (a gathered parameter from its block); it must be on
/// `a`'s device, and its graph, if any, is dropped.
pub fn with_backward1(
    out: Tensor,
    a: &Tensor,
    backward: impl Backward1 + 'static,
) -> Result<Tensor> {
    let kept = before_apply(&out, a, || backward.kept())?;
    let out = a.apply_op1(Op1 {
        out: Handover::new(out),
        backward,
    })?;
    kept::note(&out, kept);
    Ok(out)
}

/// `out`, computed beforehand from `a` and `b`, as one operation of
/// candle's autograd over them whose backward is `backward`. `out` must be
/// on the inputs' device; its graph, if any, is dropped.
pub fn with_backward2(
    out: Tensor,
    [a, b]: [&Tensor; 2],
    backward: impl Backward2 + 'static,
) -> Result<Tensor> {
    let kept = before_apply(&out, a, || backward.kept())?;
    let out = a.apply_op2(
        b,
        Op2 {
            out: Handover::new(out),
            backward,
        },
    )?;
    kept::note(&out, kept);
    Ok(out)
}

/// [`with_backward2`] for an operation of three inputs.
pub fn with_backward3(
    out: Tensor,
    [a, b, c]: [&Tensor; 3],
    backward: impl Backward3 + 'static,
) -> Result<Tensor> {
    let kept = before_apply(&out, a, || backward.kept())?;
    let out = a.apply_op3(
        b,
        c,
        Op3 {
            out: Handover::new(out),
            backward,
        },
    )?;
    kept::note(&out, kept);
    Ok(out)
}
