//! What a backward keeps beside the graph is noted while a recording lives,
//! and only then; two recordings share the notes until the last is dropped.

use candle_core::{Device, Result, Tensor};
use candle_custom_grad::kept::Recording;
use candle_custom_grad::{with_backward2, Backward2};

/// A product whose backward keeps a tensor of its own.
struct Keeps(Tensor);

impl Backward2 for Keeps {
    fn kept(&self) -> Vec<Tensor> {
        vec![self.0.clone()]
    }

    fn backward(
        &self,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad.clone()), Some(grad.clone())))
    }
}

fn op(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let kept = Tensor::zeros(5, candle_core::DType::F32, &Device::Cpu)?;
    with_backward2((a * b)?, [a, b], Keeps(kept))
}

#[test]
fn noted_only_while_recording_and_shared_by_two_recordings() -> Result<()> {
    let a = Tensor::ones(3, candle_core::DType::F32, &Device::Cpu)?;
    let before = op(&a, &a)?;
    let first = Recording::start();
    assert!(
        first.kept_by(&before).is_empty(),
        "made before the recording"
    );
    let y = op(&a, &a)?;
    assert_eq!(first.kept_by(&y)[0].dims(), [5]);
    let second = Recording::start();
    let z = op(&a, &a)?;
    drop(first);
    // The second recording still sees what both noted.
    assert_eq!(second.kept_by(&y).len(), 1);
    assert_eq!(second.kept_by(&z).len(), 1);
    drop(second);
    let third = Recording::start();
    assert!(
        third.kept_by(&y).is_empty(),
        "the notes went with the last recording"
    );
    Ok(())
}
