//! A parameter under ZeRO stage 3 that is not a linear layer's: a norm's
//! scale, an embedding table. Gathered whole for its forward, it stays in
//! the graph (which its backward needs) until the backward, which
//! reduce-scatters its gradient into the block.

use std::sync::Arc;

use candle_core::{DType, Device, Result, Shape, Tensor, Var};
use candle_custom_grad::{with_backward1, Backward1};
use candle_observe::{scope, Kind, Place};

use crate::fsdp::Block;
use crate::split::{reduce_scatter_mean, Split};
use crate::Comm;

/// One parameter partitioned over the ranks: this rank keeps a `1/N` block
/// in f32 (the master weights, [`var`](Self::var), which any optimizer
/// updates); [`gather`](Self::gather) all-gathers the whole as an
/// operation of candle's autograd whose backward reduce-scatters the
/// gradient, so the block's gradient, the mean over the ranks, is in the
/// store `backward()` returns like any variable's.
///
/// For weights used in one product, [`ShardedLinear`](crate::ShardedLinear)
/// holds less: it drops the gathered weight after the forward and gathers
/// it again for the backward. A gathered parameter is held from its forward
/// to its backward, as FSDP's root unit holds its parameters.
///
/// ```
/// use std::sync::Arc;
/// use candle_core::{DType, Device, Tensor};
/// use candle_distributed::{Comm, ShardedParam};
///
/// let dev = Device::Cpu;
/// let scale = ShardedParam::new(Arc::new(Comm::solo()), &Tensor::new(&[1f32, 2.0], &dev)?, &dev)?;
/// let x = Tensor::new(&[3f32, 4.0], &dev)?;
/// let grads = (scale.gather(DType::F32)? * &x)?.sum_all()?.backward()?;
/// let g = grads.get(scale.var().as_tensor()).expect("the block's gradient");
/// assert_eq!(g.to_vec1::<f32>()?, [3.0, 4.0]);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone)]
pub struct ShardedParam {
    comm: Arc<Comm>,
    block: Arc<Block>,
    device: Device,
}

impl std::fmt::Debug for ShardedParam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedParam")
            .field("shape", &self.block.shape)
            .field("rank", &self.comm.rank())
            .finish()
    }
}

impl ShardedParam {
    /// This rank's block of `whole`, which must be equal on every rank, as
    /// a variable on `device`.
    pub fn new(comm: Arc<Comm>, whole: &Tensor, device: &Device) -> Result<Self> {
        let block = Block::new(&comm, whole, device)?;
        Ok(Self {
            comm,
            block: Arc::new(block),
            device: device.clone(),
        })
    }

    /// A block another holder made (a [`ShardedLinear`](crate::ShardedLinear)'s).
    pub(crate) fn of_block(comm: Arc<Comm>, block: Arc<Block>, device: &Device) -> Self {
        Self {
            comm,
            block,
            device: device.clone(),
        }
    }

    /// This rank's block, in f32 (padded with zeros past the parameter's
    /// end on the last ranks).
    pub fn var(&self) -> &Var {
        &self.block.var
    }

    /// The whole parameter's shape.
    pub fn shape(&self) -> &Shape {
        &self.block.shape
    }

    /// The whole parameter in `dtype`, all-gathered; its gradient goes back
    /// to the block, reduce-scattered. Every rank must gather its
    /// parameters in the same order, and run their backwards in the same
    /// order.
    pub fn gather(&self, dtype: DType) -> Result<Tensor> {
        let whole = self.block.gather(&self.comm, dtype, &self.device)?;
        // The operation's output, which the graph keeps, is a copy of the
        // gathered whole: parameters too, whatever the caller's scope.
        let _params = scope(self.comm.observer(), Kind::Parameters, Place::Device);
        with_backward1(
            whole,
            self.block.var.as_tensor(),
            Scatter {
                comm: Arc::clone(&self.comm),
                split: self.block.split,
                device: self.device.clone(),
            },
        )
    }

    /// The whole parameter in `dtype`, all-gathered, with no graph: for a
    /// backward written out by hand, which gathers it again when it needs
    /// it and hands its gradient to [`reduce_gradient`](Self::reduce_gradient).
    /// The same order on every rank, as [`gather`](Self::gather).
    pub fn gather_detached(&self, dtype: DType) -> Result<Tensor> {
        self.block.gather(&self.comm, dtype, &self.device)
    }

    /// This rank's block of the mean over the ranks of `grad`, a gradient
    /// of the whole parameter: reduce-scattered, in f32, the gradient of
    /// [`var`](Self::var) an optimizer takes.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_distributed::{Comm, ShardedParam};
    ///
    /// let dev = Device::Cpu;
    /// let scale = ShardedParam::new(Arc::new(Comm::solo()), &Tensor::new(&[1f32, 2.0], &dev)?, &dev)?;
    /// let whole = scale.gather_detached(DType::F32)?;
    /// assert!(!whole.track_op());
    /// let x = Tensor::new(&[3f32, 4.0], &dev)?;
    /// // d(sum(scale * x)) / d scale = x, by hand; one rank's mean is itself.
    /// let block = scale.reduce_gradient(&x)?;
    /// assert_eq!(block.to_vec1::<f32>()?, [3.0, 4.0]);
    /// let wrong = scale.reduce_gradient(&Tensor::new(&[1f32, 2.0, 3.0], &dev)?).unwrap_err();
    /// assert!(wrong.to_string().contains("a gradient of shape [3] for a parameter of shape [2]"));
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn reduce_gradient(&self, grad: &Tensor) -> Result<Tensor> {
        if grad.shape() != &self.block.shape {
            candle_core::bail!(
                "a gradient of shape {:?} for a parameter of shape {:?}",
                grad.dims(),
                self.block.shape.dims()
            );
        }
        reduce_scatter_mean(&self.comm, grad, self.block.split, &self.device)
    }

    /// The bytes of this rank's block.
    pub fn bytes(&self) -> u64 {
        (self.block.split.block() * DType::F32.size_in_bytes()) as u64
    }
}

/// The gathering's backward: the whole gradient reduce-scattered, this
/// rank's block of its mean over the ranks.
struct Scatter {
    comm: Arc<Comm>,
    split: Split,
    device: Device,
}

impl Backward1 for Scatter {
    fn backward(&self, _block: &Tensor, _whole: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        reduce_scatter_mean(&self.comm, grad, self.split, &self.device).map(Some)
    }
}
