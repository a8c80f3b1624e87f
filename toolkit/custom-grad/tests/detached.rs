//! A backward is handed its inputs and output detached, for every arity:
//! what it computes from them builds no graph that would keep them alive.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_custom_grad::{
    with_backward1, with_backward2, with_backward3, Backward1, Backward2, Backward3,
};

#[derive(Clone, Default)]
struct Seen(Arc<AtomicBool>);

impl Seen {
    fn check(&self, inputs: &[&Tensor]) {
        let tracked = inputs.iter().any(|t| t.track_op());
        self.0.store(!tracked, Ordering::SeqCst);
    }
}

impl Backward1 for Seen {
    fn backward(&self, a: &Tensor, out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        self.check(&[a, out]);
        Ok(Some(grad.clone()))
    }
}

impl Backward2 for Seen {
    fn backward(
        &self,
        a: &Tensor,
        b: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        self.check(&[a, b, out]);
        Ok((Some(grad.clone()), Some(grad.clone())))
    }
}

impl Backward3 for Seen {
    fn backward(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.check(&[a, b, c, out]);
        Ok((Some(grad.clone()), Some(grad.clone()), Some(grad.clone())))
    }
}

#[test]
fn every_arity_hands_the_backward_detached_tensors() -> Result<()> {
    let dev = Device::Cpu;
    let vars: Vec<Var> = (0..3)
        .map(|i| Var::new(&[i as f32], &dev))
        .collect::<Result<_>>()?;
    // Inputs that are in the graph: a variable, and a product of variables.
    let a = vars[0].as_tensor().clone();
    let b = (vars[1].as_tensor() * vars[2].as_tensor())?;
    let out = (&a + &b)?.detach();

    let one = Seen::default();
    with_backward1(out.clone(), &b, one.clone())?
        .sum_all()?
        .backward()?;
    assert!(one.0.load(Ordering::SeqCst), "with_backward1");

    let two = Seen::default();
    with_backward2(out.clone(), [&a, &b], two.clone())?
        .sum_all()?
        .backward()?;
    assert!(two.0.load(Ordering::SeqCst), "with_backward2");

    let three = Seen::default();
    with_backward3(out, [&a, &b, vars[2].as_tensor()], three.clone())?
        .sum_all()?
        .backward()?;
    assert!(three.0.load(Ordering::SeqCst), "with_backward3");
    Ok(())
}

/// A block of two f32 values "gathered" into a (2, 2) bf16 whole: the
/// backward's gradient, of the whole's shape and dtype, comes back as the
/// block's, each row summed, in f32.
struct RowSums;

impl Backward1 for RowSums {
    fn backward(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad.to_dtype(DType::F32)?.sum(1)?))
    }
}

#[test]
fn one_input_may_differ_from_its_output_in_shape_and_dtype() -> Result<()> {
    let dev = Device::Cpu;
    let block = Var::new(&[1f32, 2.0], &dev)?;
    let whole = Tensor::new(&[[1f32, 1.0], [2.0, 2.0]], &dev)?.to_dtype(DType::BF16)?;
    let out = with_backward1(whole, block.as_tensor(), RowSums)?;
    assert_eq!((out.dims(), out.dtype()), (&[2usize, 2][..], DType::BF16));
    let weights = Tensor::new(&[[1f32, 2.0], [3.0, 4.0]], &dev)?.to_dtype(DType::BF16)?;
    let grads = (out * weights)?.sum_all()?.backward()?;
    let g = grads.get(block.as_tensor()).expect("the block's gradient");
    assert_eq!(g.to_vec1::<f32>()?, [3.0, 7.0]);
    Ok(())
}
