//! What the ledger lists: one entry per storage, labelled by the part that
//! allocated it; parameters left out; kept tensors seen when noted.

use candle_core::{Device, Result, Tensor, Var};
use candle_lean_nn::{Activation, LeanLinear};
use candle_ledger::{Labeller, Ledger};

fn filled(shape: (usize, usize), v: f32) -> Result<Tensor> {
    Tensor::full(v, shape, &Device::Cpu)
}

#[test]
fn views_share_their_storage_and_parameters_are_left_out() -> Result<()> {
    let w = Var::from_tensor(&filled((8, 8), 0.5)?)?;
    let labels = Labeller::new();
    let h = labels.label(
        w.as_tensor().t()?.matmul(&filled((8, 4), 1.0)?)?,
        Some(0),
        "a",
    );
    let r = labels.label(h.reshape((4, 8))?.transpose(0, 1)?, Some(0), "b");
    let loss = r.sum_all()?;
    let ledger = Ledger::of(&loss, &labels)?;
    let product = ledger
        .held
        .iter()
        .find(|e| e.bytes == 8 * 4 * 4)
        .expect("the product is listed");
    // The product and its two views are one storage, labelled by the part
    // that allocated it, with its shape.
    assert_eq!(
        (product.nodes, product.shape.as_slice()),
        (3, &[8usize, 4][..])
    );
    assert_eq!(product.label.as_ref().map(|l| l.part.as_str()), Some("a"));
    // The weight's transpose is a view of a parameter: not listed.
    assert_eq!(ledger.total_bytes(), 8 * 4 * 4 + 4);
    assert_eq!(ledger.by_layer().get(&Some(0)), Some(&(8 * 4 * 4)));
    Ok(())
}

#[test]
fn without_a_recording_labeller_kept_tensors_are_not_seen() -> Result<()> {
    let w = Var::from_tensor(&filled((16, 8), 0.1)?)?;
    let fc = LeanLinear::new(w.as_tensor().clone(), None)?;
    let x = filled((4, 8), 1.0)?;
    let plain = Labeller::default();
    let loss = fc.forward_act(&x, Activation::Gelu)?.sum_all()?;
    // The output and the loss only: the kept GELU input is invisible.
    assert_eq!(Ledger::of(&loss, &plain)?.total_bytes(), 4 * 16 * 4 + 4);
    let noting = Labeller::unlabelled();
    let loss = fc.forward_act(&x, Activation::Gelu)?.sum_all()?;
    let ledger = Ledger::of(&loss, &noting)?;
    assert_eq!(ledger.total_bytes(), 2 * 4 * 16 * 4 + 4);
    assert!(ledger.held.iter().all(|h| h.label.is_none()));
    Ok(())
}

#[test]
fn each_labelled_part_is_timed_in_order() -> Result<()> {
    let w = Var::from_tensor(&filled((64, 64), 0.01)?)?;
    let x = filled((64, 64), 1.0)?;
    let labels = Labeller::new();
    let h = labels.label(x.matmul(w.as_tensor())?, Some(0), "matmul");
    let t = labels.label(h.tanh()?, Some(1), "tanh");
    drop(labels.label(t.sum_all()?, None, "loss"));
    let times = labels.times();
    let names: Vec<(Option<usize>, &str)> = times
        .iter()
        .map(|(l, _)| (l.layer, l.part.as_str()))
        .collect();
    assert_eq!(
        names,
        [(Some(0), "matmul"), (Some(1), "tanh"), (None, "loss")]
    );
    // A disabled or unlabelled labeller times nothing.
    assert!(Labeller::default().times().is_empty());
    assert!(Labeller::unlabelled().times().is_empty());
    Ok(())
}
