//! A backward is handed its inputs and output detached, for both arities:
//! what it computes from them builds no graph that would keep them alive.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use candle_core::{Device, Result, Tensor, Var};
use candle_custom_grad::{with_backward2, with_backward3, Backward2, Backward3};

#[derive(Clone, Default)]
struct Seen(Arc<AtomicBool>);

impl Seen {
    fn check(&self, inputs: &[&Tensor]) {
        let tracked = inputs.iter().any(|t| t.track_op());
        self.0.store(!tracked, Ordering::SeqCst);
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
fn both_arities_hand_the_backward_detached_tensors() -> Result<()> {
    let dev = Device::Cpu;
    let vars: Vec<Var> = (0..3)
        .map(|i| Var::new(&[i as f32], &dev))
        .collect::<Result<_>>()?;
    // Inputs that are in the graph: a variable, and a product of variables.
    let a = vars[0].as_tensor().clone();
    let b = (vars[1].as_tensor() * vars[2].as_tensor())?;
    let out = (&a + &b)?.detach();

    let two = Seen::default();
    with_backward2(out.clone(), &a, &b, two.clone())?
        .sum_all()?
        .backward()?;
    assert!(two.0.load(Ordering::SeqCst), "with_backward2");

    let three = Seen::default();
    with_backward3(out, &a, &b, vars[2].as_tensor(), three.clone())?
        .sum_all()?
        .backward()?;
    assert!(three.0.load(Ordering::SeqCst), "with_backward3");
    Ok(())
}
