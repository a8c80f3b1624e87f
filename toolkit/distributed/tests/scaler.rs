//! ZeroAdamW under a dynamic loss scaler (candle-amp's GradScaler), the
//! inf check made through the optimizer: on one rank, every step equals
//! GradScaler with LeanAdamW, a step whose gradient overflows skipped alike.
//! That the ranks agree on an overflow only one of them saw is tests/ranks.rs's.

use std::sync::Arc;

use candle_amp::{GradScaler, ScaleChange, ScalerConfig, StepOutcome};
use candle_core::{Device, Result, Tensor, Var};
use candle_distributed::{Comm, ZeroAdamW};
use candle_lean_optim::LeanAdamW;
use candle_nn::{Optimizer, ParamsAdamW};

fn vars() -> Result<Vec<Var>> {
    [(4usize, 3usize), (6, 1)]
        .iter()
        .map(|&(a, b)| {
            let data: Vec<f32> = (0..a * b).map(|j| (j % 5) as f32 * 0.4 - 0.8).collect();
            Var::from_tensor(&Tensor::from_vec(data, (a, b), &Device::Cpu)?)
        })
        .collect()
}

/// A loss whose gradient differs each step; at `overflow` steps one of its
/// terms is infinite, as an f16 activation past 65504 would make it.
fn loss(vars: &[Var], step: usize, overflow: bool) -> Result<Tensor> {
    let mut total = Tensor::new(0f32, &Device::Cpu)?;
    for (i, v) in vars.iter().enumerate() {
        let t = (v.as_tensor() - ((step + i) as f64 * 0.1))?;
        total = (total + t.sqr()?.sum_all()?)?;
    }
    if overflow {
        total = (total + (vars[1].as_tensor() * f64::INFINITY)?.sum_all()?)?;
    }
    Ok(total)
}

fn values(vars: &[Var]) -> Result<Vec<Vec<f32>>> {
    vars.iter()
        .map(|v| v.as_tensor().flatten_all()?.to_vec1())
        .collect()
}

#[test]
fn zero_adamw_under_a_loss_scaler_steps_and_skips_as_lean_adamw() -> Result<()> {
    let config = ScalerConfig {
        init_scale: 1024.0,
        growth_interval: 2,
        ..Default::default()
    };
    let p = ParamsAdamW {
        lr: 0.05,
        ..Default::default()
    };
    let (a, b) = (vars()?, vars()?);
    let mut zero = ZeroAdamW::new(Arc::new(Comm::solo()), a.clone(), p.clone())?;
    let mut lean = LeanAdamW::new(b.clone(), p)?;
    let (mut zs, mut ls) = (GradScaler::new(config)?, GradScaler::new(config)?);
    let mut changes = Vec::new();
    for step in 0..6 {
        let overflow = step == 3;
        // ZeRO: the gradients reduced into the optimizer's blocks, checked
        // there, agreed over the ranks.
        let grads = zs.scale(&loss(&a, step, overflow)?)?.backward()?;
        for v in &a {
            zero.reduce_gradient(v, grads.get(v.as_tensor()).unwrap())?;
        }
        let found = zero.unscale_gradients(1.0 / zs.scale_factor())?;
        zs.record_inf_check(found)?;
        if found {
            zero.discard_gradients();
        } else {
            zero.step_reduced()?;
        }
        let zero_change = zs.update()?;

        let mut grads = ls.scale(&loss(&b, step, overflow)?)?.backward()?;
        let outcome = ls.step(&mut lean, &mut grads, &b)?;
        assert_eq!(found, outcome == StepOutcome::Skipped, "step {step}");
        assert_eq!(zero_change, ls.update()?, "step {step}");
        assert_eq!(zs.scale_factor(), ls.scale_factor(), "step {step}");
        assert_eq!(values(&a)?, values(&b)?, "step {step}");
        assert_eq!(zero.gradient_bytes(), 0, "step {step}");
        changes.push(zero_change);
    }
    // Grown after two clean steps, backed off at the overflow, the
    // parameters unmoved by it.
    use ScaleChange::*;
    assert_eq!(changes, [Kept, Grew, Kept, BackedOff, Kept, Grew]);
    assert_eq!(zero.step_count(), 5);
    Ok(())
}

#[test]
fn the_inf_check_is_made_once_a_step_and_needs_gradients() -> Result<()> {
    let a = vars()?;
    let p = ParamsAdamW::default();
    let mut zero = ZeroAdamW::new(Arc::new(Comm::solo()), a.clone(), p)?;
    let e = zero.unscale_gradients(1.0).unwrap_err();
    assert_eq!(
        e.to_string().lines().next(),
        Some(
            "ZeroAdamW: no gradient block to unscale: reduce the gradients first (reduce_gradient)"
        )
    );
    let mut scaler = GradScaler::new(ScalerConfig::default())?;
    scaler.record_inf_check(false)?;
    let e = scaler.record_inf_check(false).unwrap_err();
    assert_eq!(
        e.to_string().lines().next(),
        Some(
            "an inf check was already made (unscale, step or record_inf_check) since the last \
             update"
        )
    );
    // Recorded means stepped: `step` would step the optimizer a second time.
    let mut lean = LeanAdamW::new(a.clone(), ParamsAdamW::default())?;
    let mut grads = loss(&a, 0, false)?.backward()?;
    let e = scaler.step(&mut lean, &mut grads, &a).unwrap_err();
    assert_eq!(
        e.to_string().lines().next(),
        Some("step was already called since the last update")
    );
    assert_eq!(scaler.update()?, ScaleChange::Kept);
    Ok(())
}
