//! The toolkit on a candle-nn transformer: checkpointing, layer-wise
//! offload, mixed precision and uneven accumulation give the gradients of
//! plain training.

use candle_accumulate::GradAccumulator;
use candle_amp::MasterWeights;
use candle_checkpoint::{ensure_grads, Sequential};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use candle_offload::HostAdamW;
use workbook_models::max_abs_diff;
use workbook_models::taped::{batch, Config, Transformer};

fn model(cfg: &Config) -> Result<(VarMap, Transformer)> {
    let map = VarMap::new();
    let m = Transformer::seeded(cfg, 11, &map, &Device::Cpu)?;
    Ok((map, m))
}

/// The cosine similarity of two stores' gradients of `vars`, taken as one
/// vector: 1 when they point the same way.
fn cosine(a: &GradStore, b: &GradStore, vars: &[Var]) -> Result<f64> {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for v in vars {
        let x = a.get(v.as_tensor()).unwrap().to_dtype(DType::F64)?;
        let y = b.get(v.as_tensor()).unwrap().to_dtype(DType::F64)?;
        ab += (&x * &y)?.sum_all()?.to_scalar::<f64>()?;
        aa += x.sqr()?.sum_all()?.to_scalar::<f64>()?;
        bb += y.sqr()?.sum_all()?.to_scalar::<f64>()?;
    }
    Ok(ab / (aa * bb).sqrt())
}

fn worst(a: &GradStore, b: &GradStore, vars: &[Var]) -> Result<f64> {
    let mut worst = 0f64;
    for v in vars {
        let (x, y) = (a.get(v.as_tensor()), b.get(v.as_tensor()));
        worst = worst.max(max_abs_diff(
            x.expect("plain grad"),
            y.expect("toolkit grad"),
        )?);
    }
    Ok(worst)
}

#[test]
fn checkpointed_transformer_has_plain_gradients() -> Result<()> {
    for tiled in [None, Some((3, 5))] {
        let cfg = Config {
            tiled,
            ..Config::tiny()
        };
        let (map, m) = model(&cfg)?;
        let vars = map.all_vars();
        let (ids, targets) = batch(1, 3, 12, cfg.vocab, &Device::Cpu)?;
        let plain = m.forward_loss(&ids, &targets)?.backward()?;
        ensure_grads(&map, &plain)?;
        for segments in 1..=m.layers().len() {
            let out =
                Sequential::new(m.layers())
                    .segments(segments)
                    .backward(&ids, &vars, |h| m.loss(h, &targets))?;
            ensure_grads(&map, &out.grads)?;
            assert!(out.input_grad.is_none(), "token ids have no gradient");
            let d = worst(&plain, &out.grads, &vars)?;
            assert!(d < 1e-5, "tiled {tiled:?}, {segments} segments: {d}");
        }
    }
    Ok(())
}

#[test]
fn layerwise_offload_steps_like_adamw() -> Result<()> {
    let cfg = Config::tiny();
    let (map_a, a) = model(&cfg)?;
    let (map_b, _) = model(&cfg)?;
    // Same weights in both maps.
    for (name, var) in candle_checkpoint::named_vars(&map_a) {
        let other = map_b.data().lock().unwrap()[&name].clone();
        other.set(var.as_tensor())?;
    }
    let b = Transformer::new(
        &cfg,
        VarBuilder::from_varmap(&map_b, DType::F32, &Device::Cpu),
    )?;
    let (ids, targets) = batch(2, 2, 10, cfg.vocab, &Device::Cpu)?;
    let p = ParamsAdamW {
        lr: 1e-2,
        ..Default::default()
    };
    let mut reference = AdamW::new(map_a.all_vars(), p.clone())?;
    reference.backward_step(&a.forward_loss(&ids, &targets)?)?;

    let vars = map_b.all_vars();
    let mut host = HostAdamW::new(vars.clone(), p)?;
    let before = host.transfers();
    let mut handed = 0;
    Sequential::new(b.layers())
        .each_layer()
        .backward_with(
            &ids,
            &vars,
            |h| b.loss(h, &targets),
            |var, g| {
                handed += 1;
                host.receive(var, &g)
            },
        )
        .map(|(loss, _)| loss)?;
    host.step_received()?;
    assert_eq!(
        handed,
        vars.len(),
        "each variable's gradient handed over once"
    );
    let param_bytes: usize = vars.iter().map(|v| v.elem_count() * 4).sum();
    assert_eq!(
        host.transfers().since(&before).bytes(),
        2 * param_bytes as u64
    );
    for (name, var) in candle_checkpoint::named_vars(&map_a) {
        let other = map_b.data().lock().unwrap()[&name].clone();
        let d = max_abs_diff(var.as_tensor(), other.as_tensor())?;
        // The same update from gradients equal to rounding.
        assert!(d < 1e-6, "{name}: {d}");
    }
    Ok(())
}

#[test]
fn mixed_precision_gradients_reach_f32_masters() -> Result<()> {
    let cfg = Config {
        tiled: Some((4, 4)),
        ..Config::tiny()
    };
    let (map, m) = model(&cfg)?;
    let (ids, targets) = batch(3, 2, 8, cfg.vocab, &Device::Cpu)?;
    let plain = m.forward_loss(&ids, &targets)?.backward()?;
    // f16 keeps 11 bits of mantissa, bf16 8: the gradients of a half
    // forward point the f32 gradients' way to 5e-4 and 7e-3 (measured).
    for (dtype, tol) in [(DType::F16, 1e-3), (DType::BF16, 1e-2)] {
        let masters = MasterWeights::from_varmap(map.clone(), dtype);
        let half = Transformer::new(&cfg, masters.var_builder(&Device::Cpu))?;
        let grads = half.forward_loss(&ids, &targets)?.backward()?;
        ensure_grads(masters.varmap(), &grads)?;
        for v in masters.vars() {
            assert_eq!(grads.get(v.as_tensor()).unwrap().dtype(), DType::F32);
        }
        let d = 1.0 - cosine(&plain, &grads, &map.all_vars())?;
        println!("{dtype:?}: 1 - cosine similarity to the f32 gradients: {d:.2e}");
        assert!(d < tol, "{dtype:?}: {d}");
    }
    Ok(())
}

/// Weights n_i / N: a batch of 10 rows in micro-batches of 4, 4 and 2 gives
/// the full batch's gradients; the old 1/K weighting does not.
#[test]
fn uneven_accumulation_equals_the_full_batch() -> Result<()> {
    let cfg = Config::tiny();
    let (map, m) = model(&cfg)?;
    let vars = map.all_vars();
    let (ids, targets) = batch(4, 10, 8, cfg.vocab, &Device::Cpu)?;
    let full = m.forward_loss(&ids, &targets)?.backward()?;
    let mut acc = GradAccumulator::new(vars.clone(), 10);
    let mut one_over_k = GradStore::default();
    for (start, rows) in [(0, 4), (4, 4), (8, 2)] {
        let loss = m.forward_loss(
            &ids.narrow(0, start, rows)?,
            &targets.narrow(0, start, rows)?,
        )?;
        acc.backward(&loss, rows)?;
        let g = (loss / 3.0)?.backward()?;
        candle_checkpoint::accumulate(&mut one_over_k, &g, &vars)?;
    }
    let d = worst(&full, acc.grads()?, &vars)?;
    assert!(d < 1e-6, "{d}");
    let wrong = worst(&full, &one_over_k, &vars)?;
    assert!(wrong > 100.0 * d.max(1e-7), "1/K differs: {wrong}");
    Ok(())
}

/// Selective checkpointing on the transformer: whatever the policy keeps,
/// the gradients are plain backprop's.
#[test]
fn every_policy_gives_plain_gradients() -> Result<()> {
    use candle_checkpoint::{Policy, Sequential};
    let cfg = Config::tiny();
    let (map, m) = model(&cfg)?;
    let vars = map.all_vars();
    let (ids, targets) = batch(5, 3, 12, cfg.vocab, &Device::Cpu)?;
    let plain = m.forward_loss(&ids, &targets)?.backward()?;
    let policies = [
        Policy::Nothing,
        Policy::Dots,
        Policy::Names(vec!["qkv".into(), "up".into()]),
    ];
    for policy in &policies {
        for segments in [2, m.layers().len()] {
            let out = Sequential::taped(m.layers())
                .segments(segments)
                .policy(policy)
                .backward(&ids, &vars, |h| m.loss(h, &targets))?;
            ensure_grads(&map, &out.grads)?;
            let d = worst(&plain, &out.grads, &vars)?;
            assert!(d < 1e-5, "{policy:?}, {segments} segments: {d}");
        }
    }
    Ok(())
}
