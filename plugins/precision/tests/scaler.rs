//! The loss scaler's state machine, unscaling, clipping, and mixed-precision
//! training against f32.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer};
use workbook_precision::{clip_grad_norm, GradScaler, ScalerConfig, StepOutcome};
use workbook_sdk::train::{cross_entropy, param_grads, Activation, Mlp, Rng};

#[test]
fn the_scale_follows_torchs_rules_on_a_scripted_sequence() {
    let mut s = GradScaler::new(ScalerConfig {
        growth_interval: 3,
        ..Default::default()
    });
    // (found inf?, expected outcome, expected scale after)
    let script = [
        (false, StepOutcome::Stepped, 65536.0),
        (false, StepOutcome::Stepped, 65536.0),
        (false, StepOutcome::SteppedAndGrew, 131072.0),
        (false, StepOutcome::Stepped, 131072.0),
        (true, StepOutcome::Skipped, 65536.0),
        // A skip resets the run of clean steps: three more before growing.
        (false, StepOutcome::Stepped, 65536.0),
        (false, StepOutcome::Stepped, 65536.0),
        (true, StepOutcome::Skipped, 32768.0),
        (true, StepOutcome::Skipped, 16384.0),
        (false, StepOutcome::Stepped, 16384.0),
        (false, StepOutcome::Stepped, 16384.0),
        (false, StepOutcome::SteppedAndGrew, 32768.0),
    ];
    for (i, (inf, outcome, scale)) in script.into_iter().enumerate() {
        assert_eq!(s.update(inf), outcome, "step {i}");
        assert_eq!(s.scale(), scale, "step {i}");
    }
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

fn store(var: &Var, values: &[f32]) -> GradStore {
    let mut g = GradStore::default();
    g.insert(var.as_tensor(), Tensor::new(values, &Device::Cpu).unwrap());
    g
}

#[test]
fn unscaling_divides_and_detects_inf_and_nan() {
    let v = Var::new(&[0f32, 0.0], &Device::Cpu).unwrap();
    let s = GradScaler::new(ScalerConfig::default());
    let mut g = store(&v, &[65536.0, -131072.0]);
    assert!(s.unscale(&mut g, std::slice::from_ref(&v)).unwrap());
    assert_eq!(
        g.get(v.as_tensor()).unwrap().to_vec1::<f32>().unwrap(),
        [1.0, -2.0]
    );
    for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
        let mut g = store(&v, &[1.0, bad]);
        assert!(
            !s.unscale(&mut g, std::slice::from_ref(&v)).unwrap(),
            "{bad} is caught"
        );
    }
}

#[test]
fn a_skipped_step_leaves_the_parameters_alone() {
    let v = Var::new(&[1f32, 2.0], &Device::Cpu).unwrap();
    let mut opt = AdamW::new_lr(vec![v.clone()], 0.1).unwrap();
    let mut s = GradScaler::new(ScalerConfig::default());
    let g = store(&v, &[1.0, f32::NAN]);
    assert_eq!(s.step(&mut opt, &g, false).unwrap(), StepOutcome::Skipped);
    assert_eq!(v.as_tensor().to_vec1::<f32>().unwrap(), [1.0, 2.0]);
    let g = store(&v, &[1.0, 1.0]);
    assert_eq!(s.step(&mut opt, &g, true).unwrap(), StepOutcome::Stepped);
    assert_ne!(v.as_tensor().to_vec1::<f32>().unwrap(), [1.0, 2.0]);
}

#[test]
fn clipping_scales_to_the_global_norm() {
    let a = Var::new(&[0f32, 0.0], &Device::Cpu).unwrap();
    let b = Var::new(&[0f32], &Device::Cpu).unwrap();
    let mut g = GradStore::default();
    g.insert(
        a.as_tensor(),
        Tensor::new(&[3f32, 0.0], &Device::Cpu).unwrap(),
    );
    g.insert(b.as_tensor(), Tensor::new(&[4f32], &Device::Cpu).unwrap());
    let vars = [a.clone(), b.clone()];
    // Below the limit: untouched.
    assert_eq!(clip_grad_norm(&mut g, &vars, 10.0).unwrap(), 5.0);
    assert_eq!(
        g.get(b.as_tensor()).unwrap().to_vec1::<f32>().unwrap(),
        [4.0]
    );
    // Above: the global norm becomes the limit, directions kept.
    assert_eq!(clip_grad_norm(&mut g, &vars, 1.0).unwrap(), 5.0);
    let ga = g.get(a.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
    let gb = g.get(b.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
    assert!(
        (ga[0] - 0.6).abs() < 1e-6 && (gb[0] - 0.8).abs() < 1e-6,
        "{ga:?} {gb:?}"
    );
}

/// 100 steps of AdamW from one start: f32, bf16, and f16 with the scaler.
#[test]
fn mixed_precision_training_ends_near_f32() {
    let dev = Device::Cpu;
    let mut rng = Rng::seeded(11);
    let base = Mlp::new(&mut rng, &[16, 32, 3], Activation::Relu, DType::F32, &dev).unwrap();
    let x = rng.randn((512, 16), &dev).unwrap();
    let y = rng
        .randn((16, 3), &dev)
        .and_then(|t| x.matmul(&t)?.argmax(1))
        .unwrap();
    let train = |dtype: DType| -> f32 {
        let m = base.deep_clone().unwrap();
        let vars = m.vars();
        let mut opt = AdamW::new_lr(vars.clone(), 1e-2).unwrap();
        let mut scaler = (dtype == DType::F16).then(|| GradScaler::new(ScalerConfig::default()));
        for _ in 0..100 {
            let loss = cross_entropy(&m.forward_as(&x, dtype).unwrap(), &y).unwrap();
            let root = match &scaler {
                Some(s) => s.scale_loss(&loss).unwrap(),
                None => loss,
            };
            let mut g = param_grads(&root.backward().unwrap(), &vars);
            match scaler.as_mut() {
                Some(s) => {
                    let finite = s.unscale(&mut g, &vars).unwrap();
                    s.step(&mut opt, &g, finite).unwrap();
                }
                None => opt.step(&g).unwrap(),
            }
        }
        cross_entropy(&candle_core::Module::forward(&m, &x).unwrap(), &y)
            .unwrap()
            .to_scalar()
            .unwrap()
    };
    let (f32_loss, bf16_loss, f16_loss) =
        (train(DType::F32), train(DType::BF16), train(DType::F16));
    assert!(f32_loss < 0.3, "f32 learned: {f32_loss}");
    assert!(
        (bf16_loss - f32_loss).abs() < 0.05,
        "bf16 {bf16_loss} vs f32 {f32_loss}"
    );
    assert!(
        (f16_loss - f32_loss).abs() < 0.05,
        "f16 {f16_loss} vs f32 {f32_loss}"
    );
}
