//! Mixed-precision training of the cell's model with the toolkit's scaler
//! ends near f32. (The scaler's own tests are in the candle-amp crate.)

use candle_amp::{GradScaler, ScalerConfig};
use candle_core::{DType, Device};
use candle_nn::{AdamW, Optimizer};
use workbook_models::{cross_entropy, param_grads, Activation, Mlp, Rng};

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
        let mut scaler =
            (dtype == DType::F16).then(|| GradScaler::new(ScalerConfig::default()).unwrap());
        for _ in 0..100 {
            let loss = cross_entropy(&m.forward_as(&x, dtype).unwrap(), &y).unwrap();
            let root = match &scaler {
                Some(s) => s.scale(&loss).unwrap(),
                None => loss,
            };
            let mut g = param_grads(&root.backward().unwrap(), &vars);
            match scaler.as_mut() {
                Some(s) => {
                    s.step(&mut opt, &mut g, &vars).unwrap();
                    s.update().unwrap();
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
