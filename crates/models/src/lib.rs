//! The models and helpers the built-in cells experiment on: seeded tensors,
//! layers that initialise like PyTorch's, an MLP, gradient utilities, and
//! chapter 3's GPT ([`gpt`], with its direct backward) and the sequences it
//! learns ([`corpus`]).
//! (The techniques themselves are the toolkit's crates, which take any
//! candle model.)
//!
//! candle's CPU random generator cannot be seeded, so everything random here
//! comes from a seeded [`Rng`]: the same seed gives the same model and data on
//! every run and every device.
#![warn(missing_docs)]

pub mod corpus;
pub mod gpt;
pub mod llama;
pub mod taped;

pub use gpt::{
    AttentionKind, DirectSaved, DirectStage, Gpt, GptConfig, GptLayer, Recipe, StepFields,
};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Result, Shape, Tensor, Var};
use candle_custom_grad::{DirectBackward, DirectGrads};
use candle_lean_nn::{LeanLayer, LeanLinear};
use rand::{Rng as _, SeedableRng};
use rand_distr::{Distribution, StandardNormal};

use workbook_sdk::Category;

/// A seeded random generator for weights and data.
#[derive(Debug, Clone)]
pub struct Rng(rand::rngs::StdRng);

impl Rng {
    /// A generator seeded with `seed`.
    pub fn seeded(seed: u64) -> Self {
        Self(rand::rngs::StdRng::seed_from_u64(seed))
    }

    /// An f32 tensor of standard normal values.
    pub fn randn(&mut self, shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        let shape = shape.into();
        let data: Vec<f32> = (0..shape.elem_count())
            .map(|_| StandardNormal.sample(&mut self.0))
            .collect();
        Tensor::from_vec(data, shape, device)
    }

    /// An f32 tensor of values uniform in `[low, high)`.
    pub fn uniform(
        &mut self,
        shape: impl Into<Shape>,
        low: f32,
        high: f32,
        device: &Device,
    ) -> Result<Tensor> {
        let shape = shape.into();
        let data: Vec<f32> = (0..shape.elem_count())
            .map(|_| self.0.random_range(low..high))
            .collect();
        Tensor::from_vec(data, shape, device)
    }

    /// A u32 tensor of `n` class labels in `[0, classes)`.
    pub fn labels(&mut self, n: usize, classes: u32, device: &Device) -> Result<Tensor> {
        let data: Vec<u32> = (0..n).map(|_| self.0.random_range(0..classes)).collect();
        Tensor::from_vec(data, n, device)
    }
}

/// A fully connected layer, `y = x W^T + b`, initialised like PyTorch's
/// `nn.Linear`: weight and bias uniform in `±1/sqrt(in)`.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Var,
    bias: Var,
}

impl Linear {
    /// A layer from `input` to `output` features, its parameters in `dtype`.
    /// Its allocations are tagged [`Category::Parameters`].
    pub fn new(
        rng: &mut Rng,
        input: usize,
        output: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let _params = Category::Parameters.enter();
        let bound = 1.0 / (input as f32).sqrt();
        let weight = rng.uniform((output, input), -bound, bound, device)?;
        let bias = rng.uniform(output, -bound, bound, device)?;
        Ok(Self {
            weight: Var::from_tensor(&weight.to_dtype(dtype)?)?,
            bias: Var::from_tensor(&bias.to_dtype(dtype)?)?,
        })
    }

    /// The forward in `dtype`: parameters and input are cast first. The cast
    /// is differentiable, so f32 master weights get f32 gradients while the
    /// matrix product and the saved activations are in `dtype` (mixed
    /// precision). With the parameters' own dtype this is `forward`.
    pub fn forward_as(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        let w = self.weight.to_dtype(dtype)?;
        let b = self.bias.to_dtype(dtype)?;
        x.to_dtype(dtype)?
            .broadcast_matmul(&w.t()?)?
            .broadcast_add(&b)
    }

    /// The weight, `(output, input)`.
    pub fn weight(&self) -> &Var {
        &self.weight
    }

    /// The bias, `(output,)`.
    pub fn bias(&self) -> &Var {
        &self.bias
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.broadcast_matmul(&self.weight.t()?)?
            .broadcast_add(&self.bias)
    }
}

/// An element-wise activation, a chapter parameter (`"identity"`,
/// `"relu"`, `"gelu"`): the toolkit's, which its fused layers take.
pub use candle_lean_nn::Activation;

/// A layer of an [`Mlp`].
#[derive(Debug, Clone)]
pub enum Layer {
    /// A linear layer.
    Linear(Linear),
    /// An activation.
    Activation(Activation),
}

impl Module for Layer {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Layer::Linear(l) => l.forward(x),
            Layer::Activation(a) => a.forward(x),
        }
    }
}

impl Layer {
    /// The forward in `dtype`; see [`Linear::forward_as`].
    pub fn forward_as(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        match self {
            Layer::Linear(l) => l.forward_as(x, dtype),
            Layer::Activation(a) => a.forward(&x.to_dtype(dtype)?),
        }
    }

    /// The trainable variables of this layer.
    pub fn vars(&self) -> Vec<Var> {
        match self {
            Layer::Linear(l) => vec![l.weight.clone(), l.bias.clone()],
            Layer::Activation(_) => Vec::new(),
        }
    }
}

/// A multi-layer perceptron: linear layers of the given widths with an
/// activation between them (none after the last).
///
/// ```
/// use workbook_models::{Activation, Mlp, Rng};
/// use candle_core::{DType, Device};
/// // The PyTorch notebook's "small" model: Linear(128,128) ReLU Linear(128,10).
/// let mlp = Mlp::new(&mut Rng::seeded(0), &[128, 128, 10], Activation::Relu, DType::F32, &Device::Cpu)?;
/// assert_eq!(mlp.param_count(), 17_802);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Mlp {
    layers: Vec<Layer>,
}

impl Mlp {
    /// Builds the MLP `widths[0] -> widths[1] -> ... -> widths[n]`.
    pub fn new(
        rng: &mut Rng,
        widths: &[usize],
        activation: Activation,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let mut layers = Vec::new();
        for (i, pair) in widths.windows(2).enumerate() {
            if i > 0 {
                layers.push(Layer::Activation(activation));
            }
            layers.push(Layer::Linear(Linear::new(
                rng, pair[0], pair[1], dtype, device,
            )?));
        }
        Ok(Self { layers })
    }

    /// A stack of `depth` blocks of `Linear(width, width)` + activation,
    /// the deep model of the checkpointing and accumulation sweeps.
    pub fn stack(
        rng: &mut Rng,
        width: usize,
        depth: usize,
        activation: Activation,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let mut layers = Vec::new();
        for _ in 0..depth {
            layers.push(Layer::Linear(Linear::new(
                rng, width, width, dtype, device,
            )?));
            layers.push(Layer::Activation(activation));
        }
        Ok(Self { layers })
    }

    /// A copy with variables of its own (same values, separate storage).
    pub fn deep_clone(&self) -> Result<Self> {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(match l {
                    // `Var::from_tensor` of a variable returns that same
                    // variable; detached, it is copied into a new one.
                    Layer::Linear(lin) => Layer::Linear(Linear {
                        weight: Var::from_tensor(&lin.weight.as_tensor().detach())?,
                        bias: Var::from_tensor(&lin.bias.as_tensor().detach())?,
                    }),
                    Layer::Activation(a) => Layer::Activation(*a),
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self { layers })
    }
    /// The model as the toolkit's fused layers (`candle-lean-nn`): each
    /// Linear and the activation after it as one operation that keeps its
    /// output (and GELU's input), on the same variables. A layer list for
    /// drivers such as `candle_checkpoint::Sequential::lean`.
    pub fn fused_layers(&self) -> Result<Vec<FusedLayer>> {
        self.fused(None)
    }

    /// [`Mlp::fused_layers`] computing in `dtype`: each takes its weight and
    /// bias cast to `dtype`, a cast that is differentiable, so f32 master
    /// weights get f32 gradients while the products and what the layers keep
    /// are in `dtype` (mixed precision, as [`Mlp::forward_as`]).
    pub fn fused_layers_as(&self, dtype: DType) -> Result<Vec<FusedLayer>> {
        self.fused(Some(dtype))
    }

    fn fused(&self, dtype: Option<DType>) -> Result<Vec<FusedLayer>> {
        let cast = |v: &Var| match dtype {
            Some(d) => v.to_dtype(d),
            None => Ok(v.as_tensor().clone()),
        };
        let mut layers = Vec::new();
        let mut it = self.layers.iter().peekable();
        while let Some(layer) = it.next() {
            match layer {
                Layer::Linear(l) => {
                    // The activation after a Linear is fused into it.
                    let act = match it.peek() {
                        Some(Layer::Activation(a)) => {
                            let a = *a;
                            it.next();
                            a
                        }
                        _ => Activation::Identity,
                    };
                    let linear = LeanLinear::new(cast(l.weight())?, Some(cast(l.bias())?))?;
                    layers.push(FusedLayer::Linear(LeanLayer::new(linear, act)));
                }
                Layer::Activation(a) => layers.push(FusedLayer::Activation(*a)),
            }
        }
        Ok(layers)
    }

    /// The forward through [`Mlp::fused_layers`]. Gradients equal
    /// [`Module::forward`]'s, but at a ReLU input of exactly 0 (see
    /// `candle_lean_nn::Activation::Relu`).
    pub fn forward_fused(&self, x: &Tensor) -> Result<Tensor> {
        self.fused_layers()?
            .iter()
            .try_fold(x.clone(), |h, l| l.forward(&h))
    }

    /// The forward through [`Mlp::fused_layers_as`], the input cast to
    /// `dtype` first.
    pub fn forward_fused_as(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        self.fused_layers_as(dtype)?
            .iter()
            .try_fold(x.to_dtype(dtype)?, |h, l| l.forward(&h))
    }

    /// The forward in `dtype` (mixed precision); see [`Linear::forward_as`].
    pub fn forward_as(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        self.layers
            .iter()
            .try_fold(x.clone(), |h, l| l.forward_as(&h, dtype))
    }

    /// The layers, in order.
    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }

    /// All trainable variables, in layer order.
    pub fn vars(&self) -> Vec<Var> {
        self.layers.iter().flat_map(Layer::vars).collect()
    }

    /// The number of trainable elements.
    pub fn param_count(&self) -> usize {
        self.vars().iter().map(|v| v.elem_count()).sum()
    }
}

/// One layer of [`Mlp::fused_layers`].
#[derive(Debug, Clone)]
pub enum FusedLayer {
    /// A Linear and the activation after it, as one operation.
    Linear(LeanLayer),
    /// An activation no Linear comes before.
    Activation(Activation),
}

impl Module for FusedLayer {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            FusedLayer::Linear(l) => l.forward(x),
            FusedLayer::Activation(a) => a.forward(x),
        }
    }
}

impl DirectBackward for FusedLayer {
    /// GELU's input, or a ReLU's output.
    type Saved = candle_lean_nn::Kept;

    fn forward_saved(&self, x: &Tensor) -> Result<(Tensor, Self::Saved)> {
        match self {
            FusedLayer::Linear(l) => l.forward_saved(x),
            FusedLayer::Activation(a) => candle_core::bail!(
                "a {a:?} with no Linear before it has no direct backward: run it under a lean backward (Sequential::lean)"
            ),
        }
    }

    fn backward_saved(
        &self,
        x: &Tensor,
        kept: Self::Saved,
        grad: Tensor,
        want_input: bool,
    ) -> Result<DirectGrads> {
        let FusedLayer::Linear(l) = self else {
            candle_core::bail!("an activation with no Linear before it has no direct backward");
        };
        l.backward_saved(x, kept, grad, want_input)
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.layers.iter().try_fold(x.clone(), |h, l| l.forward(&h))
    }
}

/// Mean cross-entropy of `logits` (batch, classes) against u32 `targets`,
/// computed in f32 whatever the logits' dtype.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    candle_nn::loss::cross_entropy(&logits.to_dtype(DType::F32)?, targets)
}

/// Keeps only the gradients of `vars`, detached.
///
/// candle's `GradStore` holds a gradient for every node of the graph, and each
/// entry still references the forward graph (its activations) until detached.
/// Keeping the store alive keeps all of that alive; this keeps what an
/// optimizer needs.
pub fn param_grads(grads: &GradStore, vars: &[Var]) -> GradStore {
    let mut out = GradStore::default();
    for var in vars {
        if let Some(g) = grads.get(var.as_tensor()) {
            out.insert(var.as_tensor(), g.detach());
        }
    }
    out
}

/// Largest absolute element-wise difference of two tensors of one shape, in
/// f64. They may be on different devices (a gradient offloaded to the host
/// against one kept on the GPU): `b` is compared on `a`'s.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    let b = b.to_device(a.device())?;
    let d = (a.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?;
    d.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()
}

/// Largest absolute difference between two stores' gradients of `vars`.
/// A gradient present in one store and missing from the other is an error.
pub fn grads_max_abs_diff(a: &GradStore, b: &GradStore, vars: &[Var]) -> Result<f64> {
    let mut worst = 0f64;
    for (i, var) in vars.iter().enumerate() {
        match (a.get(var.as_tensor()), b.get(var.as_tensor())) {
            (Some(x), Some(y)) => worst = worst.max(max_abs_diff(x, y)?),
            (None, None) => {}
            _ => candle_core::bail!("the gradient of variable {i} is missing from one store"),
        }
    }
    Ok(worst)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deep_clone_has_storage_of_its_own() {
        let dev = Device::Cpu;
        let a = Mlp::new(
            &mut Rng::seeded(1),
            &[3, 4, 2],
            Activation::Relu,
            DType::F32,
            &dev,
        )
        .unwrap();
        let b = a.deep_clone().unwrap();
        let (wa, wb) = (&a.vars()[0], &b.vars()[0]);
        assert_eq!(max_abs_diff(wa.as_tensor(), wb.as_tensor()).unwrap(), 0.0);
        wb.set(&wb.as_tensor().ones_like().unwrap()).unwrap();
        assert!(
            max_abs_diff(wa.as_tensor(), wb.as_tensor()).unwrap() > 0.0,
            "setting the copy left the original alone"
        );
        assert_ne!(wa.as_tensor().id(), wb.as_tensor().id());
    }

    #[test]
    fn param_counts_of_the_notebook_models() {
        let dev = Device::Cpu;
        let mut rng = Rng::seeded(0);
        let count = |w: &[usize], rng: &mut Rng| {
            Mlp::new(rng, w, Activation::Relu, DType::F32, &dev)
                .unwrap()
                .param_count()
        };
        assert_eq!(count(&[128, 128, 10], &mut rng), 17_802);
        assert_eq!(count(&[128, 512, 512, 10], &mut rng), 333_834);
    }

    /// The fused layers' direct backward gives candle-nn's gradients, and
    /// the mixed-precision layers compute in their dtype; an activation
    /// with no Linear before it says it has no direct backward.
    #[test]
    fn fused_layers_direct_backward_and_its_limit() {
        let dev = Device::Cpu;
        let mut rng = Rng::seeded(3);
        let mlp = Mlp::new(
            &mut rng,
            &[8, 16, 16, 4],
            Activation::Gelu,
            DType::F32,
            &dev,
        )
        .unwrap();
        let x = rng.randn((5, 8), &dev).unwrap();
        let y = rng.labels(5, 4, &dev).unwrap();
        let vars = mlp.vars();
        let plain = param_grads(
            &cross_entropy(&mlp.forward(&x).unwrap(), &y)
                .unwrap()
                .backward()
                .unwrap(),
            &vars,
        );
        let layers = mlp.fused_layers().unwrap();
        let mut direct = GradStore::default();
        let head = |h: &Tensor| candle_lean_nn::cross_entropy_and_grad(h, &y, 1.0);
        let mut saved = Vec::new();
        let mut h = x.clone();
        for layer in &layers {
            let (o, kept) = layer.forward_saved(&h).unwrap();
            saved.push((h, kept));
            h = o;
        }
        let (_, mut g) = head(&h).unwrap();
        for (layer, (x, kept)) in layers.iter().zip(saved).rev() {
            let step = layer.backward_saved(&x, kept, g, true).unwrap();
            for (p, d) in step.params {
                direct.insert(&p, d);
            }
            g = step.input.unwrap();
        }
        assert!(grads_max_abs_diff(&plain, &direct, &vars).unwrap() < 1e-6);

        let half = mlp.forward_fused_as(&x, DType::BF16).unwrap();
        assert_eq!(half.dtype(), DType::BF16);
        let bare = FusedLayer::Activation(Activation::Relu);
        let e = bare.forward_saved(&x).unwrap_err().to_string();
        assert!(
            e.starts_with("a Relu with no Linear before it has no direct backward"),
            "{e}"
        );
    }
}
