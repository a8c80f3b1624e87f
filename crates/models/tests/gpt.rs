//! The GPT's recipes compute the same function: the lean layers, the
//! materialized and the tiled attention give candle-nn's loss and gradients.

use candle_core::{DType, Device, Result};
use candle_ledger::Labeller;
use workbook_models::corpus::batch;
use workbook_models::Rng;
use workbook_models::{AttentionKind, Gpt, GptConfig};

fn config(attention: AttentionKind, lean: bool) -> GptConfig {
    GptConfig {
        layers: 2,
        hidden: 32,
        heads: 4,
        seq: 16,
        vocab: 24,
        attention,
        lean,
        tied_head: true,
    }
}

#[test]
fn every_recipe_gives_candle_nn_s_loss_and_gradients() -> Result<()> {
    let dev = Device::Cpu;
    let plain_cfg = config(AttentionKind::Naive, false);
    let plain = Gpt::new(plain_cfg, DType::F32, &mut Rng::seeded(1), &dev)?;
    let (x, y) = batch(&mut Rng::seeded(2), 3, 16, 24, &dev)?;
    let reference = plain.loss(&x, &y, &Labeller::default())?;
    let ref_grads = reference.backward()?;
    let ref_loss = reference.to_scalar::<f32>()?;
    for (attention, lean) in [
        (AttentionKind::Materialized, false),
        (AttentionKind::Tiled, false),
        (AttentionKind::Naive, true),
        (AttentionKind::Materialized, true),
        (AttentionKind::Tiled, true),
    ] {
        // The same seed gives the same weights.
        let model = Gpt::new(
            config(attention, lean),
            DType::F32,
            &mut Rng::seeded(1),
            &dev,
        )?;
        let loss = model.loss(&x, &y, &Labeller::default())?;
        let grads = loss.backward()?;
        let l = loss.to_scalar::<f32>()?;
        assert!(
            (l - ref_loss).abs() < 1e-5,
            "{attention:?} lean {lean}: {l} vs {ref_loss}"
        );
        for (a, b) in model.vars().iter().zip(plain.vars()) {
            let (ga, gb) = (grads.get(a).unwrap(), ref_grads.get(&b).unwrap());
            let d = (ga - gb)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert!(d < 1e-5, "{attention:?} lean {lean}: gradient off by {d}");
        }
    }
    Ok(())
}

#[test]
fn the_parameter_count_is_the_formula() -> Result<()> {
    let cfg = config(AttentionKind::Tiled, true);
    let model = Gpt::new(cfg, DType::F32, &mut Rng::seeded(1), &Device::Cpu)?;
    // h·v + s·h + L·(12h² + 13h) + 2h with h = 32, v = 24, s = 16, L = 2.
    assert_eq!(
        model.param_count(),
        32 * 24 + 16 * 32 + 2 * (12 * 32 * 32 + 13 * 32) + 64
    );
    assert_eq!(model.param_count(), cfg.param_count());
    Ok(())
}

#[test]
fn bad_shapes_are_refused_with_their_values() -> Result<()> {
    let dev = Device::Cpu;
    let cfg = GptConfig {
        hidden: 30,
        ..config(AttentionKind::Naive, false)
    };
    let err = Gpt::new(cfg, DType::F32, &mut Rng::seeded(1), &dev)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("hidden size 30 is not a multiple of 4 heads"),
        "{err}"
    );
    let model = Gpt::new(
        config(AttentionKind::Naive, false),
        DType::F32,
        &mut Rng::seeded(1),
        &dev,
    )?;
    let (x, y) = batch(&mut Rng::seeded(2), 1, 17, 24, &dev)?;
    let err = model
        .loss(&x, &y, &Labeller::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("17 tokens, the model's positions stop at 16"),
        "{err}"
    );
    Ok(())
}
