//! Data parallelism: every rank holds the whole model and averages its
//! gradients with the others'.

use std::sync::Arc;

use candle_checkpoint::add_grad;
use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Tensor, Var};
use candle_observe::{scope, Kind, Place};

use crate::split::flat_f32;
use crate::Comm;

/// PyTorch's default bucket size for DistributedDataParallel.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// DistributedDataParallel's gradient averaging: each rank computes the
/// gradients of its shard of the batch, then [`average`](Self::average)
/// all-reduces them in buckets of about `bucket_bytes` (last variables
/// first, the order a backward produces them), so that every rank steps
/// with the gradient of the whole batch.
///
/// With a loss that is a mean over equal shards, the result equals one
/// process's gradient of the whole batch (up to the order of the sums).
#[derive(Debug)]
pub struct DataParallel {
    comm: Arc<Comm>,
    vars: Vec<Var>,
    bucket_bytes: usize,
}

impl DataParallel {
    /// Averages the gradients of `vars` over `comm`'s ranks.
    pub fn new(comm: Arc<Comm>, vars: Vec<Var>) -> Self {
        Self {
            comm,
            vars,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
        }
    }

    /// All-reduces in buckets of about `bytes` (a variable larger than a
    /// bucket goes alone).
    pub fn with_bucket_bytes(mut self, bytes: usize) -> Self {
        self.bucket_bytes = bytes.max(1);
        self
    }

    /// The variables, in order.
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// Gives every rank rank 0's parameters (as DDP does at construction).
    pub fn broadcast_parameters(&self) -> Result<()> {
        for var in &self.vars {
            let mut buf = flat_f32(&self.comm, var.as_tensor(), var.elem_count())?;
            self.comm.broadcast(&mut buf, 0)?;
            let t = Tensor::from_slice(&buf, var.shape(), var.device())?.to_dtype(var.dtype())?;
            var.set(&t)?;
        }
        Ok(())
    }

    /// The buckets: runs of variables, last first, of at most `bucket_bytes`
    /// in f32 unless a single variable is larger.
    fn buckets(&self) -> Vec<Vec<&Var>> {
        let mut buckets: Vec<Vec<&Var>> = Vec::new();
        let mut bytes = 0;
        for var in self.vars.iter().rev() {
            let size = var.elem_count() * 4;
            match buckets.last_mut() {
                Some(b) if bytes + size <= self.bucket_bytes => {
                    b.push(var);
                    bytes += size;
                }
                _ => {
                    buckets.push(vec![var]);
                    bytes = size;
                }
            }
        }
        buckets
    }

    /// Replaces each variable's gradient in `grads` with its mean over the
    /// ranks. Every rank must have a gradient for the same variables.
    pub fn average(&self, grads: &mut GradStore) -> Result<()> {
        for bucket in self.buckets() {
            let present: Vec<(&Var, Tensor)> = bucket
                .into_iter()
                .filter_map(|v| grads.remove(v.as_tensor()).map(|g| (v, g)))
                .collect();
            for (var, mean) in self.reduce(present)? {
                grads.insert(var.as_tensor(), mean);
            }
        }
        Ok(())
    }

    /// Averaging as the backward goes: hand each gradient to
    /// [`Bucketing::push`] as a layer-wise backward produces it
    /// (`candle_checkpoint::Sequential::lean_with`), and a bucket is
    /// all-reduced as soon as it holds `bucket_bytes` or more (the one that
    /// crosses the threshold included), at the points where DDP's hooks
    /// launch theirs; here the all-reduce blocks the backward rather than
    /// overlapping it. [`Bucketing::finish`] reduces the last bucket and
    /// returns the means.
    pub fn bucketing(&self) -> Bucketing<'_> {
        Bucketing {
            ddp: self,
            pending: Vec::new(),
            bytes: 0,
            done: GradStore::default(),
        }
    }

    /// One bucket's all-reduce: the gradients' means, in order, each
    /// gradient freed as its mean is made (the bucket is taken by value, so
    /// nothing else holds them).
    fn reduce<V>(&self, bucket: Vec<(V, Tensor)>) -> Result<Vec<(V, Tensor)>> {
        if bucket.is_empty() {
            return Ok(Vec::new());
        }
        let scale = 1.0 / self.comm.size() as f32;
        let total: usize = bucket.iter().map(|(_, g)| g.elem_count()).sum();
        let mut buf = self.comm.buffer(total);
        let mut at = 0;
        for (_, g) in &bucket {
            let n = g.elem_count();
            let values = flat_f32(&self.comm, g, n)?;
            buf[at..at + n].copy_from_slice(&values);
            at += n;
        }
        self.comm.all_reduce_sum(&mut buf)?;
        let mut at = 0;
        let mut out = Vec::with_capacity(bucket.len());
        for (var, g) in bucket {
            let n = g.elem_count();
            let _grads = scope(self.comm.observer(), Kind::Gradients, Place::Device);
            let mean: Vec<f32> = buf[at..at + n].iter().map(|x| x * scale).collect();
            let t = Tensor::from_vec(mean, g.shape(), g.device())?;
            let t = if g.dtype() == DType::F32 {
                t
            } else {
                t.to_dtype(g.dtype())?
            };
            drop(g);
            out.push((var, t));
            at += n;
        }
        Ok(out)
    }
}

/// Gradients averaged a bucket at a time during a backward: see
/// [`DataParallel::bucketing`]. Every rank must push the same variables in
/// the same order.
pub struct Bucketing<'a> {
    ddp: &'a DataParallel,
    pending: Vec<(Var, Tensor)>,
    bytes: usize,
    done: GradStore,
}

impl std::fmt::Debug for Bucketing<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bucketing")
            .field("pending", &self.pending.len())
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl Bucketing<'_> {
    /// Takes `var`'s gradient on this rank; all-reduces the bucket once it
    /// holds `bucket_bytes` or more (in f32).
    pub fn push(&mut self, var: &Var, grad: Tensor) -> Result<()> {
        self.bytes += grad.elem_count() * 4;
        self.pending.push((var.clone(), grad));
        if self.bytes >= self.ddp.bucket_bytes {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        let pending = std::mem::take(&mut self.pending);
        self.bytes = 0;
        if pending.is_empty() {
            return Ok(());
        }
        for (var, mean) in self.ddp.reduce(pending)? {
            // A variable used twice is handed over twice: sum.
            add_grad(&mut self.done, &var, mean)?;
        }
        Ok(())
    }

    /// Reduces what is left and returns every gradient's mean over the
    /// ranks.
    pub fn finish(mut self) -> Result<GradStore> {
        self.flush()?;
        Ok(std::mem::take(&mut self.done))
    }
}
