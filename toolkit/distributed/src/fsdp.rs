//! ZeRO stage 3 (FSDP): the parameters themselves partitioned, each layer's
//! gathered from the peers just before its forward and again before its
//! backward.

use std::sync::{Arc, Mutex};

use candle_checkpoint::add_grad;
use candle_core::backprop::GradStore;
use candle_core::{bail, DType, Device, Module, Result, Shape, Tensor, Var};
use candle_lean_nn::Activation;
use candle_observe::{scope, Kind, Place};
use candle_offload::{fetched_linear, fetched_linear_act, WeightSource};

use crate::split::{all_gather_whole, own_block, reduce_scatter_mean, Split};
use crate::{Comm, ShardedParam};

/// One partitioned parameter: this rank's block, in f32.
#[derive(Debug)]
pub(crate) struct Block {
    pub(crate) var: Var,
    pub(crate) shape: Shape,
    pub(crate) split: Split,
}

impl Block {
    /// This rank's block of `t` (equal on every rank), a variable on
    /// `device` allocated as parameters.
    pub(crate) fn new(comm: &Comm, t: &Tensor, device: &Device) -> Result<Self> {
        let split = Split::new(t.elem_count(), comm.size());
        let mine = own_block(comm, t, split)?;
        let _params = scope(comm.observer(), Kind::Parameters, Place::Device);
        Ok(Self {
            var: Var::from_slice(&mine, split.block(), device)?,
            shape: t.shape().clone(),
            split,
        })
    }

    /// The whole parameter from every rank's block, in `dtype`.
    pub(crate) fn gather(&self, comm: &Comm, dtype: DType, device: &Device) -> Result<Tensor> {
        all_gather_whole(
            comm,
            &self.var,
            self.split,
            &self.shape,
            dtype,
            device,
            Kind::Parameters,
        )
    }
}

/// The peers as a layer's [`WeightSource`]: a fetch all-gathers the blocks,
/// the gradients are reduce-scattered back into blocks.
struct Peers {
    comm: Arc<Comm>,
    weight: Arc<Block>,
    bias: Option<Arc<Block>>,
    device: Device,
    grads: Mutex<GradStore>,
}

impl Peers {
    fn gather(&self, block: &Block, dtype: DType) -> Result<Tensor> {
        block.gather(&self.comm, dtype, &self.device)
    }

    fn scatter(&self, block: &Block, grad: &Tensor) -> Result<()> {
        let mean = reduce_scatter_mean(&self.comm, grad, block.split, &self.device)?;
        let _grads = scope(self.comm.observer(), Kind::Gradients, Place::Device);
        let mut grads = self.grads.lock().unwrap_or_else(|e| e.into_inner());
        add_grad(&mut grads, &block.var, mean)
    }
}

impl WeightSource for Peers {
    fn device(&self) -> &Device {
        &self.device
    }
    fn fetch_weight(&self, dtype: DType) -> Result<Tensor> {
        self.gather(&self.weight, dtype)
    }
    fn has_bias(&self) -> bool {
        self.bias.is_some()
    }
    fn fetch_bias(&self, dtype: DType) -> Result<Option<Tensor>> {
        self.bias
            .as_ref()
            .map(|b| self.gather(b, dtype))
            .transpose()
    }
    fn give_gradients(&self, weight: Tensor, bias: Option<Tensor>) -> Result<()> {
        self.scatter(&self.weight, &weight)?;
        if let (Some(b), Some(g)) = (&self.bias, bias) {
            self.scatter(b, &g)?;
        }
        Ok(())
    }
}

/// A linear layer under ZeRO stage 3: each rank keeps a `1/N` block of its
/// weight and bias (in f32: the master weights); its forward all-gathers
/// them, computes and drops them; its backward all-gathers the weight
/// again and reduce-scatters the weight gradients, each rank keeping the
/// mean over the ranks of its block ([`take_grads`](Self::take_grads)).
/// The blocks are ordinary variables ([`vars`](Self::vars)): any optimizer
/// updates them (`candle_lean_optim::LeanAdamW`, or
/// `candle_offload::HostAdamW` for ZeRO-Offload), and no all-gather
/// follows the step.
///
/// This is `candle_offload::StreamedLinear` with the peers in place of the
/// host: the same [`fetched_linear`]. Every rank must run the same layers
/// in the same order.
#[derive(Clone)]
pub struct ShardedLinear {
    peers: Arc<Peers>,
    anchor: Var,
}

impl std::fmt::Debug for ShardedLinear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedLinear")
            .field("weight", &self.peers.weight.shape)
            .field("bias", &self.peers.bias.is_some())
            .field("rank", &self.peers.comm.rank())
            .finish()
    }
}

impl ShardedLinear {
    /// A layer computing on `device`, partitioned from `weight` `(out, in)`
    /// and `bias` `(out,)`, which must be equal on every rank; this rank
    /// keeps its block of each.
    pub fn new(
        comm: Arc<Comm>,
        weight: &Tensor,
        bias: Option<&Tensor>,
        device: &Device,
    ) -> Result<Self> {
        if weight.rank() != 2 {
            bail!(
                "the weight must be (out, in), got shape {:?}",
                weight.dims()
            );
        }
        if let Some(b) = bias {
            if b.dims() != [weight.dim(0)?] {
                bail!(
                    "the bias has shape {:?}, the weight {:?}",
                    b.dims(),
                    weight.dims()
                );
            }
        }
        let block = |t: &Tensor| Block::new(&comm, t, device).map(Arc::new);
        let (weight, bias) = (block(weight)?, bias.map(block).transpose()?);
        Ok(Self {
            peers: Arc::new(Peers {
                comm: Arc::clone(&comm),
                weight,
                bias,
                device: device.clone(),
                grads: Mutex::new(GradStore::default()),
            }),
            anchor: Var::zeros(1, DType::F32, device)?,
        })
    }

    /// This rank's blocks: the weight's, then the bias's if any.
    pub fn vars(&self) -> Vec<Var> {
        std::iter::once(self.peers.weight.var.clone())
            .chain(self.peers.bias.as_ref().map(|b| b.var.clone()))
            .collect()
    }

    /// The gradient blocks reduced since the last call (means over the
    /// ranks, summed over backward passes), keyed by [`vars`](Self::vars).
    pub fn take_grads(&self) -> GradStore {
        let mut grads = self.peers.grads.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::take(&mut *grads)
    }

    /// Moves the gradient blocks reduced since the last call into `store`
    /// (one store for a whole model's layers, for its optimizer).
    pub fn take_grads_into(&self, store: &mut GradStore) {
        let mut mine = self.take_grads();
        for var in self.vars() {
            if let Some(g) = mine.remove(var.as_tensor()) {
                store.insert(var.as_tensor(), g);
            }
        }
    }

    /// The weight as a [`ShardedParam`]: this layer's block of it, to
    /// gather and reduce by hand (a backward written out, with no graph).
    /// Its gradients go to the optimizer from there, not through
    /// [`take_grads`](Self::take_grads).
    pub fn weight_param(&self) -> ShardedParam {
        ShardedParam::of_block(
            Arc::clone(&self.peers.comm),
            Arc::clone(&self.peers.weight),
            &self.peers.device,
        )
    }

    /// The bias as a [`ShardedParam`], as [`weight_param`](Self::weight_param).
    pub fn bias_param(&self) -> Option<ShardedParam> {
        self.peers.bias.as_ref().map(|b| {
            ShardedParam::of_block(
                Arc::clone(&self.peers.comm),
                Arc::clone(b),
                &self.peers.device,
            )
        })
    }

    /// The whole weight, all-gathered (for checking; it costs a gather).
    pub fn gather_weight(&self) -> Result<Tensor> {
        self.peers.gather(&self.peers.weight, DType::F32)
    }

    /// The whole bias, all-gathered.
    pub fn gather_bias(&self) -> Result<Option<Tensor>> {
        self.peers.fetch_bias(DType::F32)
    }

    /// `act(x W^T + b)`, the activation fused as `candle_lean_nn`'s
    /// `LeanLinear` fuses it (the graph keeps the input and, for GELU, the
    /// activation's input).
    pub fn forward_act(&self, x: &Tensor, act: Activation) -> Result<Tensor> {
        fetched_linear_act(x, &self.peers, &self.anchor, act)
    }

    /// Parameters of the whole layer, weight and bias.
    pub fn param_count(&self) -> usize {
        self.peers.weight.shape.elem_count()
            + self.peers.bias.as_ref().map_or(0, |b| b.shape.elem_count())
    }

    /// The bytes of this rank's blocks.
    pub fn bytes(&self) -> u64 {
        self.vars()
            .iter()
            .map(|v| (v.elem_count() * 4) as u64)
            .sum()
    }
}

impl Module for ShardedLinear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        fetched_linear(x, &self.peers, &self.anchor)
    }
}
