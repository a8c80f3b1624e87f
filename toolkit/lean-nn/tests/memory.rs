//! What the graph holds after a forward, candle-nn's against the fused
//! layer, the one-operation cross-entropy and the fused linear
//! cross-entropy, counted by an allocator.

use candle_core::{DType, Device, Module, Result, Tensor, Var};
use candle_lean_nn::{Activation, LeanLinear, LinearCrossEntropy};
use candle_toolkit_alloc_count::{measure, Counting};

mod common;
use common::{targets, var};

#[global_allocator]
static ALLOC: Counting = Counting;

const DEPTH: usize = 8;
const WIDTH: usize = 256;
const BATCH: usize = 512;

/// The tests of this file take turns: the allocator's count is global.
static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

/// Bytes alive once `forward` is done, in units of `unit` bytes.
fn held(forward: impl FnOnce() -> Result<Tensor>, unit: usize) -> Result<f64> {
    let (y, usage) = measure(forward);
    drop(y?);
    Ok(usage.held as f64 / unit as f64)
}

#[test]
fn the_fused_layer_keeps_a_third_of_candle_nns_activations_for_relu() -> Result<()> {
    let _turn = turn();
    let dev = Device::Cpu;
    let output = BATCH * WIDTH * 4;
    let layers: Vec<candle_nn::Linear> = (0..DEPTH)
        .map(|_| {
            let w = Var::from_tensor(&Tensor::randn(0f32, 0.05, (WIDTH, WIDTH), &dev)?)?;
            let b = Var::from_tensor(&Tensor::zeros(WIDTH, DType::F32, &dev)?)?;
            Ok(candle_nn::Linear::new(
                w.as_tensor().clone(),
                Some(b.as_tensor().clone()),
            ))
        })
        .collect::<Result<_>>()?;
    let lean: Vec<LeanLinear> = layers.iter().map(LeanLinear::from).collect();
    let x = Tensor::randn(0f32, 1.0, (BATCH, WIDTH), &dev)?;
    for (act, name) in [(Activation::Relu, "relu"), (Activation::Gelu, "gelu")] {
        let plain = held(
            || {
                layers.iter().try_fold(x.clone(), |h, l| {
                    let y = l.forward(&h)?;
                    if act == Activation::Relu {
                        y.relu()
                    } else {
                        y.gelu()
                    }
                })
            },
            output,
        )?;
        let fused = held(
            || {
                lean.iter()
                    .try_fold(x.clone(), |h, l| l.forward_act(&h, act))
            },
            output,
        )?;
        println!(
            "{name}: {DEPTH} layers hold {plain:.2} layer outputs with candle-nn, {fused:.2} fused"
        );
        match act {
            // candle-nn: product, bias sum and output per layer; fused: the output.
            Activation::Relu => {
                assert!((plain - 3.0 * DEPTH as f64).abs() < 0.5, "{plain}");
                assert!((fused - DEPTH as f64).abs() < 0.5, "{fused}");
            }
            // GELU's input is kept too: two per layer.
            _ => {
                assert!((plain - 3.0 * DEPTH as f64).abs() < 0.5, "{plain}");
                assert!((fused - 2.0 * DEPTH as f64).abs() < 0.5, "{fused}");
            }
        }
    }
    Ok(())
}

/// After the forward, candle-nn's loss graph holds its log-softmax and the
/// intermediates of it beside the logits; the one operation holds nothing
/// the size of the logits.
#[test]
fn the_graph_keeps_no_copy_of_the_logits() -> Result<()> {
    let _turn = turn();
    let dev = Device::Cpu;
    let (rows, classes) = (256, 4096);
    let logits = Var::from_tensor(&Tensor::randn(0f32, 1.0, (rows, classes), &dev)?)?;
    let targets = Tensor::zeros(rows, DType::U32, &dev)?;
    let size = rows * classes * 4;
    let plain = held(|| candle_nn::loss::cross_entropy(&logits, &targets), size)?;
    let lean = held(|| candle_lean_nn::cross_entropy(&logits, &targets), size)?;
    println!("the loss graph holds {plain:.2} logits-sized tensors with candle-nn, {lean:.3} as one operation");
    assert!(plain >= 1.9, "{plain}");
    assert!(lean < 0.05, "{lean}");
    Ok(())
}

/// The loss's forward and its gradient, on CPU logits of every float type
/// the row kernels take: the forward allocates nothing the logits' size,
/// and the gradient is the one tensor the backward makes, in the logits'
/// dtype (candle-nn's, and the composed form, make a softmax, a one-hot and
/// their difference beside it, in f32 for the half types).
#[test]
fn the_loss_and_its_gradient_allocate_one_logits_sized_tensor() -> Result<()> {
    let _turn = turn();
    let dev = Device::Cpu;
    let (rows, classes) = (256, 4096);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let x = Tensor::randn(0f32, 1.0, (rows, classes), &dev)?.to_dtype(dtype)?;
        let logits = Var::from_tensor(&x)?;
        let targets = Tensor::zeros(rows, DType::U32, &dev)?;
        let size = (rows * classes * dtype.size_in_bytes()) as f64;
        let (loss, forward) = measure(|| candle_lean_nn::cross_entropy(&logits, &targets));
        let loss = loss?;
        let (grads, backward) = measure(|| loss.backward());
        let g = grads?;
        assert_eq!(g.get(&logits).unwrap().dtype(), dtype);
        let (f, b) = (forward.peak as f64 / size, backward.peak as f64 / size);
        println!("{dtype:?}: logits-sized tensors at the peak: forward {f:.3}, backward {b:.3}");
        // A row of exponentials, and for the half types the row widened to
        // f32, for each worker of the pool; then a fiftieth of the logits
        // for the rest.
        let rows_of_scratch = if dtype == DType::F32 { 1 } else { 2 };
        let scratch = rayon::current_num_threads() * rows_of_scratch * classes * 4;
        assert!(
            (forward.peak as f64) < scratch as f64 + size / 50.0,
            "{dtype:?}: {} B, {scratch} B of them scratch",
            forward.peak
        );
        // The gradient, and candle's backward summing it into a zeros
        // tensor: at most three at once.
        assert!(b < 3.05, "{dtype:?}: {b}");
        // Without candle's graph, the gradient is the one tensor.
        let (direct, usage) =
            measure(|| candle_lean_nn::cross_entropy_and_grad(&logits, &targets, 1.0));
        let (_, grad) = direct?;
        assert_eq!(grad.dims(), [rows, classes]);
        assert_eq!(grad.dtype(), dtype);
        let d = usage.peak as f64 / size;
        println!("{dtype:?}: cross_entropy_and_grad: {d:.3} logits-sized tensors at the peak");
        assert!(d < 1.05, "{dtype:?}: {d}");
    }
    Ok(())
}

/// A bf16 layer on the CPU: candle widens a bf16 product's operands and
/// result to f32 whole; the layer's product goes a slice at a time, so the
/// forward's peak is what it keeps (output and GELU's input), and its
/// backward's the gradients it makes, the weight
/// in f32 and a few slices (GELU's derivative taken row by row).
#[test]
fn a_bf16_layer_widens_a_slice_at_a_time() -> Result<()> {
    let _turn = turn();
    let dev = Device::Cpu;
    let (batch, width) = (4096, 512);
    let output = batch * width * 2;
    let weight_f32 = width * width * 4;
    // Two slices of 256 rows in f32, and bookkeeping.
    let slices = 2 * 256 * width * 4 + 65_536;
    let w = Tensor::randn(0f32, 0.05, (width, width), &dev)?.to_dtype(DType::BF16)?;
    let b = Tensor::zeros(width, DType::BF16, &dev)?;
    let layer = LeanLinear::new(w.clone(), Some(b))?;
    let x = Tensor::randn(0f32, 1.0, (batch, width), &dev)?.to_dtype(DType::BF16)?;
    // Once unmeasured: `gemm` gives each thread a packing buffer the first
    // time it multiplies, and keeps it.
    {
        let (_, kept) = layer.forward_saved(&x, Activation::Gelu)?;
        let grad = Tensor::ones((batch, width), DType::BF16, &dev)?;
        layer.backward_saved(&x, kept, grad, true)?;
    }
    let (saved, forward) = measure(|| layer.forward_saved(&x, Activation::Gelu));
    drop(saved?);
    println!(
        "forward: {} B at the peak, {} B held after",
        forward.peak, forward.held
    );
    // What it keeps, the output and GELU's input: the weight in f32 and
    // the slices come and go before GELU's output is made.
    assert!(forward.peak < (2 * output + 65_536) as isize);
    let (_, candle) = measure(|| x.matmul(&w.t()?));
    println!(
        "candle's bf16 product alone: {:.2} outputs at the peak",
        candle.peak as f64 / output as f64
    );
    // GELU's derivative row by row in f32: as below, with the product's
    // gradient and a few rows of scratch per worker.
    let (saved, _) = measure(|| layer.forward_saved(&x, Activation::Gelu));
    let (out, kept) = saved?;
    let grad = Tensor::ones((batch, width), DType::BF16, &dev)?;
    let (grads, backward) = measure(|| layer.backward_saved(&x, kept, grad, true));
    drop((grads?, out));
    println!("GELU backward: {} B at the peak", backward.peak);
    assert!(
        backward.peak < (2 * output + 3 * weight_f32 + slices) as isize,
        "{}",
        backward.peak
    );
    let (saved, _) = measure(|| layer.forward_saved(&x, Activation::Identity));
    let (_out, kept) = saved?;
    let grad = Tensor::ones((batch, width), DType::BF16, &dev)?;
    let (grads, backward) = measure(|| layer.backward_saved(&x, kept, grad, true));
    let (dx, dw, db) = grads?;
    assert_eq!(
        (dx.map(|t| t.dtype()), dw.dtype()),
        (Some(DType::BF16), DType::BF16)
    );
    assert!(db.is_some());
    println!("backward: {} B at the peak", backward.peak);
    // The input's gradient, the weight in f32, the weight's gradient as
    // an f32 sum, a slice's f32 product and bf16, and slices.
    assert!(
        backward.peak < (output + 3 * weight_f32 + slices) as isize,
        "{}",
        backward.peak
    );
    Ok(())
}

#[test]
fn the_fused_loss_never_holds_the_logits() -> Result<()> {
    let _turn = turn();
    // A real vocabulary (SmolLM2's) over 256 rows of a narrow model.
    let (rows, h, classes) = (256, 64, 49_152);
    let logits_bytes = (rows * classes * 4) as isize;
    let hidden = var(&[rows, h], 1.0, 37, DType::F32)?;
    let weight = var(&[classes, h], 0.1, 41, DType::F32)?;
    let t = targets(rows, classes)?;
    let weight_bytes = (classes * h * 4) as isize;
    let fused = LinearCrossEntropy::new().chunk_rows(4);
    let chunk = fused.rows_per_chunk(rows, h, classes);
    assert_eq!(chunk, 4);
    let chunk_bytes = (chunk * classes * 4) as isize;

    // Plain: the logits live until the backward, and their gradient beside
    // them.
    let (grads, plain) = measure(|| -> Result<_> {
        let loss = candle_lean_nn::cross_entropy(&hidden.matmul(&weight.t()?)?, &t)?;
        loss.backward()
    });
    drop(grads?);
    assert!(plain.peak >= 2 * logits_bytes, "plain peak {}", plain.peak);

    // Fused, forward: the graph holds no tensor beyond a scalar.
    let (loss, forward) = measure(|| fused.loss(&hidden, &weight, &t));
    let loss = loss?;
    assert!(
        forward.held < 1024,
        "the forward holds {} bytes",
        forward.held
    );
    assert!(
        forward.peak < 4 * chunk_bytes,
        "the forward peaked at {} bytes, a chunk's logits are {chunk_bytes}",
        forward.peak
    );
    // Backward: the hidden states' gradient in parts before they are
    // joined, a chunk's logits and their gradient, and the weight's
    // gradient twice (the running sum and a chunk's part, added in place);
    // candle's backward then adds each gradient into a zeros tensor of its
    // size, a third weight-sized tensor.
    let (grads, backward) = measure(|| loss.backward());
    let grads = grads?;
    let dh_bytes = (rows * h * 4) as isize;
    let bound = 3 * weight_bytes + 2 * dh_bytes + 4 * chunk_bytes;
    assert!(
        backward.peak <= bound,
        "the backward peaked at {} bytes, bound {bound}",
        backward.peak
    );
    assert!(
        backward.peak * 5 < plain.peak,
        "fused {} plain {}",
        backward.peak,
        plain.peak
    );
    drop(grads);
    // The one-pass form, with no graph: no zeros tensor.
    let (direct, one_pass) = measure(|| fused.loss_and_grads(&hidden, &weight, &t, 1.0));
    let bound = 2 * weight_bytes + 2 * dh_bytes + 4 * chunk_bytes;
    assert!(
        one_pass.peak <= bound,
        "the one-pass form peaked at {} bytes, bound {bound}",
        one_pass.peak
    );
    // What it hands back: the two gradients (and tensor headers).
    let kept = one_pass.held - weight_bytes - dh_bytes;
    assert!((0..4096).contains(&kept), "held {} bytes", one_pass.held);
    drop(direct?);
    Ok(())
}
