//! The head and the cross-entropy as one operation over row chunks, never
//! holding the whole logits.

use crate::accumulation;
use crate::indices::Indices;
use candle_core::{bail, DType, Result, Tensor};
use candle_custom_grad::{with_backward3, Backward3};

/// The mean cross-entropy of `hidden W^T` against class indices, computed
/// a chunk of rows at a time, so that no tensor the size of the whole
/// logits `(rows, classes)` ever exists: the fused linear cross-entropy of
/// Liger Kernel, and the memory argument of Cut Cross-Entropy (Wijmans et
/// al. 2024). At a real vocabulary the logits and their gradient are the
/// largest tensors of a decoder's step: 403 MB each for SmolLM2-135M at
/// batch 4 and 512 tokens.
///
/// [`LinearCrossEntropy::loss`] is one autograd operation over the hidden
/// states, the head's weight and the targets. Its graph keeps those three
/// and nothing else; its backward computes each chunk's logits again (one
/// more product of the head's size) and turns them into that chunk's
/// gradients. [`LinearCrossEntropy::loss_and_grads`] is the loss and both
/// gradients in one pass with no graph, for a driver that runs each layer's
/// backward itself.
///
/// The products run in the inputs' dtype and the softmax in f32 (f64 for
/// f64), as a plain head followed by [`crate::cross_entropy`] does. Each
/// chunk's part of the head's gradient comes out of its product in the
/// inputs' dtype; the parts are summed in f32 and the sum rounded once.
///
/// ```
/// use candle_core::{DType, Device, Tensor, Var};
/// use candle_lean_nn::LinearCrossEntropy;
/// let dev = Device::Cpu;
/// let hidden = Var::randn(0f32, 1.0, (6, 4), &dev)?;
/// let weight = Var::randn(0f32, 1.0, (10, 4), &dev)?;
/// let targets = Tensor::new(&[1u32, 9, 0, 3, 3, 7], &dev)?;
/// let fused = LinearCrossEntropy::new().chunk_rows(4).loss(&hidden, &weight, &targets)?;
/// let logits = hidden.matmul(&weight.t()?)?;
/// let plain = candle_nn::loss::cross_entropy(&logits, &targets)?;
/// let d = (fused.to_scalar::<f32>()? - plain.to_scalar::<f32>()?).abs();
/// assert!(d < 1e-5);
/// let (gf, gp) = (fused.backward()?, plain.backward()?);
/// let diff = (gf.get(&weight).unwrap() - gp.get(&weight).unwrap())?.abs()?.max_all()?;
/// assert!(diff.to_scalar::<f32>()? < 1e-5);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct LinearCrossEntropy {
    chunk_rows: Option<usize>,
}

/// A loss and the gradients of the hidden states and of the head's weight.
#[derive(Debug)]
pub struct LossGrads {
    /// The scaled mean loss, a scalar of the hidden states' dtype.
    pub loss: Tensor,
    /// The gradient of the hidden states, `(rows, hidden)`.
    pub hidden: Tensor,
    /// The gradient of the head's weight, `(classes, hidden)`: the
    /// transposed view of the `(hidden, classes)` tensor the chunks are
    /// summed into (`contiguous()` makes a copy where one is needed).
    pub weight: Tensor,
}

/// [`LinearCrossEntropy::loss`] with the default chunks.
pub fn linear_cross_entropy(hidden: &Tensor, weight: &Tensor, targets: &Tensor) -> Result<Tensor> {
    LinearCrossEntropy::new().loss(hidden, weight, targets)
}

impl LinearCrossEntropy {
    /// The fewest rows of a default chunk. Each chunk's products read the
    /// head's whole weight: a chunk of 8 rows, as Liger Kernel's rule gives
    /// at batch 2 x 256 tokens of a 49,152-token vocabulary, reads 113 MB
    /// for 8 rows' work, and on a CPU took twice the plain head's time.
    pub const MIN_ROWS: usize = 128;

    /// Chunks chosen so that one chunk's logits hold about as many numbers
    /// as the hidden states (Liger Kernel's rule), rounded up to a power of
    /// two, and of at least [`LinearCrossEntropy::MIN_ROWS`] rows.
    pub fn new() -> Self {
        Self::default()
    }

    /// Computes `rows` rows of logits at a time (at least 1).
    pub fn chunk_rows(mut self, rows: usize) -> Self {
        self.chunk_rows = Some(rows.max(1));
        self
    }

    /// The rows per chunk for `rows` hidden states of width `hidden` and
    /// `classes` classes.
    pub fn rows_per_chunk(&self, rows: usize, hidden: usize, classes: usize) -> usize {
        match self.chunk_rows {
            Some(n) => n.min(rows.max(1)),
            None => {
                let ratio = classes.div_ceil(hidden.max(1)).max(1);
                rows.div_ceil(ratio)
                    .max(1)
                    .next_power_of_two()
                    .max(Self::MIN_ROWS)
                    .min(rows.max(1))
            }
        }
    }

    /// The mean cross-entropy of `hidden W^T` (`hidden` `(rows, h)`, `weight`
    /// `(classes, h)`) against `targets` `(rows,)`, as one autograd
    /// operation that keeps only its inputs.
    pub fn loss(&self, hidden: &Tensor, weight: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let (shape, indices) = check(hidden, weight, targets)?;
        let chunk = self.rows_per_chunk(shape.rows, shape.hidden, shape.classes);
        let mut total = Tensor::new(0f64, hidden.device())?;
        for (start, n) in chunks(shape.rows, chunk) {
            let logits = hidden
                .narrow(0, start, n)?
                .detach()
                .matmul(&weight.detach().t()?)?;
            total = (total + indices.narrow(start, n)?.sum(&logits)?)?;
        }
        let loss = total
            .affine(1.0 / shape.rows as f64, 0.0)?
            .to_dtype(hidden.dtype())?;
        with_backward3(loss, [hidden, weight, targets], Fused { chunk })
    }

    /// `scale` times the mean loss and its gradients with respect to
    /// `hidden` and `weight`, in one pass over the chunks, with no graph.
    /// `scale` is 1 for the loss itself, or a micro-batch's share of the
    /// batch in gradient accumulation.
    pub fn loss_and_grads(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        targets: &Tensor,
        scale: f64,
    ) -> Result<LossGrads> {
        let (shape, indices) = check(hidden, weight, targets)?;
        let chunk = self.rows_per_chunk(shape.rows, shape.hidden, shape.classes);
        let (hidden, weight) = (hidden.detach(), weight.detach());
        let mut sum = Tensor::new(0f64, hidden.device())?;
        let grads = run_chunks(&hidden, &weight, &indices, chunk, scale, |logits, t| {
            sum = (&sum + t.sum(logits)?)?;
            Ok(())
        })?;
        let loss = sum
            .affine(scale / shape.rows as f64, 0.0)?
            .to_dtype(hidden.dtype())?;
        Ok(LossGrads {
            loss,
            hidden: grads.0,
            weight: grads.1,
        })
    }
}

struct Shape {
    rows: usize,
    hidden: usize,
    classes: usize,
}

/// The shapes, once the inputs are checked against each other, and the
/// targets checked against the classes.
fn check(hidden: &Tensor, weight: &Tensor, targets: &Tensor) -> Result<(Shape, Indices<'static>)> {
    let (rows, h) = hidden.dims2()?;
    let (classes, wh) = weight.dims2()?;
    if wh != h {
        bail!(
            "the head's weight has shape {:?} for hidden states {:?}: it must be (classes, {h})",
            weight.dims(),
            hidden.dims()
        );
    }
    if hidden.dtype() != weight.dtype() {
        bail!(
            "the hidden states are {:?} and the head's weight {:?}: give both one dtype",
            hidden.dtype(),
            weight.dtype()
        );
    }
    crate::loss::check_targets(targets, rows, "the hidden states", hidden.dims())?;
    if rows == 0 || classes == 0 {
        bail!("cross-entropy of {rows} rows of {classes} classes has no mean");
    }
    let shape = Shape {
        rows,
        hidden: h,
        classes,
    };
    Ok((shape, Indices::new(targets, classes)?))
}

/// `(start, len)` of each chunk of `chunk` rows.
fn chunks(rows: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..rows)
        .step_by(chunk)
        .map(move |start| (start, chunk.min(rows - start)))
}

/// Each chunk's logits made, handed to `each` with its indices, and turned
/// into the chunk's gradients: the hidden states' gradient `(rows, h)` and
/// the weight's `(classes, h)`, for the loss `scale` times the mean.
fn run_chunks(
    hidden: &Tensor,
    weight: &Tensor,
    indices: &Indices,
    chunk: usize,
    scale: f64,
    mut each: impl FnMut(&Tensor, &Indices) -> Result<()>,
) -> Result<(Tensor, Tensor)> {
    let rows = hidden.dim(0)?;
    let dtype = hidden.dtype();
    let acc = accumulation(dtype);
    let wt = weight.t()?;
    let mut dweight: Option<Tensor> = None;
    let mut dhidden = Vec::new();
    for (start, n) in chunks(rows, chunk) {
        let h = hidden.narrow(0, start, n)?;
        let t = indices.narrow(start, n)?;
        let logits = h.matmul(&wt)?;
        each(&logits, &t)?;
        let d = t.grad(&logits, scale / rows as f64)?;
        drop(logits);
        dhidden.push(d.matmul(weight)?);
        // The weight's gradient transposed, `h^T d` `(h, classes)`: its
        // product's left operand is the small one, so the matrix library
        // packs no copy of the chunk's gradient.
        let dw = h.t()?.matmul(&d)?.to_dtype(acc)?;
        dweight = Some(match dweight {
            None => dw,
            Some(sum) => crate::add::add_into(sum, &dw)?,
        });
    }
    let Some(dweight) = dweight else {
        bail!("internal: no chunk of rows");
    };
    Ok((Tensor::cat(&dhidden, 0)?, dweight.t()?.to_dtype(dtype)?))
}

struct Fused {
    chunk: usize,
}

impl Backward3 for Fused {
    fn backward(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        targets: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let upstream = grad.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let indices = Indices::new(targets, weight.dim(0)?)?;
        let (dh, dw) = run_chunks(
            hidden,
            weight,
            &indices,
            self.chunk,
            upstream,
            |_, _| Ok(()),
        )?;
        Ok((Some(dh), Some(dw), None))
    }
}
