//! The GPT's direct backward against candle's graph: the same loss and
//! gradients for materialized and tiled attention, in f32 and the half
//! types, with a sequence shorter than the model's positions; and what it
//! refuses.

use std::collections::HashMap;

use candle_checkpoint::NoObserver;
use candle_core::{DType, Device, Result, Tensor};
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

/// `c` with the head tied to the token table or with a table of its own.
fn head(c: GptConfig, tied_head: bool) -> GptConfig {
    GptConfig { tied_head, ..c }
}

/// The two heads, for each case of a test.
const HEADS: [bool; 2] = [true, false];

/// The largest difference between `a` and `b`, relative to `b`'s largest
/// magnitude.
fn relative(a: &Tensor, b: &Tensor) -> Result<f64> {
    let (a, b) = (a.to_dtype(DType::F64)?, b.to_dtype(DType::F64)?);
    let size = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?;
    let diff = (a - &b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?;
    Ok(diff / size.max(1e-30))
}

/// The direct step's loss and each variable's gradient, the tied table's
/// two parts summed.
fn direct_step(
    model: &Gpt,
    x: &Tensor,
    y: &Tensor,
) -> Result<(Tensor, HashMap<candle_core::TensorId, Tensor>)> {
    let mut grads: HashMap<_, Tensor> = HashMap::new();
    let loss = model.direct_loss_with(
        x,
        y,
        1.0,
        |var, g| {
            let sum = match grads.remove(&var.id()) {
                Some(before) => (before + g)?,
                None => g,
            };
            grads.insert(var.id(), sum);
            Ok(())
        },
        &NoObserver,
    )?;
    Ok((loss, grads))
}

#[test]
fn the_direct_backward_gives_the_graphs_loss_and_gradients() -> Result<()> {
    let dev = Device::Cpu;
    // Measured: f32 within 6e-8 (the same operations, summed in other
    // orders), bf16 and f16 within one unit in the last place (3.9e-3,
    // 4.9e-4); the bounds allow twice that.
    for (dtype, tol) in [(DType::F32, 1e-6), (DType::BF16, 8e-3), (DType::F16, 1e-3)] {
        for (attention, tied) in [AttentionKind::Materialized, AttentionKind::Tiled]
            .into_iter()
            .flat_map(|a| HEADS.map(|t| (a, t)))
        {
            let what = format!("{dtype:?}, {attention:?}, tied head {tied}");
            let c = head(config(attention, true), tied);
            let model = Gpt::new(c, dtype, &mut Rng::seeded(1), &dev)?;
            // 12 of the 16 positions: the unused positions' gradient is 0.
            let (x, y) = batch(&mut Rng::seeded(2), 3, 12, 24, &dev)?;
            let graph_loss = model.loss(&x, &y, &Labeller::default())?;
            let graph = graph_loss.backward()?;
            let (loss, direct) = direct_step(&model, &x, &y)?;
            let (a, b) = (
                loss.to_dtype(DType::F64)?.to_scalar::<f64>()?,
                graph_loss.to_dtype(DType::F64)?.to_scalar::<f64>()?,
            );
            assert!((a - b).abs() <= 1e-6 * b.abs(), "{what}: loss {a} vs {b}");
            let vars = model.vars();
            assert_eq!(direct.len(), vars.len(), "{what}: a gradient per variable");
            for (i, var) in vars.iter().enumerate() {
                let want = graph.get(var).expect("the graph's gradient");
                let got = &direct[&var.id()];
                assert_eq!(got.dims(), want.dims(), "{what}: parameter {i}");
                assert_eq!(got.dtype(), dtype, "{what}: parameter {i}");
                let r = relative(got, want)?;
                assert!(r <= tol, "{what}: parameter {i} of {:?}: {r}", var.dims());
            }
            // Checkpointed, each stage run again: the same operations on the
            // same inputs, so the same gradients to the bit.
            let ckpt = model.direct_checkpointed(&x, &y, 1.0, &NoObserver)?;
            for var in &vars {
                let again = ckpt.grads.get(var).expect("a checkpointed gradient");
                assert_eq!(
                    relative(again, &direct[&var.id()])?,
                    0.0,
                    "{what}: checkpointed"
                );
            }
        }
    }
    Ok(())
}

#[test]
fn the_direct_backward_refuses_what_it_does_not_run() -> Result<()> {
    let dev = Device::Cpu;
    let (x, y) = batch(&mut Rng::seeded(2), 2, 8, 24, &dev)?;
    for (attention, lean) in [
        (AttentionKind::Naive, true),
        (AttentionKind::Materialized, false),
    ] {
        let model = Gpt::new(
            config(attention, lean),
            DType::F32,
            &mut Rng::seeded(1),
            &dev,
        )?;
        let err = model
            .direct_loss_with(&x, &y, 1.0, |_, _| Ok(()), &NoObserver)
            .expect_err("refused")
            .to_string();
        assert_eq!(
            err.lines().next().unwrap_or_default(),
            format!(
                "the direct backward runs the lean layers with materialized or tiled attention; \
                 this model has lean {lean} and {attention:?} attention"
            )
        );
    }
    Ok(())
}

/// No tensor of the direct step records candle's graph: a stage's output
/// or gradient that did (the embedding's product with the token table, a
/// variable, once did) keeps every tensor it was computed from alive
/// through its operation, which held a copy of each block's two residual
/// branches to the end of the forward and the head's temporaries through
/// the backward.
#[test]
fn the_direct_step_records_no_graph() -> Result<()> {
    use candle_custom_grad::DirectBackward;
    let dev = Device::Cpu;
    for attention in [AttentionKind::Materialized, AttentionKind::Tiled] {
        let model = Gpt::new(
            config(attention, true),
            DType::F32,
            &mut Rng::seeded(1),
            &dev,
        )?;
        let (x, y) = batch(&mut Rng::seeded(2), 2, 16, 24, &dev)?;
        let mut h = x.clone();
        for (i, stage) in model.direct_stages().iter().enumerate() {
            let (out, _) = stage.forward_saved(&h)?;
            assert!(
                !out.track_op(),
                "{attention:?}: stage {i}'s output has a graph"
            );
            h = out;
        }
        let mut graphs = Vec::new();
        let loss = model.direct_loss_with(
            &x,
            &y,
            1.0,
            |var, g| {
                if g.track_op() {
                    graphs.push(var.dims().to_vec());
                }
                Ok(())
            },
            &NoObserver,
        )?;
        assert!(!loss.track_op(), "{attention:?}: the loss has a graph");
        assert!(
            graphs.is_empty(),
            "{attention:?}: gradients with a graph: {graphs:?}"
        );
    }
    Ok(())
}

/// candle-nn's GPT in f32 (naive attention), from the seed every test's
/// models start from.
fn candle_nns(tied: bool) -> Result<Gpt> {
    let c = head(config(AttentionKind::Naive, false), tied);
    Gpt::new(c, DType::F32, &mut Rng::seeded(1), &Device::Cpu)
}

/// The lean GPT in f32 with `attention`, from the same seed: the same
/// parameters as [`candle_nns`]'s.
fn lean_model(attention: AttentionKind, tied: bool) -> Result<Gpt> {
    let c = head(config(attention, true), tied);
    Gpt::new(c, DType::F32, &mut Rng::seeded(1), &Device::Cpu)
}

/// The direct step against candle-nn's GPT (candle-nn's Linear, GELU,
/// layer norm and cross-entropy, the attention composed of candle's
/// operations, candle's backward), built from the same seed: the same
/// parameters, so the same loss and gradients up to the two GELUs (candle's
/// `tanh` from libm, the toolkit's a polynomial within 3 ulp) and the
/// orders of the sums.
#[test]
fn the_direct_backward_gives_candle_nns_gradients() -> Result<()> {
    let dev = Device::Cpu;
    let (x, y) = batch(&mut Rng::seeded(2), 3, 16, 24, &dev)?;
    for tied in HEADS {
        let reference = candle_nns(tied)?;
        let want_loss = reference.loss(&x, &y, &Labeller::default())?;
        let want = want_loss.backward()?;
        for attention in [AttentionKind::Materialized, AttentionKind::Tiled] {
            let what = format!("{attention:?}, tied head {tied}");
            let model = lean_model(attention, tied)?;
            let (loss, got) = direct_step(&model, &x, &y)?;
            let (a, b) = (
                loss.to_scalar::<f32>()? as f64,
                want_loss.to_scalar::<f32>()? as f64,
            );
            assert!((a - b).abs() <= 1e-6 * b.abs(), "{what}: loss {a} vs {b}");
            let vars = model.vars();
            assert_eq!(vars.len(), reference.vars().len(), "{what}");
            for (i, (var, reference_var)) in vars.iter().zip(reference.vars()).enumerate() {
                let r = relative(
                    &got[&var.id()],
                    want.get(&reference_var).expect("a gradient"),
                )?;
                assert!(r <= 1e-5, "{what}: parameter {i} of {:?}: {r}", var.dims());
            }
        }
    }
    Ok(())
}

/// A parameter without the keys' bias (the middle third of `qkv`'s): it
/// adds `q·b` to every score of a row, which the softmax cancels, so its
/// gradient is 0 plus rounding in both models, and AdamW's first step
/// turns that rounding into `±lr` with either sign.
fn without_key_bias(var: &candle_core::Var) -> Result<Tensor> {
    let t = var.as_tensor();
    match t.dims() {
        &[n] if n == 3 * config(AttentionKind::Naive, false).hidden => {
            let third = n / 3;
            Tensor::cat(&[t.narrow(0, 0, third)?, t.narrow(0, 2 * third, third)?], 0)
        }
        _ => Ok(t.clone()),
    }
}

/// Training, not one gradient: three steps of the direct backward (plain
/// and checkpointed; the head tied, and plain with a head of its own) with
/// the toolkit's in-place AdamW against candle-nn's
/// GPT trained by candle-nn's own `AdamW`, each on the same batches. The
/// parameters after the updates are the same up to the two GELUs and the
/// gradients' rounding, which AdamW's normalisation (each element's step
/// is about `lr` whatever its gradient's size) enlarges for the smallest
/// gradients. Measured: at most 1.0e-3 of one step (`lr`) apart, as the
/// same model through candle's graph and candle's AdamW is 5.5e-4 apart;
/// the bound allows five times that.
#[test]
fn the_direct_step_trains_as_candle_nns_gpt_with_candles_adamw() -> Result<()> {
    use candle_lean_optim::LeanAdamW;
    use candle_nn::{AdamW, Optimizer, ParamsAdamW};
    let dev = Device::Cpu;
    let params = ParamsAdamW {
        lr: 1e-2,
        weight_decay: 0.1,
        ..Default::default()
    };
    let cases = [AttentionKind::Materialized, AttentionKind::Tiled]
        .into_iter()
        .flat_map(|a| [(a, false, true), (a, true, true), (a, false, false)]);
    for (attention, checkpointed, tied) in cases {
        let what = format!("{attention:?}, checkpointed {checkpointed}, tied head {tied}");
        let (reference, model) = (candle_nns(tied)?, lean_model(attention, tied)?);
        let mut want_opt = AdamW::new(reference.vars(), params.clone())?;
        let mut opt = LeanAdamW::new(model.vars(), params.clone())?;
        let mut data = Rng::seeded(2);
        for step in 0..3 {
            let (x, y) = batch(&mut data, 3, 16, 24, &dev)?;
            let want = reference.loss(&x, &y, &Labeller::default())?;
            want_opt.backward_step(&want)?;
            let got = if checkpointed {
                model.direct_checkpointed(&x, &y, 1.0, &NoObserver)?
            } else {
                model.direct_loss(&x, &y, 1.0, &NoObserver)?
            };
            opt.step(&got.grads)?;
            let (a, b) = (
                got.loss.to_scalar::<f32>()? as f64,
                want.to_scalar::<f32>()? as f64,
            );
            assert!(
                (a - b).abs() <= 1e-5 * b.abs(),
                "{what}: step {step}: loss {a} vs {b}"
            );
        }
        for (i, (var, want)) in model.vars().iter().zip(reference.vars()).enumerate() {
            let (got, want) = (without_key_bias(var)?, without_key_bias(&want)?);
            let steps = (&got - &want)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()? as f64
                / params.lr;
            assert!(
                steps <= 5e-3,
                "{what}: parameter {i} of {:?} after three updates is {steps} of a step \
                 (lr) from candle-nn's",
                var.dims()
            );
        }
    }
    Ok(())
}
