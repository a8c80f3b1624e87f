//! Helpers shared by the test files.

use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Tensor, Var};
use candle_observe::{Kind, Observer, Place, Token};

/// The largest absolute difference of two tensors, in f64.
pub fn max_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    (a.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f64>()
}

/// The largest difference between two stores' gradients of `vars`.
pub fn worst(a: &GradStore, b: &GradStore, vars: &[Var]) -> Result<f64> {
    let mut w = 0f64;
    for v in vars {
        let (x, y) = (a.get(v.as_tensor()), b.get(v.as_tensor()));
        w = w.max(max_diff(x.expect("a gradient"), y.expect("a gradient"))?);
    }
    Ok(w)
}

/// What the observer is told: marks in order, and scopes that nest.
#[derive(Default)]
#[allow(dead_code)] // Not every test file watches a backward.
pub struct Log(pub std::cell::RefCell<Vec<String>>);

#[allow(dead_code)] // Not every test file reads the marks alone.
impl Log {
    /// The marks alone, in order.
    pub fn marks(self) -> Vec<String> {
        self.0
            .into_inner()
            .into_iter()
            .filter(|l| !l.contains('/') && l != "leave")
            .collect()
    }
}

impl Observer for Log {
    fn enter(&self, kind: Kind, place: Place) -> Token {
        self.0.borrow_mut().push(format!("{kind:?}/{place:?}"));
        Token(self.0.borrow().len() as u64)
    }
    fn leave(&self, _: Token) {
        self.0.borrow_mut().push("leave".into());
    }
    fn mark(&self, label: &'static str) {
        self.0.borrow_mut().push(label.into());
    }
}
