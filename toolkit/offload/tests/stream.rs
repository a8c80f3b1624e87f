//! StreamedLinear against resident candle-nn layers: outputs, input and
//! weight gradients, copies, and bad input.

use candle_core::{DType, Device, Module, Result, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use candle_offload::StreamedLinear;

fn max_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    (a.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f64>()
}

/// Three Linear + GELU layers, resident and streamed, on a 3-d input: the
/// same output and the same gradients for the input and every weight.
#[test]
fn streamed_stack_equals_the_resident_one() -> Result<()> {
    let dev = Device::Cpu;
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &dev);
    let resident: Vec<candle_nn::Linear> = (0..3)
        .map(|i| candle_nn::linear(8, 8, vb.pp(i)))
        .collect::<Result<_>>()?;
    let streamed: Vec<StreamedLinear> = resident
        .iter()
        .map(StreamedLinear::from_linear)
        .collect::<Result<_>>()?;
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (2, 5, 8), &dev)?)?;
    let run = |layers: &[&dyn Module]| -> Result<Tensor> {
        layers
            .iter()
            .try_fold(x.as_tensor().clone(), |h, l| l.forward(&h)?.gelu())
    };
    let a = run(&resident
        .iter()
        .map(|l| l as &dyn Module)
        .collect::<Vec<_>>())?;
    let b = run(&streamed
        .iter()
        .map(|l| l as &dyn Module)
        .collect::<Vec<_>>())?;
    assert_eq!(max_diff(&a, &b)?, 0.0);
    let ga = a.sqr()?.sum_all()?.backward()?;
    let gb = b.sqr()?.sum_all()?.backward()?;
    assert!(max_diff(ga.get(&x).unwrap(), gb.get(&x).unwrap())? < 1e-6);
    for (r, s) in resident.iter().zip(&streamed) {
        let host = s.take_grads();
        let vars = s.vars();
        assert!(max_diff(ga.get(r.weight()).unwrap(), host.get(&vars[0]).unwrap())? < 1e-5);
        let bias = r.bias().expect("candle_nn::linear has a bias");
        assert!(max_diff(ga.get(bias).unwrap(), host.get(&vars[1]).unwrap())? < 1e-5);
        assert!(s.take_grads().get(&vars[0]).is_none(), "taken once");
    }
    Ok(())
}

/// The first layer's input is plain data, which candle does not track: the
/// weights still get their gradients.
#[test]
fn weights_get_gradients_when_the_input_needs_none() -> Result<()> {
    let dev = Device::Cpu;
    let w = Var::new(&[[2f32, 0.0], [0.0, 3.0]], &dev)?;
    let layer = StreamedLinear::new(w, None, &dev)?;
    let x = Tensor::new(&[[1f32, 2.0]], &dev)?;
    layer.forward(&x)?.sum_all()?.backward()?;
    let g = layer.take_grads();
    let host_w = &layer.vars()[0];
    assert_eq!(
        g.get(host_w).unwrap().to_vec2::<f32>()?,
        [[1.0, 2.0], [1.0, 2.0]]
    );
    Ok(())
}

/// Each forward and each backward copies the weights to the device; each
/// backward copies their gradients to the host.
#[test]
fn copies_are_counted_twice_per_step() -> Result<()> {
    let dev = Device::Cpu;
    let w = Var::from_tensor(&Tensor::ones((4, 3), DType::F32, &dev)?)?;
    let b = Var::from_tensor(&Tensor::ones(4, DType::F32, &dev)?)?;
    let layer = StreamedLinear::new(w, Some(b), &dev)?;
    let bytes = layer.bytes();
    assert_eq!(bytes, (12 + 4) * 4);
    let x = Var::from_tensor(&Tensor::ones((2, 3), DType::F32, &dev)?)?;
    let before = layer.transfers();
    layer.forward(&x)?.sum_all()?.backward()?;
    let t = layer.transfers().since(&before);
    // The weight and bias for the forward, the weight again for the backward.
    assert_eq!(t.to_device_bytes, bytes + 12 * 4);
    assert_eq!(t.to_host_bytes, bytes);
    Ok(())
}

#[test]
fn bad_shapes_are_refused() -> Result<()> {
    let dev = Device::Cpu;
    let w = Var::zeros((4, 3), DType::F32, &dev)?;
    let err = |r: Result<StreamedLinear>| r.unwrap_err().to_string();
    let bad_bias = Some(Var::zeros(3, DType::F32, &dev)?);
    assert!(err(StreamedLinear::new(w.clone(), bad_bias, &dev))
        .starts_with("the bias has shape [3], the weight [4, 3]"));
    assert!(err(StreamedLinear::new(
        Var::zeros(4, DType::F32, &dev)?,
        None,
        &dev
    ))
    .starts_with("the weight must be (out, in), got shape [4]"));
    let layer = StreamedLinear::new(w, None, &dev)?;
    assert!(layer
        .forward(&Tensor::zeros((2, 5), DType::F32, &dev)?)
        .is_err());
    Ok(())
}

/// With f16 compute the weights cross in f16: half the bytes of their f32
/// host copies.
#[test]
fn half_precision_compute_fetches_half_the_bytes() -> Result<()> {
    let dev = Device::Cpu;
    let w = Var::from_tensor(&Tensor::ones((4, 3), DType::F32, &dev)?)?;
    let layer = StreamedLinear::new(w, None, &dev)?;
    let before = layer.transfers();
    let x = Tensor::ones((2, 3), DType::F16, &dev)?;
    let y = layer.forward(&x)?;
    assert_eq!(y.dtype(), DType::F16);
    assert_eq!(layer.transfers().since(&before).to_device_bytes, 12 * 2);
    Ok(())
}
