//! The cell's heavy function through the toolkit's checkpointing: exact
//! gradients for a parameter every segment shares. (The technique's own
//! tests are in the candle-checkpoint crate.)

use candle_checkpoint::Sequential;
use candle_core::{Device, Module, Tensor, Var};
use workbook_checkpointing::Heavy;
use workbook_sdk::observe::Tags;

#[test]
fn a_parameter_shared_by_every_segment_gets_the_sum_of_its_gradients() {
    let dev = Device::Cpu;
    let a = Var::new(1f32, &dev).unwrap();
    let layers: Vec<Heavy> = (0..50).map(|_| Heavy::new(a.clone(), 10)).collect();
    let x = Var::new(0f32, &dev).unwrap();
    let head = |h: &Tensor| h.sqr();
    let y = layers
        .iter()
        .try_fold(x.as_tensor().clone(), |h, l| l.forward(&h))
        .unwrap();
    let plain = head(&y).unwrap().backward().unwrap();
    let out = Sequential::new(&layers)
        .segments(50)
        .observer(&Tags)
        .backward(x.as_tensor(), std::slice::from_ref(&a), head)
        .unwrap();
    // y = x + 500 a, loss = y^2: d/da = 2 * y * 500 = 500,000 at a = 1, x = 0.
    let grad = |g: &candle_core::backprop::GradStore| {
        g.get(a.as_tensor()).unwrap().to_scalar::<f32>().unwrap()
    };
    assert_eq!(grad(&plain), 500_000.0);
    assert_eq!(grad(&out.grads), 500_000.0);
    let input = out.input_grad.expect("a float input has a gradient");
    assert_eq!(input.to_scalar::<f32>().unwrap(), 1_000.0);
}
