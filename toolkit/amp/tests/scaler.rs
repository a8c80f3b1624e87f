//! The scaler's protocol, as torch.amp's, and the bugs of the old one: a
//! caller-supplied finite flag, no unscale tracking, `step` that also
//! updated, an f64 copy of every gradient.

use candle_amp::{GradScaler, MasterWeights, ScaleChange, ScalerConfig, ScalerState, StepOutcome};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, Var};
use candle_nn::{Optimizer, SGD};

fn setup() -> Result<(Var, SGD)> {
    let w = Var::new(&[1f32, 2.0, 3.0], &Device::Cpu)?;
    let sgd = SGD::new(vec![w.clone()], 1.0)?;
    Ok((w, sgd))
}

fn grads_of(scaler: &GradScaler, w: &Var, g: [f32; 3]) -> Result<GradStore> {
    let g = Tensor::new(&g, &Device::Cpu)?;
    scaler.scale(&(w.as_tensor() * g)?.sum_all()?)?.backward()
}

fn err<T: std::fmt::Debug>(r: Result<T>) -> String {
    r.expect_err("must fail").to_string()
}

#[test]
fn step_unscales_when_unscale_was_not_called() -> Result<()> {
    let (w, mut sgd) = setup()?;
    let mut s = GradScaler::new(ScalerConfig::default())?;
    let mut grads = grads_of(&s, &w, [0.5, -1.0, 2.0])?;
    assert_eq!(
        s.step(&mut sgd, &mut grads, std::slice::from_ref(&w))?,
        StepOutcome::Stepped
    );
    assert_eq!(w.to_vec1::<f32>()?, [0.5, 3.0, 1.0]);
    Ok(())
}

#[test]
fn unscale_then_step_divides_once() -> Result<()> {
    let (w, mut sgd) = setup()?;
    let mut s = GradScaler::new(ScalerConfig::default())?;
    let mut grads = grads_of(&s, &w, [0.5, -1.0, 2.0])?;
    assert!(!s.unscale(&mut grads, std::slice::from_ref(&w))?);
    assert_eq!(
        grads.get(w.as_tensor()).unwrap().to_vec1::<f32>()?,
        [0.5, -1.0, 2.0]
    );
    s.step(&mut sgd, &mut grads, std::slice::from_ref(&w))?;
    assert_eq!(w.to_vec1::<f32>()?, [0.5, 3.0, 1.0]);
    Ok(())
}

#[test]
fn misuse_is_an_error() -> Result<()> {
    let (w, mut sgd) = setup()?;
    let vars = [w.clone()];
    let mut s = GradScaler::new(ScalerConfig::default())?;
    assert!(err(s.update()).starts_with("update needs an inf check first"));
    let mut grads = grads_of(&s, &w, [1.0, 1.0, 1.0])?;
    s.unscale(&mut grads, &vars)?;
    assert!(err(s.unscale(&mut grads, &vars)).starts_with("unscale was already called"));
    s.step(&mut sgd, &mut grads, &vars)?;
    assert!(err(s.step(&mut sgd, &mut grads, &vars)).starts_with("step was already called"));
    s.update()?;
    assert!(err(s.update()).starts_with("update needs an inf check first"));
    Ok(())
}

/// The old `step` also updated the scale: a torch user calling `update`
/// after it counted every step twice. Here the scale moves in `update` only.
#[test]
fn growth_and_backoff_follow_torch() -> Result<()> {
    let (w, mut sgd) = setup()?;
    let vars = [w.clone()];
    let mut s = GradScaler::new(ScalerConfig {
        init_scale: 8.0,
        growth_factor: 2.0,
        backoff_factor: 0.25,
        growth_interval: 3,
    })?;
    // torch.amp.GradScaler with these settings, gradients clean except at
    // steps 4 and 5: scales after each update.
    let infs = [false, false, false, true, true, false, false, false, false];
    let expected = [8.0, 8.0, 16.0, 4.0, 1.0, 1.0, 1.0, 2.0, 2.0];
    let changes = [
        ScaleChange::Kept,
        ScaleChange::Kept,
        ScaleChange::Grew,
        ScaleChange::BackedOff,
        ScaleChange::BackedOff,
        ScaleChange::Kept,
        ScaleChange::Kept,
        ScaleChange::Grew,
        ScaleChange::Kept,
    ];
    for ((&inf, &scale), &change) in infs.iter().zip(&expected).zip(&changes) {
        let g = if inf { f32::INFINITY } else { 1.0 };
        let mut grads = grads_of(&s, &w, [g, 1.0, 1.0])?;
        let before = w.to_vec1::<f32>()?;
        let outcome = s.step(&mut sgd, &mut grads, &vars)?;
        assert_eq!(
            s.scale_factor(),
            s.state().scale,
            "step leaves the scale alone"
        );
        assert_eq!(
            outcome,
            if inf {
                StepOutcome::Skipped
            } else {
                StepOutcome::Stepped
            }
        );
        if inf {
            assert_eq!(
                w.to_vec1::<f32>()?,
                before,
                "a skipped step leaves the weights"
            );
        }
        assert_eq!(s.update()?, change);
        assert_eq!(s.scale_factor(), scale);
    }
    Ok(())
}

#[test]
fn nan_or_inf_in_any_gradient_is_found() -> Result<()> {
    let dev = Device::Cpu;
    let vars: Vec<Var> = (0..4)
        .map(|_| Var::ones(5, DType::F32, &dev).unwrap())
        .collect();
    for (bad, value) in [(0, f32::NAN), (3, f32::INFINITY), (2, f32::NEG_INFINITY)] {
        let mut grads = GradStore::default();
        for (i, v) in vars.iter().enumerate() {
            let mut g = vec![1f32; 5];
            if i == bad {
                g[4] = value;
            }
            grads.insert(v.as_tensor(), Tensor::new(g.as_slice(), &dev)?);
        }
        let mut s = GradScaler::new(ScalerConfig::default())?;
        assert!(s.unscale(&mut grads, &vars)?, "{value} in gradient {bad}");
    }
    // Large but finite: not an overflow.
    let mut grads = GradStore::default();
    grads.insert(vars[0].as_tensor(), Tensor::new(&[3e38f32; 5], &dev)?);
    let mut s = GradScaler::new(ScalerConfig {
        init_scale: 1.0,
        ..Default::default()
    })?;
    assert!(!s.unscale(&mut grads, &vars)?);
    Ok(())
}

#[test]
fn state_round_trips() -> Result<()> {
    let (w, mut sgd) = setup()?;
    let mut s = GradScaler::new(ScalerConfig {
        growth_interval: 5,
        ..Default::default()
    })?;
    for _ in 0..3 {
        let mut grads = grads_of(&s, &w, [1.0, 1.0, 1.0])?;
        s.step(&mut sgd, &mut grads, std::slice::from_ref(&w))?;
        s.update()?;
    }
    let json = serde_json::to_string(&s.state()).unwrap();
    let read: ScalerState = serde_json::from_str(&json).unwrap();
    let back = GradScaler::from_state(read)?;
    assert_eq!(back.state(), s.state());
    assert_eq!(back.growth_tracker(), 3);
    assert_eq!(back.scale_factor(), 65536.0);
    Ok(())
}

/// A gradient below f16's smallest subnormal is lost without scaling and
/// kept with it: what the scaler is for.
#[test]
fn scaling_keeps_gradients_that_f16_would_flush() -> Result<()> {
    let dev = Device::Cpu;
    let masters = MasterWeights::new(DType::F16);
    let vb = masters.var_builder(&dev);
    let w = vb.get_with_hints(4, "w", candle_nn::Init::Const(1.0))?;
    let x = Tensor::full(1e-4f32, 4, &dev)?.to_dtype(DType::F16)?;
    // d/dw of sum(w * x) * 1e-4 is 1e-8 per element: under f16's 6e-8.
    let loss = ((&w * &x)?.to_dtype(DType::F32)?.sum_all()? * 1e-4)?;
    let vars = masters.vars();
    let plain = loss.backward()?;
    assert_eq!(
        plain.get(vars[0].as_tensor()).unwrap().to_vec1::<f32>()?,
        [0.0; 4]
    );
    let mut s = GradScaler::new(ScalerConfig::default())?;
    let mut grads = s.scale(&loss)?.backward()?;
    assert!(!s.unscale(&mut grads, &vars)?);
    for g in grads.get(vars[0].as_tensor()).unwrap().to_vec1::<f32>()? {
        assert!((g - 1e-8).abs() < 1e-10, "{g}");
    }
    Ok(())
}

#[test]
fn an_f16_loss_is_refused() -> Result<()> {
    let s = GradScaler::new(ScalerConfig::default())?;
    let loss = Tensor::new(1f32, &Device::Cpu)?.to_dtype(DType::F16)?;
    assert!(err(s.scale(&loss)).starts_with("the loss is f16, in which a scale of 65536 overflows"));
    Ok(())
}

#[test]
fn the_defaults_are_torchs() {
    let c = ScalerConfig::default();
    assert_eq!(
        (
            c.init_scale,
            c.growth_factor,
            c.backoff_factor,
            c.growth_interval
        ),
        (65536.0, 2.0, 0.5, 2000)
    );
}

/// Only the variables passed in reach the optimizer, unscaled: a variable
/// left out is not stepped with a gradient 65536 times too large.
#[test]
fn only_unscaled_gradients_reach_the_optimizer() -> Result<()> {
    let dev = Device::Cpu;
    let (w, x) = (Var::new(&[1f32], &dev)?, Var::new(&[1f32], &dev)?);
    let mut sgd = SGD::new(vec![w.clone(), x.clone()], 1.0)?;
    let mut s = GradScaler::new(ScalerConfig::default())?;
    let loss = (w.as_tensor() + x.as_tensor())?.sum_all()?;
    let mut grads = s.scale(&loss)?.backward()?;
    s.step(&mut sgd, &mut grads, std::slice::from_ref(&w))?;
    assert_eq!(w.to_vec1::<f32>()?, [0.0]);
    assert_eq!(x.to_vec1::<f32>()?, [1.0], "left out: not stepped");
    assert!(grads.get(x.as_tensor()).is_none());
    Ok(())
}

#[test]
fn f16_gradients_and_bad_settings_are_refused() -> Result<()> {
    let dev = Device::Cpu;
    let w = Var::from_tensor(&Tensor::ones(2, DType::F16, &dev)?)?;
    let mut s = GradScaler::new(ScalerConfig::default())?;
    let loss = w.as_tensor().to_dtype(DType::F32)?.sum_all()?;
    let mut grads = s.scale(&loss)?.backward()?;
    assert!(err(s.unscale(&mut grads, std::slice::from_ref(&w)))
        .starts_with("a gradient of shape [2] is f16"));
    let bad = |c: ScalerConfig| err(GradScaler::new(c));
    let d = ScalerConfig::default();
    assert!(bad(ScalerConfig {
        growth_factor: 1.0,
        ..d
    })
    .starts_with("growth_factor is 1"));
    assert!(bad(ScalerConfig {
        backoff_factor: 1.5,
        ..d
    })
    .starts_with("backoff_factor is 1.5"));
    assert!(bad(ScalerConfig {
        init_scale: f64::NAN,
        ..d
    })
    .starts_with("init_scale is NaN"));
    assert!(bad(ScalerConfig {
        growth_interval: 0,
        ..d
    })
    .starts_with("growth_interval is 0"));
    Ok(())
}

/// As torch, the scale grows only to a finite value.
#[test]
fn the_scale_never_grows_to_infinity() -> Result<()> {
    let (w, mut sgd) = setup()?;
    let mut s = GradScaler::new(ScalerConfig {
        init_scale: f64::MAX,
        growth_interval: 1,
        ..Default::default()
    })?;
    let mut grads = GradStore::default();
    grads.insert(w.as_tensor(), Tensor::zeros(3, DType::F32, &Device::Cpu)?);
    s.step(&mut sgd, &mut grads, std::slice::from_ref(&w))?;
    assert_eq!(s.update()?, ScaleChange::Kept);
    assert_eq!(s.scale_factor(), f64::MAX);
    Ok(())
}

/// A layer may keep some weights in f32 (`vb.to_dtype`): the masters hand
/// them over in the dtype asked for.
#[test]
fn masters_come_in_the_dtype_a_layer_asks_for() -> Result<()> {
    let masters = MasterWeights::new(DType::BF16);
    let vb = masters.var_builder(&Device::Cpu);
    let half = vb.get_with_hints(3, "a", candle_nn::Init::Const(1.0))?;
    let full = vb
        .to_dtype(DType::F32)
        .get_with_hints(3, "b", candle_nn::Init::Const(1.0))?;
    assert_eq!((half.dtype(), full.dtype()), (DType::BF16, DType::F32));
    Ok(())
}

#[test]
fn masters_come_in_the_order_of_their_names() -> Result<()> {
    let masters = MasterWeights::new(DType::F32);
    let vb = masters.var_builder(&Device::Cpu);
    // 26 names made in reverse, each of its own size: a hash map's order
    // is sorted by chance with odds of 1 in 26!.
    for (i, name) in ('a'..='z').rev().enumerate() {
        vb.get_with_hints(26 - i, &name.to_string(), candle_nn::Init::Const(0.0))?;
    }
    let sizes: Vec<usize> = masters.vars().iter().map(|v| v.elem_count()).collect();
    assert_eq!(sizes, (1..=26).collect::<Vec<_>>());
    Ok(())
}

#[test]
fn an_inf_check_over_no_gradient_is_an_error_and_keeps_the_store() -> Result<()> {
    let (w, mut sgd) = setup()?;
    let other = Var::new(&[0f32], &Device::Cpu)?;
    let mut s = GradScaler::new(ScalerConfig::default())?;
    let mut grads = grads_of(&s, &w, [1.0, 1.0, 1.0])?;
    let expected = "none of the 1 variables given has a gradient in the store: pass the \
                    variables the loss was computed from (a MasterWeights' vars once the model \
                    is built)";
    // The first line: candle adds a backtrace where RUST_BACKTRACE asks.
    let first = |e: String| e.lines().next().unwrap_or_default().to_string();
    assert_eq!(
        first(err(s.unscale(&mut grads, std::slice::from_ref(&other)))),
        expected
    );
    assert_eq!(
        first(err(s.step(&mut sgd, &mut grads, &[]))),
        expected.replace("of the 1 variables", "of the 0 variables")
    );
    // Nothing was dropped: the right variables still step.
    assert!(grads.get(w.as_tensor()).is_some());
    s.step(&mut sgd, &mut grads, std::slice::from_ref(&w))?;
    assert_eq!(w.to_vec1::<f32>()?, [0.0, 1.0, 2.0]);
    Ok(())
}

#[test]
fn clipping_refuses_a_negative_or_nan_bound_and_takes_zero_and_infinity() -> Result<()> {
    let w = Var::new(&[3f32, 4.0], &Device::Cpu)?;
    for bound in [-1.0, f64::NAN] {
        let mut grads = w.as_tensor().sqr()?.sum_all()?.backward()?;
        let e = err(candle_amp::clip_grad_norm(
            &mut grads,
            std::slice::from_ref(&w),
            bound,
        ));
        assert_eq!(
            e.lines().next(),
            Some(&*format!(
                "max_norm is {bound}; allowed: a number from 0 (infinity: the norm alone)"
            ))
        );
        assert_eq!(
            grads.get(w.as_tensor()).unwrap().to_vec1::<f32>()?,
            [6.0, 8.0]
        );
    }
    // Infinity measures the norm and leaves the gradients; 0 zeroes them.
    for (bound, left) in [(f64::INFINITY, [6.0, 8.0]), (0.0, [0.0, 0.0])] {
        let mut grads = w.as_tensor().sqr()?.sum_all()?.backward()?;
        let norm = candle_amp::clip_grad_norm(&mut grads, std::slice::from_ref(&w), bound)?;
        assert_eq!(norm, 10.0);
        assert_eq!(grads.get(w.as_tensor()).unwrap().to_vec1::<f32>()?, left);
    }
    Ok(())
}
