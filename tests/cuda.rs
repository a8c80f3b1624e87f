//! The CUDA meter: the interposed driver calls counting each buffer under
//! its allocator's category, and on a real GPU a tensor's bytes counted
//! exactly, with the memory pool's own figures agreeing; `--max-memory`'s
//! device cap. And the toolkit on the GPU: LeanAdamW's update in place,
//! equal to candle_nn's AdamW; the accumulator's sum in place, equal to
//! candle's addition; the materialized attention's softmax and its backward
//! in place, equal to candle's composed operations and holding fewer
//! matrices than they do; the tiled attention's own kernels, equal to the
//! plain computation and holding no score matrix; the cross-entropy's own
//! kernels, within rounding of the CPU's rows and holding only the
//! gradient.
//!
//! Built with `--features cuda`. Where no GPU answers, the GPU tests say so
//! and pass, unless `WORKBOOK_REQUIRE_GPU` is set: then they fail. With
//! `WORKBOOK_FAKE_DRIVER` set, the process runs against the stand-in driver
//! that `scripts/build-cuda.sh check` builds (allocations backed by host
//! memory, every other call failing), so the interposer is tested without a
//! GPU.
#![cfg(feature = "cuda")]

use std::sync::{Mutex, MutexGuard};

use candle_core::cuda_backend::cudarc::driver::{result, sys};
use candle_core::{DType, Device, Tensor};
use workbook_sdk::meter::cuda::CudaMeter;
use workbook_sdk::meter::{self, Category, CountingAllocator, CpuMeter, MemorySnapshot, Meter};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// The counts and peaks are process-wide: the tests take turns.
static TURN: Mutex<()> = Mutex::new(());

fn turn() -> MutexGuard<'static, ()> {
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

/// The first GPU and a meter over it, or `None` where no GPU answers.
fn gpu() -> Option<(Device, CudaMeter)> {
    match Device::new_cuda(0) {
        Ok(device) => {
            let Device::Cuda(cuda) = &device else {
                unreachable!("new_cuda gives a CUDA device")
            };
            let meter = CudaMeter::new(cuda.cuda_stream()).expect("the meter reads the device");
            Some((device, meter))
        }
        Err(e) => {
            let why = e.to_string();
            let why = why.lines().next().unwrap_or_default();
            assert!(
                std::env::var_os("WORKBOOK_REQUIRE_GPU").is_none(),
                "WORKBOOK_REQUIRE_GPU is set but no CUDA GPU answered: {why}"
            );
            eprintln!("skipped: no CUDA GPU answered ({why})");
            None
        }
    }
}

/// For the tests of the driver calls themselves: the stand-in driver
/// (`Some(None)`), else the first GPU and its meter, whose binding of a
/// context a real driver needs; `None` where neither is there.
fn driver() -> Option<Option<(Device, CudaMeter)>> {
    match std::env::var_os("WORKBOOK_FAKE_DRIVER") {
        Some(_) => Some(None),
        None => gpu().map(Some),
    }
}

/// Device-resident bytes of one category.
fn on_device(s: &MemorySnapshot, c: Category) -> u64 {
    s.current.get(c) - s.host.get(c)
}

#[test]
fn driver_allocations_are_counted_under_the_callers_category_and_frees_charged_to_it() {
    let _turn = turn();
    let Some(_gpu) = driver() else { return };
    let device = |c| {
        let s = CpuMeter::new()
            .expect("the allocator is installed")
            .snapshot();
        on_device(&s, c)
    };
    let (a, g) = (Category::Activations, Category::Gradients);
    let (a0, g0) = (device(a), device(g));
    let stream: sys::CUstream = std::ptr::null_mut();
    let pooled = a
        .scope(|| unsafe { result::malloc_async(stream, 1 << 20) })
        .expect("cuMemAllocAsync");
    let plain = g
        .scope(|| unsafe { result::malloc_sync(3_000) })
        .expect("cuMemAlloc");
    assert_eq!(
        device(a) - a0,
        1 << 20,
        "the interposer's own map is not counted"
    );
    assert_eq!(device(g) - g0, 3_000);
    // Freed while another category is current: charged to the allocator's.
    Category::Inputs
        .scope(|| unsafe { result::free_async(pooled, stream) })
        .expect("cuMemFreeAsync");
    Category::Inputs
        .scope(|| unsafe { result::free_sync(plain) })
        .expect("cuMemFree");
    assert_eq!((device(a), device(g)), (a0, g0));
}

#[test]
fn past_the_device_cap_an_allocation_fails_as_on_a_full_card_and_is_not_counted() {
    let _turn = turn();
    let Some(_gpu) = driver() else { return };
    let held = || {
        let s = CpuMeter::new()
            .expect("the allocator is installed")
            .snapshot();
        on_device(&s, Category::Activations)
    };
    let stream: sys::CUstream = std::ptr::null_mut();
    let _ = meter::take_device_refusal();
    let before = held();
    // Room for one MiB above what the device holds now.
    let others = meter::device_held();
    meter::set_device_limit(Some(others + (1 << 20)));
    let a = Category::Activations;
    let fits = a
        .scope(|| unsafe { result::malloc_async(stream, 768 << 10) })
        .expect("768 KiB fits under the cap");
    let refused = a.scope(|| unsafe { result::malloc_async(stream, 512 << 10) });
    let refused_sync = a.scope(|| unsafe { result::malloc_sync(512 << 10) });
    meter::set_device_limit(None);
    let counted = held() - before;
    let refusal = meter::take_device_refusal();
    let after_cap = a
        .scope(|| unsafe { result::malloc_async(stream, 512 << 10) })
        .expect("without the cap it fits");
    unsafe { result::free_async(after_cap, stream) }.unwrap();
    unsafe { result::free_async(fits, stream) }.unwrap();

    for (what, r) in [("async", refused.err()), ("sync", refused_sync.err())] {
        assert_eq!(
            r.map(|e| e.0),
            Some(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY),
            "the {what} allocation past the cap"
        );
    }
    assert_eq!(counted, 768 << 10, "a refused allocation is not counted");
    assert_eq!(
        refusal,
        Some(meter::DeviceRefusal {
            bytes: 512 << 10,
            held: others + (768 << 10),
            limit: others + (1 << 20),
        }),
        "the first refusal is kept"
    );
    assert_eq!(meter::take_device_refusal(), None, "and taken once");
    assert_eq!(held(), before);
    assert_eq!(meter::device_held(), others);
}

#[test]
fn a_tensor_past_the_device_cap_is_candles_out_of_memory_error() {
    let _turn = turn();
    let Some((device, _meter)) = gpu() else {
        return;
    };
    let _ = meter::take_device_refusal();
    let others = meter::device_held();
    meter::set_device_limit(Some(others + (8 << 20)));
    let small = Tensor::zeros(1 << 20, DType::F32, &device);
    let big = Tensor::zeros(4 << 20, DType::F32, &device);
    meter::set_device_limit(None);
    assert!(small.is_ok(), "4 MiB fits under an 8 MiB cap");
    let error = big.expect_err("16 MiB does not").to_string();
    assert!(error.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{error}");
    assert_eq!(
        meter::take_device_refusal(),
        Some(meter::DeviceRefusal {
            bytes: 16 << 20,
            held: others + (4 << 20),
            limit: others + (8 << 20),
        })
    );
}

#[test]
fn a_gpu_tensor_is_counted_exactly_under_its_category_and_the_pool_agrees() {
    let _turn = turn();
    let Some((device, meter)) = gpu() else { return };
    assert_eq!(
        meter.name(),
        "cuda-pool",
        "an H100 or H200 has memory pools"
    );
    workbook_sdk::device::warm_up(&device).expect("the GPU computes");

    meter.push_peak();
    let start = meter.snapshot();
    let c = Category::Activations;
    let t = c
        .scope(|| Tensor::zeros((1000, 1000), DType::F32, &device))
        .expect("a 4 MB tensor fits");
    let live = meter.snapshot();
    assert_eq!(on_device(&live, c) - on_device(&start, c), 4_000_000);
    let (p0, p1) = (start.pool.unwrap(), live.pool.unwrap());
    let grown = p1.used - p0.used;
    // The pool hands out whole pages: at least the tensor, at most 2 MiB more.
    assert!(
        (4_000_000..4_000_000 + (2 << 20)).contains(&grown),
        "the pool grew by {grown} bytes for a 4,000,000-byte tensor"
    );
    assert!(p1.reserved >= p1.used);

    drop(t);
    let end = meter.snapshot();
    assert_eq!(on_device(&end, c), on_device(&start, c));
    let p2 = end.pool.unwrap();
    assert_eq!(p2.used, p0.used, "the free reached the pool");
    assert!(
        p2.used_high >= p0.used + 4_000_000,
        "the high-water mark kept it"
    );
    assert_eq!(
        end.device_peak_each.get(c) - on_device(&start, c),
        4_000_000
    );
}

#[test]
fn host_memory_stays_with_the_allocator_when_tensors_live_on_the_gpu() {
    let _turn = turn();
    let Some((_device, meter)) = gpu() else {
        return;
    };
    let c = Category::OptimizerState;
    let start = meter.snapshot();
    let host = c
        .scope(|| Tensor::zeros((500, 1000), DType::F32, &Device::Cpu))
        .unwrap();
    let s = meter.snapshot();
    assert!(s.host.get(c) - start.host.get(c) >= 2_000_000);
    assert_eq!(on_device(&s, c), on_device(&start, c));
    drop(host);
}

/// Normal values of standard deviation `std` in `dtype` (drawn in f32).
fn randn(shape: impl Into<candle_core::Shape>, std: f32, dtype: DType, device: &Device) -> Tensor {
    Tensor::randn(0f32, std, shape, device)
        .and_then(|t| t.to_dtype(dtype))
        .unwrap()
}

/// A tensor's elements in f64, which holds every value of the other float
/// types exactly: equal vectors are equal values (a zero's sign aside).
fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f64>())
        .unwrap()
}

/// A tensor's elements' bits, through f64 (exact for every float type):
/// equal vectors are equal elements, a zero's sign and a NaN's included.
fn bits(t: &Tensor) -> Vec<u64> {
    values(t).into_iter().map(f64::to_bits).collect()
}

/// The largest difference between two tensors relative to each element
/// (`elementwise`), or relative to the largest element (normwise), in f64.
fn rel_diff(a: &Tensor, b: &Tensor, elementwise: bool) -> f64 {
    let (a, b) = (
        a.to_dtype(DType::F64).unwrap(),
        b.to_dtype(DType::F64).unwrap(),
    );
    let max = |t: &Tensor| {
        t.flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    };
    let diff = (&a - &b).unwrap().abs().unwrap();
    if elementwise {
        max(&(diff / (b.abs().unwrap() + 1e-12).unwrap()).unwrap())
    } else {
        max(&diff) / max(&b.abs().unwrap())
    }
}

#[test]
fn lean_adamw_updates_in_place_on_the_gpu_as_candle_nn_adamw_does() {
    use candle_core::backprop::GradStore;
    use candle_core::Var;
    use candle_nn::{AdamW, Optimizer, ParamsAdamW};
    let _turn = turn();
    let Some((device, meter)) = gpu() else { return };
    let params = ParamsAdamW {
        lr: 0.01,
        weight_decay: 0.1,
        ..Default::default()
    };
    // f32 and f64 element by element. The half types compute in f32 and
    // round once, where candle's composed operations round after each
    // operation: up to about 1.5 units of the weight's last place apart per
    // step, so normwise within 4 epsilons a step (an element near zero
    // after a step of about lr can differ by more than itself).
    // Their machine epsilons: 10 and 7 bits of fraction.
    let (f16_eps, bf16_eps) = (2f64.powi(-10), 2f64.powi(-7));
    for (dtype, elementwise, tolerance) in [
        (DType::F32, true, 1e-6),
        (DType::F64, true, 1e-12),
        (DType::F16, false, 4.0 * f16_eps),
        (DType::BF16, false, 4.0 * bf16_eps),
    ] {
        let w0 = randn((257, 33), 1.0, dtype, &device);
        let lean_w = Var::from_tensor(&w0.copy().unwrap()).unwrap();
        let plain_w = Var::from_tensor(&w0.copy().unwrap()).unwrap();
        let mut lean =
            candle_lean_optim::LeanAdamW::new(vec![lean_w.clone()], params.clone()).unwrap();
        let mut plain = AdamW::new(vec![plain_w.clone()], params.clone()).unwrap();
        let c = Category::OptimizerState;
        for step in 1..=3 {
            // Gradients at least 0.1 in size: in f16 a smaller one's square
            // times 1 - beta2 underflows to 0, and candle_nn's AdamW then
            // divides by sqrt(0) + eps, itself 0 in f16, to an infinite
            // weight (an H200 showed it; f16 training keeps f32 masters).
            let r = Tensor::randn(0f32, 1.0, (257, 33), &device).unwrap();
            let g = ((r.abs().unwrap() + 0.1).unwrap() * r.sign().unwrap())
                .and_then(|t| t.to_dtype(dtype))
                .unwrap();
            let (mut lean_g, mut plain_g) = (GradStore::default(), GradStore::default());
            lean_g.insert(lean_w.as_tensor(), g.clone());
            plain_g.insert(plain_w.as_tensor(), g);
            device.synchronize().unwrap();
            meter.push_peak();
            let start = meter.snapshot();
            c.scope(|| lean.step(&lean_g)).unwrap();
            device.synchronize().unwrap();
            let end = meter.snapshot();
            meter.pop_peak();
            // The moments were made with the optimizer: a step allocates
            // nothing (candle_nn's allocates each moment and more anew).
            let allocated = end.device_peak_each.get(c) - on_device(&start, c);
            assert_eq!(
                allocated, 0,
                "{dtype:?}: step {step} allocated {allocated} bytes"
            );
            plain.step(&plain_g).unwrap();
            let diff = rel_diff(lean_w.as_tensor(), plain_w.as_tensor(), elementwise);
            let tolerance = if elementwise {
                tolerance
            } else {
                tolerance * step as f64
            };
            assert!(
                diff <= tolerance,
                "{dtype:?}: after step {step} the weights differ by {diff:e} (relative)"
            );
        }
    }
}

#[test]
fn accumulated_gradients_join_the_sum_in_place_on_the_gpu_with_candles_bits() {
    use candle_accumulate::GradAccumulator;
    use candle_core::Var;
    let _turn = turn();
    let Some((device, _meter)) = gpu() else {
        return;
    };
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        // 1003 elements: not a multiple of the kernel's vector width, so
        // its scalar tail runs too.
        let w = Var::zeros(1003, dtype, &device).unwrap();
        let grad = |seed: f64, len: usize| {
            (Tensor::arange(0f32, len as f32, &device).unwrap() * seed)
                .unwrap()
                .sin()
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
        };
        // The sum starts as a view three elements into its buffer: an
        // address the vector loads cannot take.
        let first = grad(0.37, 1006).narrow(0, 3, 1003).unwrap();
        let gs = [first, grad(1.91, 1003), grad(-2.3, 1003)];
        // candle's own sum, the order the accumulator adds in.
        let plain = ((&gs[0] + &gs[1]).unwrap() + &gs[2]).unwrap();
        let first_id = gs[0].id();
        let mut acc = GradAccumulator::new(vec![w.clone()], 3);
        for g in gs {
            acc.add_weighted_with(1, |add| add(&w, g)).unwrap();
        }
        let total = acc.grads().unwrap().get(w.as_tensor()).unwrap().clone();
        assert_eq!(
            total.id(),
            first_id,
            "{dtype:?}: added into the first gradient"
        );
        assert_eq!(bits(&total), bits(&plain), "{dtype:?}: candle's bits");
    }
}

/// candle's composed operations for the materialized attention with one
/// group of heads: the probabilities, and the gradients of `q`, `k` and `v`
/// for `d_out`, computed as the attention computed them before its softmax
/// and softmax backward ran in place on a GPU.
fn composed_attention(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    d_out: &Tensor,
    scale: f64,
    causal: bool,
) -> (Tensor, [Tensor; 3]) {
    let (nq, nk) = (q.dim(2).unwrap(), k.dim(2).unwrap());
    let kt = k.transpose(2, 3).unwrap().contiguous().unwrap();
    let mut scores = (q.matmul(&kt).unwrap() * scale).unwrap();
    if causal {
        // Top-left aligned: query i sees keys 0..=i.
        let mask: Vec<f32> = (0..nq)
            .flat_map(|i| (0..nk).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        let mask = Tensor::from_vec(mask, (nq, nk), q.device())
            .and_then(|m| m.to_dtype(q.dtype()))
            .unwrap();
        scores = scores.broadcast_add(&mask).unwrap();
    }
    let p = candle_nn::ops::softmax_last_dim(&scores).unwrap();
    let dv = p.transpose(2, 3).unwrap().matmul(d_out).unwrap();
    let dp = d_out.matmul(&v.transpose(2, 3).unwrap()).unwrap();
    let delta = (&dp * &p).unwrap().sum_keepdim(3).unwrap();
    let ds = ((dp.broadcast_sub(&delta).unwrap() * &p).unwrap() * scale).unwrap();
    let dq = ds.matmul(k).unwrap();
    let dk = ds.transpose(2, 3).unwrap().matmul(q).unwrap();
    (p, [dq, dk, dv])
}

#[test]
fn the_materialized_attentions_softmax_and_its_backward_run_in_place_on_the_gpu() {
    use candle_core::Var;
    use candle_tiled_attention::{materialized_attention, materialized_forward, FlashConfig};
    let _turn = turn();
    let Some((device, meter)) = gpu() else { return };
    // 2 x 3 heads of 40 queries and 53 keys: 240 rows, whose row sums are
    // taken 32 rows at a time (the last block 16), and rows of a length no
    // vector width divides.
    let (b, h, nq, nk, d) = (2, 3, 40, 53, 16);
    let scale = 1.0 / (d as f64).sqrt();
    let c = Category::Activations;
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let size = dtype.size_in_bytes() as u64;
        let matrix = (b * h * nq * nk) as u64 * size;
        let per_head = |n: usize| (b * h * n * d) as u64 * size;
        // The gradients may come from other cuBLAS kernels than the
        // reference's (same products, other addresses), so they are held
        // to their arithmetic's rounding, not to the bit. A race in place
        // would be off by far more.
        let tolerance = match dtype {
            DType::F32 => 1e-5,
            DType::F64 => 1e-12,
            _ => 1e-2,
        };
        for causal in [false, true] {
            let r = |n: usize| randn((b, h, n, d), 1.0, dtype, &device);
            let (q, k, v, d_out) = (r(nq), r(nk), r(nk), r(nq));
            // First, so that cuBLAS has made its workspace before the meter
            // looks.
            let (p_want, grads_want) = composed_attention((&q, &k, &v), &d_out, scale, causal);
            let cfg = FlashConfig::causal(causal);

            device.synchronize().unwrap();
            meter.push_peak();
            let start = meter.snapshot();
            let fwd = c.scope(|| materialized_forward(&q, &k, &v, &cfg)).unwrap();
            device.synchronize().unwrap();
            let forward_peak = meter.snapshot().device_peak_each.get(c) - on_device(&start, c);
            meter.pop_peak();
            let what = format!("{dtype:?}, causal {causal}");
            assert_eq!(bits(&fwd.probs), bits(&p_want), "{what}: candle's bits");
            // The scores, made in place into the probabilities; beside them
            // one at a time the transposed keys' copy, the output or, when
            // causal, the mask (made in f32 and then converted); and the
            // kernels' few bytes of dimensions and strides. candle's
            // composed operations hold two matrices at once, more than this.
            let mask = if causal {
                (nq * nk) as u64 * (4 + size)
            } else {
                0
            };
            let bound = matrix + per_head(nk).max(per_head(nq)).max(mask) + 1024;
            assert!(
                (matrix..=bound).contains(&forward_peak),
                "{what}: the forward's peak {forward_peak} bytes, for a {matrix}-byte matrix (at most {bound})"
            );

            meter.push_peak();
            let start = meter.snapshot();
            let grads = c.scope(|| fwd.backward(&q, &k, &v, &d_out)).unwrap();
            device.synchronize().unwrap();
            let backward_peak = meter.snapshot().device_peak_each.get(c) - on_device(&start, c);
            meter.pop_peak();
            for (name, got, want) in [
                ("dq", &grads.0, &grads_want[0]),
                ("dk", &grads.1, &grads_want[1]),
                ("dv", &grads.2, &grads_want[2]),
            ] {
                let diff = rel_diff(got, want, false);
                assert!(
                    diff <= tolerance,
                    "{what}: {name} off by {diff:e} (normwise)"
                );
            }
            // The autograd operation's backward: its scores' gradient is a
            // new tensor (the graph keeps the probabilities' gradient), made
            // in place from there.
            let (qv, kv) = (Var::from_tensor(&q).unwrap(), Var::from_tensor(&k).unwrap());
            let out = materialized_attention(&qv, &kv, &v, &cfg).unwrap();
            let loss = (out.to_dtype(DType::F64).unwrap() * d_out.to_dtype(DType::F64).unwrap())
                .and_then(|t| t.sum_all())
                .unwrap();
            let store = loss.backward().unwrap();
            for (name, var, want) in [("dq", &qv, &grads_want[0]), ("dk", &kv, &grads_want[1])] {
                let got = store.get(var.as_tensor()).unwrap();
                let diff = rel_diff(got, want, false);
                assert!(
                    diff <= tolerance,
                    "{what}: autograd's {name} off by {diff:e}"
                );
            }
            // The probabilities' gradient, the scores' gradient written over
            // it; a block of 32 rows of products, the row sums; the three
            // gradients. The composed operations hold three matrices beside
            // the probabilities.
            let block = 32 * nk as u64 * size;
            let rows = (b * h * nq) as u64 * size;
            let bound = matrix + block + 2 * rows + 2 * per_head(nk) + per_head(nq);
            assert!(
                (matrix..=bound).contains(&backward_peak),
                "{what}: the backward's peak {backward_peak} bytes, for a {matrix}-byte matrix (at most {bound})"
            );
        }
    }
}

#[test]
fn the_tiled_attentions_kernels_match_the_plain_computation_and_hold_no_score_matrix() {
    use candle_core::Var;
    use candle_tiled_attention::{flash_attention, flash_forward, naive_attention, FlashConfig};
    let _turn = turn();
    let Some((device, meter)) = gpu() else { return };
    let c = Category::Activations;
    // (batch, q_heads, kv_heads, nq, nk, head_dim, v_dim): each kernel
    // module (head dimensions padded to 32, 64 and 128), grouped heads,
    // lengths no block divides, more keys than queries, values of another
    // width than the keys.
    for (b, hq, hkv, nq, nk, d, dv) in [
        (2, 4, 2, 300, 300, 64, 64),
        (1, 2, 2, 130, 200, 16, 16),
        (2, 2, 1, 77, 77, 128, 128),
        (1, 4, 1, 90, 60, 80, 48),
    ] {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            // Normwise, against f64: f32 sums throughout, and for the half
            // types the output's rounding, which the backward's
            // rowsum(dO * O) takes in (as FlashAttention's does).
            let tolerance = match dtype {
                DType::F32 => 2e-5,
                DType::F16 => 4e-3,
                _ => 3e-2,
            };
            for causal in [false, true] {
                let what = format!(
                    "{dtype:?}, causal {causal}, {b}x{hq}/{hkv} heads, {nq}x{nk}, d {d}/{dv}"
                );
                let cfg = FlashConfig::causal(causal);
                let (q, k, v, d_out) = (
                    randn((b, hq, nq, d), 1.0, dtype, &device),
                    randn((b, hkv, nk, d), 1.0, dtype, &device),
                    randn((b, hkv, nk, dv), 1.0, dtype, &device),
                    randn((b, hq, nq, dv), 1.0, dtype, &device),
                );
                // The plain computation in f64 on the CPU, through autograd.
                let cpu64 = |t: &Tensor| {
                    Var::from_tensor(
                        &t.to_device(&candle_core::Device::Cpu)
                            .unwrap()
                            .to_dtype(DType::F64)
                            .unwrap(),
                    )
                    .unwrap()
                };
                let (q64, k64, v64) = (cpu64(&q), cpu64(&k), cpu64(&v));
                let want = naive_attention(&q64, &k64, &v64, &cfg).unwrap();
                let grads = (&want * cpu64(&d_out).as_tensor())
                    .and_then(|t| t.sum_all())
                    .and_then(|t| t.backward())
                    .unwrap();
                let want_grads = [&q64, &k64, &v64].map(|t| grads.get(t).unwrap().clone());

                device.synchronize().unwrap();
                meter.push_peak();
                let start = meter.snapshot();
                let fwd = c.scope(|| flash_forward(&q, &k, &v, &cfg)).unwrap();
                device.synchronize().unwrap();
                let forward_peak = meter.snapshot().device_peak_each.get(c) - on_device(&start, c);
                meter.pop_peak();
                let to_cpu = |t: &Tensor| t.to_device(&candle_core::Device::Cpu).unwrap();
                let diff = rel_diff(&to_cpu(&fwd.out), &want, false);
                assert!(
                    diff <= tolerance,
                    "{what}: the output off by {diff:e} (normwise)"
                );

                meter.push_peak();
                let start = meter.snapshot();
                let got = c.scope(|| fwd.backward(&q, &k, &v, &d_out)).unwrap();
                device.synchronize().unwrap();
                let backward_peak = meter.snapshot().device_peak_each.get(c) - on_device(&start, c);
                meter.pop_peak();
                for (name, got, want) in [
                    ("dq", &got.0, &want_grads[0]),
                    ("dk", &got.1, &want_grads[1]),
                    ("dv", &got.2, &want_grads[2]),
                ] {
                    let diff = rel_diff(&to_cpu(got), want, false);
                    assert!(
                        diff <= tolerance,
                        "{what}: {name} off by {diff:e} (normwise)"
                    );
                }

                // The forward holds its output and one f32 per row; the
                // backward its three gradients and one f32 per row. Both
                // far below one score matrix of one head.
                let size = dtype.size_in_bytes() as u64;
                let bytes = |rows: usize, width: usize| (rows * width) as u64 * size;
                let (queries, keys) = (b * hq * nq, b * hkv * nk);
                let out_bytes = bytes(queries, dv);
                let row_floats = queries as u64 * 4;
                let score_matrix = (nq * nk) as u64 * size;
                assert!(
                    (out_bytes..=out_bytes + row_floats + 1024).contains(&forward_peak),
                    "{what}: the forward's peak {forward_peak} bytes, for a {out_bytes}-byte output"
                );
                let grads = bytes(queries, d) + bytes(keys, d) + bytes(keys, dv);
                assert!(
                    (grads..=grads + row_floats + 1024).contains(&backward_peak),
                    "{what}: the backward's peak {backward_peak} bytes, for {grads} bytes of gradients"
                );
                assert!(forward_peak - out_bytes < score_matrix);

                // The autograd operation gives the same gradients.
                let (qv, kv, vv) = (
                    Var::from_tensor(&q).unwrap(),
                    Var::from_tensor(&k).unwrap(),
                    Var::from_tensor(&v).unwrap(),
                );
                let out = flash_attention(&qv, &kv, &vv, &cfg).unwrap();
                let store = (out.to_dtype(DType::F64).unwrap()
                    * d_out.to_dtype(DType::F64).unwrap())
                .and_then(|t| t.sum_all())
                .and_then(|t| t.backward())
                .unwrap();
                let dk = store.get(kv.as_tensor()).unwrap();
                let diff = rel_diff(&to_cpu(dk), &want_grads[1], false);
                assert!(diff <= tolerance, "{what}: autograd's dk off by {diff:e}");
            }
        }
    }
}

#[test]
fn the_lean_layers_bias_and_relu_are_added_in_place_on_the_gpu_with_candles_bits() {
    use candle_lean_nn::{Activation, LeanLinear};
    let _turn = turn();
    let Some((device, meter)) = gpu() else { return };
    // 129 rows of 83 outputs: no vector width divides a row.
    let (rows, inputs, outputs) = (129, 37, 83);
    let c = Category::Activations;
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let r = |shape: (usize, usize)| randn(shape, 1.0, dtype, &device);
        let (x, w) = (r((rows, inputs)), r((outputs, inputs)));
        let b = r((1, outputs)).flatten_all().unwrap();
        let layer = LeanLinear::new(w.clone(), Some(b.clone())).unwrap();
        for act in [Activation::Identity, Activation::Relu] {
            // candle's operations, first: cuBLAS makes its workspace there.
            let mut want = x
                .matmul(&w.t().unwrap())
                .unwrap()
                .broadcast_add(&b)
                .unwrap();
            if act == Activation::Relu {
                want = want.relu().unwrap();
            }
            device.synchronize().unwrap();
            meter.push_peak();
            let start = meter.snapshot();
            // Without a graph: a graph's output is copied once more
            // (`candle_custom_grad::with_backward3` hands it over).
            let (got, _kept) = c.scope(|| layer.forward_saved(&x, act)).unwrap();
            device.synchronize().unwrap();
            let peak = meter.snapshot().device_peak_each.get(c) - on_device(&start, c);
            meter.pop_peak();
            assert_eq!(bits(&got), bits(&want), "{dtype:?}, {act:?}: candle's bits");
            // The product, and the broadcast's few bytes of dimensions and
            // strides: the bias and ReLU write over the product (candle's
            // operations make a tensor each).
            let product = (rows * outputs * dtype.size_in_bytes()) as u64;
            assert!(
                (product..=product + 1024).contains(&peak),
                "{dtype:?}, {act:?}: {peak} bytes at the peak, for a {product}-byte product"
            );
        }
    }
}

/// `workbook` (this CUDA build) with `args`, from the repository's root.
/// This test binary may run where it was not built (`scripts/gpu-check.sh`
/// carries it, packed): there `WORKBOOK_BIN` names the packed workbook, run
/// from the current folder (the tree's root), as the build folder's path is
/// of no use.
fn workbook(args: &[&str]) -> std::process::Output {
    let mut command = match std::env::var_os("WORKBOOK_BIN") {
        Some(bin) => std::process::Command::new(bin),
        None => {
            let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_workbook"));
            c.current_dir(env!("CARGO_MANIFEST_DIR"));
            c
        }
    };
    command
        .args(args)
        .output()
        .expect("the workbook binary runs")
}

#[test]
fn without_a_gpu_a_cuda_builds_auto_runs_on_the_cpu_held_to_the_machines_memory() {
    // A CUDA build on a machine without a GPU: the stand-in driver answers
    // no GPU. The runner cannot tell before a worker asks the driver, so it
    // sends no cap; the worker lands on the CPU, holds the cell to the
    // machine's memory and refuses one whose floor is above it.
    if std::env::var_os("WORKBOOK_FAKE_DRIVER").is_none() {
        eprintln!("skipped: needs the stand-in driver (a machine without a GPU)");
        return;
    }
    let o = workbook(&["run", "tests/fixtures/huge.toml", "--format", "json"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).expect("a JSON report");
    assert_eq!(r["device"], "cpu", "auto without a GPU is the CPU");
    let cell = |id: &str| {
        r["cells"]
            .as_array()
            .and_then(|cells| cells.iter().find(|c| c["id"] == id))
            .unwrap_or_else(|| panic!("no cell {id}"))
    };
    assert_eq!(cell("footprint")["status"], "passed");
    assert_eq!(cell("again")["status"], "passed");
    let total = workbook_sdk::device::meminfo("MemTotal:").expect("the machine's memory");
    let total = bytesize::ByteSize::b(total).display().iec().to_string();
    assert_eq!(cell("attention")["status"], "error");
    assert_eq!(
        cell("attention")["error"],
        format!(
            "refused before running: it needs at least 3.6 TiB (the f32 scores of naive \
             attention, 4 × 500000²), more than the {total} a cell may hold here (`--max-memory`)"
        )
    );

    // Asked for the GPU, it says there is none and what to do.
    let o = workbook(&["run", "tests/fixtures/huge.toml", "--device", "cuda"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.starts_with("error: no CUDA GPU answered (")
            && stderr.contains("use `--device cpu`"),
        "{stderr}"
    );
}

/// `g * act'(saved)` as candle's composed operations compute it (the lean
/// layer's backward before its kernel): ReLU's mask cast to the element
/// type, GELU's derivative in f32 (f64 for f64) cast to it.
fn composed_act_grad(g: &Tensor, saved: &Tensor, relu: bool) -> Tensor {
    let dtype = saved.dtype();
    if relu {
        let mask = saved.gt(0.0).and_then(|m| m.to_dtype(dtype)).unwrap();
        return (g * mask).unwrap();
    }
    let z = if dtype == DType::F64 {
        saved.clone()
    } else {
        saved.to_dtype(DType::F32).unwrap()
    };
    let d = (|| {
        let cube = (z.sqr()? * &z)?;
        let tanh = ((&cube * 0.0356774)? + (&z * 0.797885)?)?.tanh()?;
        let inner = ((cube * 0.0535161)? + (&z * 0.398942)?)?;
        (((&tanh * 0.5)? + (inner * (1.0 - tanh.sqr()?)?)?)? + 0.5)?.to_dtype(dtype)
    })()
    .unwrap();
    (g * d).unwrap()
}

#[test]
fn the_lean_layers_activation_gradient_is_one_kernel_on_the_gpu_with_candles_bits() {
    use candle_lean_nn::{Activation, LeanLinear};
    let _turn = turn();
    let Some((device, meter)) = gpu() else { return };
    // A square layer whose weight is the identity: the input's gradient is
    // then the product's gradient itself (each a sum of one product by 1 and
    // products by 0, exact in any of cuBLAS's kernels), so the kernel's
    // output is compared element by element.
    let (rows, inputs, outputs) = (129, 83, 83);
    let c = Category::Gradients;
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let size = dtype.size_in_bytes() as u64;
        let r = |shape: (usize, usize), std: f32| randn(shape, std, dtype, &device);
        // Inputs of a few units, where GELU's derivative varies most.
        let x = r((rows, inputs), 1.5);
        let w = Tensor::eye(outputs, dtype, &device).unwrap();
        let b = r((1, outputs), 1.0).flatten_all().unwrap();
        let layer = LeanLinear::new(w.clone(), Some(b)).unwrap();
        for act in [Activation::Relu, Activation::Gelu] {
            let (out, kept) = layer.forward_saved(&x, act).unwrap();
            let grad = r((rows, outputs), 1.0);
            let saved = kept.tensor().unwrap().clone();
            // candle's operations, first: cuBLAS makes its workspace there.
            let dz = composed_act_grad(&grad, &saved, act == Activation::Relu);
            let (dw_want, db_want) = (dz.t().unwrap().matmul(&x).unwrap(), dz.sum(0).unwrap());
            dz.matmul(&w).unwrap();
            drop((out, saved));
            device.synchronize().unwrap();
            meter.push_peak();
            let start = meter.snapshot();
            let (dx, dw, db) = c
                .scope(|| layer.backward_saved(&x, kept, grad, true))
                .unwrap();
            device.synchronize().unwrap();
            let peak = meter.snapshot().device_peak_each.get(c) - on_device(&start, c);
            meter.pop_peak();
            let what = format!("{dtype:?}, {act:?}");
            // The product's gradient, through the identity: the composed
            // operations' values (a zero's sign aside, which the sums by
            // cuBLAS may change).
            assert_eq!(
                values(&dx.unwrap()),
                values(&dz),
                "{what}: the product's gradient"
            );
            // The bias's gradient sums the product's gradient with candle's
            // own kernel: equal sums of equal terms.
            assert_eq!(bits(&db.unwrap()), bits(&db_want), "{what}: candle's bits");
            // The weight's may come from other cuBLAS kernels than the
            // reference's (equal operands, other addresses).
            let tolerance = match dtype {
                DType::F32 => 1e-6,
                DType::F64 => 1e-12,
                _ => 1e-2,
            };
            let diff = rel_diff(&dw, &dw_want, false);
            assert!(diff <= tolerance, "{what}: dw off by {diff:e} (normwise)");
            // The product's gradient, the bias's and the two products, and
            // the sum's few bytes of dimensions and strides: the composed
            // operations add a mask, or GELU's six f32 matrices.
            let bound =
                (rows * outputs + outputs + rows * inputs + outputs * inputs) as u64 * size + 1024;
            let dz_bytes = (rows * outputs) as u64 * size;
            assert!(
                (dz_bytes..=bound).contains(&peak),
                "{what}: the backward's peak {peak} bytes (at most {bound})"
            );
        }
    }
}

#[test]
fn the_cross_entropy_is_two_kernels_on_the_gpu_holding_only_its_gradient() {
    use candle_core::Var;
    let _turn = turn();
    let Some((device, meter)) = gpu() else { return };
    // GPT-2's vocabulary, not a multiple of a block's 256 threads.
    let (rows, classes) = (67, 50_257);
    let targets: Vec<u32> = (0..rows as u32)
        .map(|r| r * 7_919 % classes as u32)
        .collect();
    let t = Tensor::new(targets.as_slice(), &device).unwrap();
    let t_cpu = t.to_device(&Device::Cpu).unwrap();
    let c = Category::Activations;
    let scale = 0.25;
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let what = format!("{dtype:?}");
        let size = dtype.size_in_bytes() as u64;
        let logits = randn((rows, classes), 3.0, dtype, &device);
        // The CPU's row kernels (candle's operations for f64) on the same
        // values.
        let cpu_logits = logits.to_device(&Device::Cpu).unwrap();
        let (loss_want, grad_want) =
            candle_lean_nn::cross_entropy_and_grad(&cpu_logits, &t_cpu, scale).unwrap();
        device.synchronize().unwrap();
        meter.push_peak();
        let start = meter.snapshot();
        let (loss, grad) = c
            .scope(|| candle_lean_nn::cross_entropy_and_grad(&logits, &t, scale))
            .unwrap();
        device.synchronize().unwrap();
        let peak = meter.snapshot().device_peak_each.get(c) - on_device(&start, c);
        meter.pop_peak();
        // Its sums are a block's, in another order than the CPU's: each
        // side within the arithmetic's share of the magnitudes it scales,
        // and within half an ulp of the element type once rounded (and half
        // f16's subnormal spacing below its normal range).
        let (acc, rounded, subnormal) = match dtype {
            DType::F64 => (1e-12, 0.0, 0.0),
            DType::F32 => (1e-5, 0.0, 0.0),
            DType::F16 => (1e-5, 2f64.powi(-11), 2f64.powi(-25)),
            _ => (1e-5, 2f64.powi(-8), 0.0),
        };
        let (got, want) = (values(&loss)[0], values(&loss_want)[0]);
        let bound = 2.0 * (rounded + acc) * want.abs();
        assert!(
            (got - want).abs() <= bound,
            "{what}: the loss {got}, {want} on the CPU"
        );
        // `scale / rows * (p + onehot)`: the magnitude each element scales.
        let factor = scale / rows as f64;
        let onehot = |i: usize| f64::from(u8::from(i % classes == targets[i / classes] as usize));
        let got = values(&grad);
        for (i, (&g, &w)) in got.iter().zip(&values(&grad_want)).enumerate() {
            let magnitude = w.abs() + 2.0 * factor * onehot(i);
            let bound = 2.0 * (rounded * w.abs() + acc * magnitude + subnormal);
            assert!(
                (g - w).abs() <= bound,
                "{what}: gradient element {i} is {g}, {w} on the CPU"
            );
        }
        // The gradient, the rows' losses (f64) and the targets as u32, and
        // a few scalars: candle's composed operations held several f32
        // tensors the logits' size.
        let grad_bytes = (rows * classes) as u64 * size;
        let bound = grad_bytes + (rows * (8 + 4)) as u64 + 1024;
        assert!(
            (grad_bytes..=bound).contains(&peak),
            "{what}: the loss and its gradient held {peak} bytes (at most {bound})"
        );
        // As one autograd operation, its backward is the same kernel with
        // the same factor.
        let v = Var::from_tensor(&logits).unwrap();
        let grads = candle_lean_nn::cross_entropy(&v, &t)
            .unwrap()
            .backward()
            .unwrap();
        let (_, direct) = candle_lean_nn::cross_entropy_and_grad(&logits, &t, 1.0).unwrap();
        assert_eq!(
            bits(grads.get(&v).unwrap()),
            bits(&direct),
            "{what}: the graph's backward and the direct gradient"
        );
    }
}
