//! The CUDA meter on a real GPU: a tensor's bytes counted exactly under its
//! category through the interposed driver calls, and the memory pool's own
//! figures agreeing with them.
//!
//! Built with `--features cuda`. Where no GPU answers, each test says so and
//! passes, unless `WORKBOOK_REQUIRE_GPU` is set: then it fails.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use workbook_sdk::meter::cuda::CudaMeter;
use workbook_sdk::meter::{Category, CountingAllocator, MemorySnapshot, Meter};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

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

/// Device-resident bytes of one category.
fn on_device(s: &MemorySnapshot, c: Category) -> u64 {
    s.current.get(c) - s.host.get(c)
}

#[test]
fn a_gpu_tensor_is_counted_exactly_under_its_category_and_the_pool_agrees() {
    let Some((device, meter)) = gpu() else { return };
    assert_eq!(
        meter.name(),
        "cuda-pool",
        "an H100 or H200 has memory pools"
    );
    workbook_sdk::train::warm_up(&device).expect("the GPU computes");

    meter.reset_peak();
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
