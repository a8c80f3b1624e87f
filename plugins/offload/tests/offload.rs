//! The toolkit's HostAdamW and layer-wise backward as the cell uses them:
//! against candle_nn::AdamW and plain backprop, and where the meter files
//! the bytes.

use candle_checkpoint::Sequential;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use candle_offload::HostAdamW;
use workbook_models::{
    cross_entropy, grads_max_abs_diff, max_abs_diff, param_grads, Activation, Layer, Mlp, Rng,
};
use workbook_sdk::meter::{Category, CountingAllocator, CpuMeter, Meter};
use workbook_sdk::observe::Tags;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// The meter is process-wide: tests that read it take turns.
static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

fn setup(seed: u64) -> (Mlp, Tensor, Tensor) {
    let dev = Device::Cpu;
    let mut rng = Rng::seeded(seed);
    let m = Mlp::stack(&mut rng, 24, 3, Activation::Relu, DType::F32, &dev).unwrap();
    let x = rng.randn((8, 24), &dev).unwrap();
    let y = rng.labels(8, 24, &dev).unwrap();
    (m, x, y)
}

#[test]
fn host_adamw_equals_candles_adamw_after_ten_steps() {
    let _turn = turn();
    let (model, x, y) = setup(1);
    let twin = model.deep_clone().unwrap();
    let params = ParamsAdamW {
        lr: 1e-2,
        weight_decay: 0.1,
        ..Default::default()
    };
    let mut host = HostAdamW::new(model.vars(), params.clone()).unwrap();
    let mut reference = AdamW::new(twin.vars(), params).unwrap();
    for _ in 0..10 {
        host.backward_step(&cross_entropy(&model.forward(&x).unwrap(), &y).unwrap())
            .unwrap();
        reference
            .backward_step(&cross_entropy(&twin.forward(&x).unwrap(), &y).unwrap())
            .unwrap();
    }
    for (a, b) in model.vars().iter().zip(twin.vars().iter()) {
        let d = max_abs_diff(a.as_tensor(), b.as_tensor()).unwrap();
        assert!(d < 1e-6, "parameters differ by {d}");
    }
    let (fresh, _, _) = setup(1);
    assert!(
        max_abs_diff(fresh.vars()[0].as_tensor(), model.vars()[0].as_tensor()).unwrap() > 1e-3,
        "the model trained"
    );
    // Set-up copies each parameter to the host once, as the f32 masters;
    // then each step: every gradient to the host, every parameter back.
    let bytes: u64 = model.vars().iter().map(|v| v.elem_count() as u64 * 4).sum();
    let t = host.transfers();
    assert_eq!(
        (t.to_host_bytes, t.to_device_bytes),
        (11 * bytes, 10 * bytes)
    );
}

#[test]
fn host_adamw_keeps_no_optimizer_state_on_the_device() {
    let _turn = turn();
    let (model, _, _) = setup(2);
    let meter = CpuMeter::new().unwrap();
    let before = meter.snapshot();
    let opt = HostAdamW::on(model.vars(), ParamsAdamW::default(), Device::Cpu, Tags).unwrap();
    let after = meter.snapshot();
    let state = |s: &workbook_sdk::meter::MemorySnapshot, host: bool| {
        let h = s.host.get(Category::OptimizerState);
        if host {
            h
        } else {
            s.current.get(Category::OptimizerState) - h
        }
    };
    let data: u64 = model.vars().iter().map(|v| v.elem_count() as u64 * 4).sum();
    assert_eq!(
        state(&after, false),
        state(&before, false),
        "nothing on the device"
    );
    let host = state(&after, true) - state(&before, true);
    // Three tensors per variable, each with a few hundred bytes of candle's
    // own bookkeeping beside its data.
    let tensors = 3 * model.vars().len() as u64;
    assert!(
        host >= 3 * data && host < 3 * data + 512 * tensors,
        "f32 masters and two moments on the host: {host} for {data}"
    );
    drop(opt);
}

struct Unit(Vec<Layer>);
impl Module for Unit {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.0.iter().try_fold(x.clone(), |h, l| l.forward(&h))
    }
}

/// Units cut as [Linear] [ReLU, Linear] [ReLU, Linear] ...: every unit but
/// the first begins with an operation that uses no parameter, which the old
/// layer-wise backward refused.
fn units(model: &Mlp) -> Vec<Unit> {
    let all = model.layers().to_vec();
    let mut out = vec![Unit(all[..1].to_vec())];
    out.extend(all[1..].chunks(2).map(|c| Unit(c.to_vec())));
    out
}

#[test]
fn layerwise_gradients_equal_plain_backprop() {
    let (model, x, y) = setup(3);
    let plain_loss = cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
    let plain = param_grads(&plain_loss.backward().unwrap(), &model.vars());
    let layers = units(&model);
    let mut got = GradStore::default();
    let mut order = Vec::new();
    let loss = Sequential::new(&layers)
        .each_layer()
        .observer(&Tags)
        .backward_with(
            &x,
            &model.vars(),
            |h| cross_entropy(h, &y),
            |v, g| {
                order.push(v.as_tensor().id());
                got.insert(v.as_tensor(), g);
                Ok(())
            },
        )
        .map(|(loss, _)| loss)
        .unwrap();
    assert_eq!(
        loss.to_scalar::<f32>().unwrap(),
        plain_loss.to_scalar::<f32>().unwrap()
    );
    assert!(grads_max_abs_diff(&plain, &got, &model.vars()).unwrap() < 1e-6);
    assert_eq!(order.len(), model.vars().len(), "each gradient once");
    // Last layer first: its gradients are handed over before the first layer's.
    let last = model.vars().last().unwrap().as_tensor().id();
    let first = model.vars()[0].as_tensor().id();
    let pos = |id| order.iter().position(|&o| o == id).unwrap();
    assert!(pos(last) < pos(first));
}
