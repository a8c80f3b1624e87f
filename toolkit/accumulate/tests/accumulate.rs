//! Row weights, variables only, and the checks on rows.

use candle_accumulate::{micro_batches, Accumulating, GradAccumulator};
use candle_core::{Device, Result, Tensor, Var};
use candle_nn::{Optimizer, SGD};

fn err<T: std::fmt::Debug>(r: Result<T>) -> String {
    r.expect_err("must fail").to_string()
}

/// The old `add` kept every entry of a store: an input's gradient too
/// (9 entries for 8 variables).
#[test]
fn only_the_model_variables_are_kept() -> Result<()> {
    let dev = Device::Cpu;
    let w = Var::new(&[1f32, 2.0], &dev)?;
    let x = Var::new(&[3f32, 4.0], &dev)?; // an input that needs a gradient
    let mut acc = GradAccumulator::new(vec![w.clone()], 2);
    let loss = (w.as_tensor() * x.as_tensor())?.sum_all()?;
    acc.backward(&loss, 2)?;
    let grads = acc.grads()?;
    assert_eq!(grads.get_ids().count(), 1);
    assert!(grads.get(x.as_tensor()).is_none());
    assert_eq!(
        grads.get(w.as_tensor()).unwrap().to_vec1::<f32>()?,
        [3.0, 4.0]
    );
    Ok(())
}

#[test]
fn uneven_micro_batches_give_the_batch_mean() -> Result<()> {
    let dev = Device::Cpu;
    let w = Var::new(&[0.5f32], &dev)?;
    let rows = Tensor::new(&[1f32, 2.0, 3.0, 4.0, 10.0], &dev)?;
    let full = w
        .as_tensor()
        .broadcast_mul(&rows)?
        .sqr()?
        .mean_all()?
        .backward()?;
    for size in 1..=5 {
        let mut acc = GradAccumulator::new(vec![w.clone()], 5);
        for part in micro_batches(&rows, size)? {
            let loss = w.as_tensor().broadcast_mul(&part)?.sqr()?.mean_all()?;
            acc.backward(&loss, part.dim(0)?)?;
        }
        let a = full.get(w.as_tensor()).unwrap().to_vec1::<f32>()?[0];
        let b = acc.grads()?.get(w.as_tensor()).unwrap().to_vec1::<f32>()?[0];
        assert!((a - b).abs() < 1e-5, "size {size}: {a} vs {b}");
    }
    Ok(())
}

#[test]
fn rows_must_add_up() -> Result<()> {
    let dev = Device::Cpu;
    let w = Var::new(&[1f32], &dev)?;
    let loss = || w.as_tensor().sum_all();
    let mut acc = GradAccumulator::new(vec![w.clone()], 4);
    assert!(err(acc.backward(&loss()?, 0)).starts_with("a micro-batch of 0 rows"));
    acc.backward(&loss()?, 3)?;
    assert!(err(acc.grads()).starts_with("only 3 of the batch's 4 rows are accumulated"));
    assert!(
        err(acc.backward(&loss()?, 2)).starts_with("3 + 2 rows is more than the batch's 4 rows")
    );
    assert!(err(acc.set_batch_rows(3)).starts_with("3 of the batch's 4 rows are accumulated"));
    acc.backward(&loss()?, 1)?;
    acc.take()?;
    assert_eq!((acc.rows(), acc.micro_batches()), (0, 0));
    acc.set_batch_rows(3)?;
    acc.backward(&loss()?, 3)?;
    assert_eq!(
        acc.grads()?.get(w.as_tensor()).unwrap().to_vec1::<f32>()?,
        [1.0]
    );
    assert!(err(micro_batches(&loss()?.reshape(1)?, 0))
        .starts_with("micro-batch size must be at least 1"));
    Ok(())
}

#[test]
fn owning_variant_steps_resets_and_reports_pending() -> Result<()> {
    let dev = Device::Cpu;
    let w = Var::new(&[0f32], &dev)?;
    let mut acc = Accumulating::new(SGD::new(vec![w.clone()], 1.0)?, vec![w.clone()], 2);
    acc.accumulate(&(w.as_tensor() * 4.0)?.sum_all()?, 1)?;
    acc.reset();
    assert_eq!(acc.pending(), 0);
    acc.accumulate(&(w.as_tensor() * 4.0)?.sum_all()?, 1)?;
    acc.accumulate(&(w.as_tensor() * 2.0)?.sum_all()?, 1)?;
    acc.step()?;
    // Half of 4 plus half of 2.
    assert_eq!(w.to_vec1::<f32>()?, [-3.0]);
    assert_eq!(acc.optimizer().learning_rate(), 1.0);
    Ok(())
}

/// Gradients handed over one at a time sum as whole stores do; another
/// tensor's gradient is left out; rows are checked before anything runs.
#[test]
fn gradients_handed_over_one_at_a_time() -> Result<()> {
    let dev = Device::Cpu;
    let (w, v) = (Var::new(&[0.5f32, -1.0], &dev)?, Var::new(&[2f32], &dev)?);
    let other = Var::new(&[7f32], &dev)?;
    let rows = Tensor::new(&[[1f32, 2.0], [3.0, 4.0], [10.0, -1.0]], &dev)?;
    let loss_of = |part: &Tensor| -> Result<Tensor> {
        part.broadcast_mul(w.as_tensor())?
            .sum(1)?
            .broadcast_mul(v.as_tensor())?
            .sqr()?
            .mean_all()
    };
    let mut whole = GradAccumulator::new(vec![w.clone(), v.clone()], 3);
    let mut each = GradAccumulator::new(vec![w.clone(), v.clone()], 3);
    for part in micro_batches(&rows, 2)? {
        let n = part.dim(0)?;
        whole.backward(&loss_of(&part)?, n)?;
        let grads = (loss_of(&part)? * (n as f64 / 3.0))?.backward()?;
        let handed = each.add_weighted_with(n, |add| {
            let mut count = 0;
            for var in [&w, &v, &other] {
                let g = match grads.get(var.as_tensor()) {
                    Some(g) => g.clone(),
                    None => var.ones_like()?, // not the model's: left out
                };
                add(var, g)?;
                count += 1;
            }
            Ok(count)
        })?;
        assert_eq!(handed, 3);
    }
    for var in [&w, &v] {
        let (a, b) = (
            whole.grads()?.get(var.as_tensor()),
            each.grads()?.get(var.as_tensor()),
        );
        assert_eq!(a.unwrap().to_vec1::<f32>()?, b.unwrap().to_vec1::<f32>()?);
    }
    assert!(each.grads()?.get(other.as_tensor()).is_none());
    assert_eq!(each.micro_batches(), 2);
    let mut ran = false;
    let e = err(each.add_weighted_with(1, |_| {
        ran = true;
        Ok(())
    }));
    assert!(
        e.starts_with("3 + 1 rows is more than the batch's 3 rows"),
        "{e}"
    );
    assert!(
        !ran,
        "the rows are checked before the gradients are asked for"
    );
    Ok(())
}

/// Gradients handed over become the sum, and later ones are added into it
/// in place (f32 on the CPU): the sum is the first gradient's own tensor,
/// holding the total. A gradient only lent (`add_weighted`) is never
/// written: its sum is a new tensor from the second micro-batch on.
#[test]
fn handed_over_gradients_take_later_ones_in_place_and_lent_ones_stay() -> Result<()> {
    let dev = Device::Cpu;
    let w = Var::new(&[1f32, 2.0], &dev)?;
    let grad = |a: f32, b: f32| Tensor::new(&[a, b], &dev);
    let mut acc = GradAccumulator::new(vec![w.clone()], 3);
    let first = grad(0.5, 0.25)?;
    let first_id = first.id();
    for g in [first, grad(1.0, 2.0)?, grad(4.0, 8.0)?] {
        acc.add_weighted_with(1, |add| add(&w, g))?;
    }
    let total = acc.grads()?.get(w.as_tensor()).expect("the sum");
    assert_eq!(
        total.id(),
        first_id,
        "added in place into the first gradient"
    );
    assert_eq!(total.to_vec1::<f32>()?, [5.5, 10.25]);

    let mut lent = GradAccumulator::new(vec![w.clone()], 2);
    let mut store = candle_core::backprop::GradStore::default();
    store.insert(w.as_tensor(), grad(0.5, 0.25)?);
    lent.add_weighted(&store, 1)?;
    lent.add_weighted_with(1, |add| add(&w, grad(1.0, 2.0)?))?;
    let kept = store.get(w.as_tensor()).expect("the lent gradient");
    assert_eq!(
        kept.to_vec1::<f32>()?,
        [0.5, 0.25],
        "a lent gradient is not written"
    );
    let total = lent.grads()?.get(w.as_tensor()).expect("the sum");
    assert_eq!(total.to_vec1::<f32>()?, [1.5, 2.25]);
    Ok(())
}
