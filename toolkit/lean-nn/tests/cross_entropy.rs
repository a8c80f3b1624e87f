//! The one-operation cross-entropy against candle-nn's: value and gradient
//! in every float dtype, bad input, and what the graph holds.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicI64, Ordering};

use candle_core::{DType, Device, Result, Tensor, Var};

struct Counting;

static LIVE: AtomicI64 = AtomicI64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as i64, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as i64, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The tests of this file take turns: the allocator's count is global.
static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn max_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    (a.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f64>()
}

#[test]
fn equal_to_candle_nn_in_every_dtype() -> Result<()> {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::Cpu;
    let targets = Tensor::new(&[3u32, 0, 7, 7, 1], &dev)?;
    for (dtype, tol) in [
        (DType::F64, 1e-12),
        (DType::F32, 1e-6),
        (DType::F16, 4e-3),
        (DType::BF16, 3e-2),
    ] {
        let logits = Var::from_tensor(&Tensor::randn(0f32, 2.0, (5, 9), &dev)?.to_dtype(dtype)?)?;
        // candle-nn's in f64 for f64, in f32 otherwise (the half types'
        // reference too: their arithmetic is f32 here).
        let wide = if dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let reference = Var::from_tensor(&logits.as_tensor().to_dtype(wide)?)?;
        let plain = candle_nn::loss::cross_entropy(&reference, &targets)?;
        let lean = candle_lean_nn::cross_entropy(&logits, &targets)?;
        assert_eq!(lean.dtype(), dtype);
        assert!(max_diff(&plain, &lean)? <= tol, "{dtype:?} value");
        let (gp, gl) = (plain.backward()?, lean.backward()?);
        let g = gl.get(&logits).expect("a gradient for the logits");
        assert_eq!(g.dtype(), dtype);
        let d = max_diff(gp.get(&reference).unwrap(), g)?;
        assert!(d <= tol, "{dtype:?} gradient: {d}");
    }
    Ok(())
}

#[test]
fn bad_input_is_an_error_that_says_why() -> Result<()> {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::Cpu;
    let logits = Tensor::zeros((2, 3), DType::F32, &dev)?;
    let err = |t: &Tensor| {
        candle_lean_nn::cross_entropy(&logits, t)
            .unwrap_err()
            .to_string()
    };
    assert!(err(&Tensor::new(&[1u32, 2, 0], &dev)?)
        .starts_with("targets have shape [3], the logits [2, 3]: one class index per row"));
    assert!(err(&Tensor::new(&[1f32, 2.0], &dev)?)
        .starts_with("targets must be class indices (u8, u32 or i64), got F32"));
    let empty = Tensor::zeros((0, 3), DType::F32, &dev)?;
    let e = candle_lean_nn::cross_entropy(&empty, &Tensor::zeros(0, DType::U32, &dev)?)
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("cross-entropy of 0 rows of 3 classes has no mean"));
    Ok(())
}

/// After the forward, candle-nn's loss graph holds its log-softmax and the
/// intermediates of it beside the logits; the one operation holds nothing
/// the size of the logits.
#[test]
fn the_graph_keeps_no_copy_of_the_logits() -> Result<()> {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::Cpu;
    let (rows, classes) = (256, 4096);
    let logits = Var::from_tensor(&Tensor::randn(0f32, 1.0, (rows, classes), &dev)?)?;
    let targets = Tensor::zeros(rows, DType::U32, &dev)?;
    let size = (rows * classes * 4) as f64;
    let held = |f: &dyn Fn() -> Result<Tensor>| -> Result<f64> {
        let before = LIVE.load(Ordering::SeqCst);
        let loss = f()?;
        let after = LIVE.load(Ordering::SeqCst);
        drop(loss);
        Ok((after - before) as f64 / size)
    };
    let plain = held(&|| candle_nn::loss::cross_entropy(&logits, &targets))?;
    let lean = held(&|| candle_lean_nn::cross_entropy(&logits, &targets))?;
    println!("the loss graph holds {plain:.2} logits-sized tensors with candle-nn, {lean:.3} as one operation");
    assert!(plain >= 1.9, "{plain}");
    assert!(lean < 0.05, "{lean}");
    Ok(())
}
