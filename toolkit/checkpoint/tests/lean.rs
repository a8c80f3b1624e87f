//! The lean backward against candle's own: equal gradients, recomputation
//! only where candle's gradient of a layer's input could be incomplete.

use candle_checkpoint::Sequential;
use candle_core::{DType, Device, Module, Result, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use candle_observe::{Kind, Observer, Place, Token};

mod common;
use common::{max_diff, worst};

/// How many times activations were computed: the forward once, plus one
/// for each layer recomputed.
#[derive(Default)]
struct Forwards(std::cell::Cell<usize>);

impl Observer for Forwards {
    fn enter(&self, kind: Kind, _: Place) -> Token {
        if kind == Kind::Activations {
            self.0.set(self.0.get() + 1);
        }
        Token::default()
    }
}

/// Linear, then GELU: the input reaches a product with a weight first.
struct LinearGelu(candle_nn::Linear);
impl Module for LinearGelu {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.0.forward(x)?.gelu()
    }
}

/// GELU, then Linear: the GELU of the input has no graph in candle.
struct GeluLinear(candle_nn::Linear);
impl Module for GeluLinear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.0.forward(&x.gelu()?)
    }
}

/// `x + gelu(Linear(x))`: the input reaches the sum and the product.
struct Residual(candle_nn::Linear);
impl Module for Residual {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x + self.0.forward(x)?.gelu()?
    }
}

/// Runs `make`'s layers both ways: (largest gradient difference, input
/// gradient difference if the lean backward gave one, forwards counted).
fn compare<M: Module>(make: impl Fn(candle_nn::Linear) -> M) -> Result<(f64, Option<f64>, usize)> {
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    let layers: Vec<M> = (0..4)
        .map(|i| Ok(make(candle_nn::linear(6, 6, vb.pp(i))?)))
        .collect::<Result<_>>()?;
    let vars = map.all_vars();
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (5, 6), &Device::Cpu)?)?;
    let head = |h: &Tensor| h.sqr()?.mean_all();
    let plain = head(
        &layers
            .iter()
            .try_fold(x.as_tensor().clone(), |h, l| l.forward(&h))?,
    )?
    .backward()?;
    let forwards = Forwards::default();
    let lean =
        Sequential::new(&layers)
            .observer(&forwards)
            .lean(&x.as_detached_tensor(), &vars, head)?;
    let input = match &lean.input_grad {
        Some(gx) => Some(max_diff(gx, plain.get(x.as_tensor()).unwrap())?),
        None => None,
    };
    Ok((worst(&plain, &lean.grads, &vars)?, input, forwards.0.get()))
}

#[test]
fn layers_that_start_with_a_weight_are_not_recomputed() -> Result<()> {
    for (name, (grads, input, forwards)) in [
        ("linear+gelu", compare(LinearGelu)?),
        ("residual", compare(Residual)?),
    ] {
        assert_eq!(grads, 0.0, "{name}");
        assert_eq!(input, Some(0.0), "{name}");
        assert_eq!(forwards, 1, "{name}: the forward only");
    }
    Ok(())
}

#[test]
fn a_layer_that_computes_without_weights_first_is_rerun_for_its_input() -> Result<()> {
    let (grads, input, forwards) = compare(GeluLinear)?;
    // The parameters' gradients come from the one pass, exactly.
    assert_eq!(grads, 0.0);
    // The forward, then layers 3, 2 and 1 once more for their inputs'
    // gradients; the first layer's input gradient is not asked for.
    assert_eq!(forwards, 4);
    assert_eq!(input, None);
    Ok(())
}

/// Token ids into an embedding plus a plain position table, then Linear +
/// GELU: the table gets a gradient of its own, the ids cannot have one.
enum Layer {
    Embed(candle_nn::Embedding, Tensor),
    Dense(LinearGelu),
}

impl Module for Layer {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Layer::Embed(e, positions) => e.forward(x)?.broadcast_add(positions),
            Layer::Dense(d) => d.forward(x),
        }
    }
}

#[test]
fn token_ids_and_a_plain_position_table_first() -> Result<()> {
    let dev = Device::Cpu;
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &dev);
    let positions = Tensor::randn(0f32, 1.0, (5, 6), &dev)?;
    let layers = vec![
        Layer::Embed(candle_nn::embedding(11, 6, vb.pp("emb"))?, positions),
        Layer::Dense(LinearGelu(candle_nn::linear(6, 6, vb.pp("a"))?)),
        Layer::Dense(LinearGelu(candle_nn::linear(6, 6, vb.pp("b"))?)),
    ];
    let vars = map.all_vars();
    let ids = Tensor::new(&[1u32, 4, 4, 10, 0], &dev)?;
    let head = |h: &Tensor| h.sqr()?.mean_all();
    let plain = head(&layers.iter().try_fold(ids.clone(), |h, l| l.forward(&h))?)?.backward()?;
    let forwards = Forwards::default();
    let lean = Sequential::new(&layers)
        .observer(&forwards)
        .lean(&ids, &vars, head)?;
    assert_eq!(worst(&plain, &lean.grads, &vars)?, 0.0);
    assert!(lean.input_grad.is_none());
    assert_eq!(forwards.0.get(), 1, "nothing run twice");
    Ok(())
}

#[test]
fn misuse_is_an_error_that_says_why() -> Result<()> {
    let x = Tensor::ones((2, 3), DType::F32, &Device::Cpu)?;
    let none: [LinearGelu; 0] = [];
    let err = Sequential::new(&none)
        .lean(&x, &[], |h| h.sum_all())
        .expect_err("no layers")
        .to_string();
    assert!(
        err.starts_with("a lean backward needs at least one layer"),
        "{err}"
    );
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    let layers = [LinearGelu(candle_nn::linear(3, 3, vb)?)];
    let err = Sequential::new(&layers)
        .lean(&x, &map.all_vars(), |h| h.sqr())
        .expect_err("not a scalar")
        .to_string();
    assert!(
        err.starts_with("the head must return the scalar loss, got shape [2, 3]"),
        "{err}"
    );
    Ok(())
}
