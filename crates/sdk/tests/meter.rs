//! The counting allocator, measured against allocations of known size.
//!
//! Each test tags its own allocations with a category nothing else on the
//! test harness's threads uses, so parallel tests cannot disturb the counts.

use std::sync::Mutex;

use candle_core::{DType, Device, Tensor};
use workbook_sdk::meter::{Category, CountingAllocator, CpuMeter, Meter};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// Peaks are global: every test takes its turn, so no other test's
/// allocation can set the peak one of them reads.
static TURN: Mutex<()> = Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

/// The test harness's own threads allocate and free small blocks (as
/// `other`) at any moment, so a total is exact only to within them; a
/// category's own figures are exact.
const OTHERS: u64 = 1 << 16;

fn bytes_of(c: Category) -> u64 {
    CpuMeter::new().unwrap().snapshot().current.get(c)
}

#[test]
fn installed_allocator_is_seen() {
    assert!(CountingAllocator::is_installed());
    assert!(CpuMeter::new().is_ok());
}

#[test]
fn alloc_dealloc_and_zeroed_move_current_by_exactly_their_size() {
    let _turn = turn();
    let c = Category::Inputs;
    let before = bytes_of(c);
    let v: Vec<u8> = c.scope(|| Vec::with_capacity(12_345));
    assert_eq!(bytes_of(c) - before, 12_345);
    let z: Vec<u64> = c.scope(|| vec![0u64; 1000]);
    assert_eq!(bytes_of(c) - before, 12_345 + 8_000);
    drop(v);
    assert_eq!(bytes_of(c) - before, 8_000);
    // Freed outside the scope: still charged to the category that allocated it.
    drop(z);
    assert_eq!(bytes_of(c), before);
}

#[test]
fn realloc_keeps_the_category_and_counts_the_new_size() {
    let _turn = turn();
    let c = Category::OptimizerState;
    let before = bytes_of(c);
    let mut v: Vec<u32> = c.scope(|| Vec::with_capacity(10));
    assert_eq!(bytes_of(c) - before, 40);
    // Grown under another category: the block stays what it was.
    Category::Other.scope(|| v.reserve_exact(1000));
    assert_eq!(bytes_of(c) - before, 4_000);
    v.shrink_to(0);
    assert_eq!(bytes_of(c), before);
}

#[test]
fn a_tensor_moves_current_by_exactly_its_data_beyond_fixed_overhead() {
    let _turn = turn();
    let c = Category::Parameters;
    let delta = |rows: usize, dtype: DType| {
        let before = bytes_of(c);
        let t = c.scope(|| Tensor::zeros((rows, 1000), dtype, &Device::Cpu).unwrap());
        let d = bytes_of(c) - before;
        drop(t);
        assert_eq!(bytes_of(c), before, "dropping the tensor frees all of it");
        d
    };
    // The same tensor bookkeeping at both sizes; the difference is the data.
    assert_eq!(delta(1000, DType::F32) - delta(1, DType::F32), 4 * 999_000);
    assert_eq!(delta(1000, DType::F16) - delta(1, DType::F16), 2 * 999_000);
    // And the data of a 1000 x 1000 f32 tensor is 4,000,000 bytes.
    let overhead = delta(1, DType::F32) - 4 * 1000;
    assert_eq!(delta(1000, DType::F32), 4_000_000 + overhead);
    assert!(overhead < 1024, "tensor bookkeeping is small: {overhead}");
}

#[test]
fn a_frame_records_its_own_high_water_mark_and_folds_it_into_the_enclosing_one() {
    let _turn = turn();
    let meter = CpuMeter::new().unwrap();
    let act = |s: &workbook_sdk::meter::MemorySnapshot| s.peak_each.get(Category::Activations);
    meter.push_peak();
    let start = meter.snapshot();
    let base = start.current.get(Category::Activations);
    let big = Category::Activations.scope(|| vec![1u8; 5_000_000]);
    drop(big);
    // Other threads allocate as `other` and may free at any time, so the
    // total peak is only bounded; a category's own peak is exact.
    assert_eq!(act(&meter.snapshot()), base + 5_000_000);
    assert!(meter.snapshot().peak + OTHERS >= start.current_total() + 5_000_000);
    // An inner frame starts from what is live, not from the outer peak...
    meter.push_peak();
    assert_eq!(act(&meter.snapshot()), base);
    let small = Category::Activations.scope(|| vec![1u8; 1_000]);
    assert_eq!(act(&meter.snapshot()), base + 1_000);
    drop(small);
    meter.pop_peak();
    // ...and closing it gives the outer frame back its own, higher, peak.
    let outer = meter.snapshot();
    assert_eq!(act(&outer), base + 5_000_000);
    assert!(outer.peak + OTHERS >= start.current_total() + 5_000_000);
    // An inner peak higher than the outer one's is folded in.
    meter.push_peak();
    let huge = Category::Activations.scope(|| vec![1u8; 7_000_000]);
    drop(huge);
    meter.pop_peak();
    assert_eq!(act(&meter.snapshot()), base + 7_000_000);
    meter.pop_peak();
}

#[test]
fn an_outer_region_keeps_the_peak_of_a_buffer_freed_before_an_inner_region() {
    let _turn = turn();
    let meter = std::sync::Arc::new(CpuMeter::new().unwrap());
    let mut ctx = workbook_sdk::Context::new(Device::Cpu, meter, true);
    let outer = ctx.region("outer");
    let buffer = Category::Activations.scope(|| vec![0u8; 10_000_000]);
    drop(buffer);
    let (_, inner) = ctx
        .measure("inner", |_| {
            let v = Category::Activations.scope(|| vec![0u8; 1_000]);
            drop(v);
            Ok(())
        })
        .unwrap();
    let outer = ctx.end_region(outer);
    assert_eq!(
        inner.category_peak_above_baseline(Category::Activations),
        1_000
    );
    assert_eq!(
        outer.category_peak_above_baseline(Category::Activations),
        10_000_000
    );
    assert!(outer.peak_above_baseline() + OTHERS >= 10_000_000);
    assert!(outer.peak_bytes >= inner.peak_bytes);
}

#[test]
fn a_region_dropped_by_an_error_closes_its_frame() {
    let _turn = turn();
    let meter = std::sync::Arc::new(CpuMeter::new().unwrap());
    let mut ctx = workbook_sdk::Context::new(Device::Cpu, meter, true);
    let outer = ctx.region("outer");
    let buffer = Category::Activations.scope(|| vec![0u8; 4_000_000]);
    drop(buffer);
    let failed = ctx.measure("fails", |_| -> anyhow::Result<()> {
        anyhow::bail!("the experiment failed")
    });
    assert!(failed.is_err());
    let outer = ctx.end_region(outer);
    assert_eq!(
        outer.category_peak_above_baseline(Category::Activations),
        4_000_000
    );
}

#[test]
fn host_and_device_residency_are_counted_apart() {
    let _turn = turn();
    let meter = CpuMeter::new().unwrap();
    meter.push_peak();
    let start = meter.snapshot();
    let c = Category::OptimizerState;
    let on_host = workbook_sdk::Residency::Host.scope(|| c.scope(|| vec![0u8; 7_000]));
    let on_device = c.scope(|| vec![0u8; 3_000]);
    let s = meter.snapshot();
    assert_eq!(s.host.get(c) - start.host.get(c), 7_000);
    assert_eq!(s.current.get(c) - start.current.get(c), 10_000);
    assert_eq!(s.host_peak_each.get(c) - start.host.get(c), 7_000);
    let device_start = start.current.get(c) - start.host.get(c);
    assert_eq!(s.device_peak_each.get(c) - device_start, 3_000);
    drop((on_host, on_device));
    assert_eq!(meter.snapshot().host.get(c), start.host.get(c));
    meter.pop_peak();
}

/// The device's peak is the most device-resident bytes at one moment,
/// across categories, with the host's left out: what an offloaded
/// optimizer's device must hold.
#[test]
fn the_device_peak_is_one_moments_device_bytes_without_the_hosts() {
    let _turn = turn();
    let meter = std::sync::Arc::new(CpuMeter::new().unwrap());
    let mut ctx = workbook_sdk::Context::new(Device::Cpu, meter, true);
    let (_, report) = ctx
        .measure("offloaded", |_| {
            let state = workbook_sdk::Residency::Host
                .scope(|| Category::OptimizerState.scope(|| vec![0u8; 5_000_000]));
            let grads = Category::Gradients.scope(|| vec![0u8; 2_000_000]);
            let acts = Category::Activations.scope(|| vec![0u8; 1_000_000]);
            drop(grads);
            // Device bytes peaked at 3 MB (gradients and activations at
            // once); now 1 MB, then 2.5 MB: below the peak.
            let more = Category::Activations.scope(|| vec![0u8; 1_500_000]);
            drop((state, acts, more));
            Ok(())
        })
        .unwrap();
    // Totals take in every category: the region's own bookkeeping, and
    // what the harness's threads allocate and free meanwhile (`OTHERS`;
    // a run measured 93 bytes below 3 MB as the harness freed a block).
    let device = report.device_total_peak_above_baseline();
    let near = |bytes: u64, want: u64| want - OTHERS <= bytes && bytes <= want + OTHERS;
    assert!(near(device, 3_000_000), "{device}");
    let total = report.peak_above_baseline();
    assert!(near(total, 8_000_000), "{total}");
    // Each category's own device peak, at their own moments, sum higher.
    let each = report.device_peak_above_baseline(Category::Gradients)
        + report.device_peak_above_baseline(Category::Activations);
    assert_eq!(each, 4_500_000);
}

#[test]
fn region_reports_peak_above_baseline_and_marks() {
    let _turn = turn();
    let meter = std::sync::Arc::new(CpuMeter::new().unwrap());
    let mut ctx = workbook_sdk::Context::new(Device::Cpu, meter, true);
    let (_, report) = ctx
        .measure("one buffer", |r| {
            let v = Category::Activations.scope(|| vec![0u8; 3_000_000]);
            r.mark("allocated");
            drop(v);
            Ok(())
        })
        .unwrap();
    assert_eq!(
        report.category_peak_above_baseline(Category::Activations),
        3_000_000
    );
    assert_eq!(
        report.device_peak_above_baseline(Category::Activations),
        3_000_000
    );
    assert_eq!(report.host_peak_above_baseline(Category::Activations), 0);
    let labels: Vec<&str> = report.marks.iter().map(|m| m.label.as_ref()).collect();
    assert_eq!(labels, ["start", "allocated", "end"]);
    assert_eq!(ctx.output().regions.len(), 1);
}

#[test]
fn device_buffers_outside_the_heap_are_counted_by_category_and_freed_by_tag() {
    let _turn = turn();
    let meter = CpuMeter::new().unwrap();
    meter.push_peak();
    let start = meter.snapshot();
    let c = Category::Gradients;
    let device = |s: &workbook_sdk::meter::MemorySnapshot| s.current.get(c) - s.host.get(c);
    // What the CUDA interposer does for each buffer the driver hands out.
    let tag = c.scope(|| workbook_sdk::meter::device_allocated(1 << 20));
    let s = meter.snapshot();
    assert_eq!(device(&s) - device(&start), 1 << 20);
    assert_eq!(s.host.get(c), start.host.get(c));
    // The total is process-wide: another thread of the harness may have
    // allocated or freed meanwhile (once by more than OTHERS), so the bound
    // is half the buffer either side, which still tells a buffer counted
    // once from one left out or counted twice. The category above is exact.
    let above = s.peak as i64 - start.current_total() as i64;
    assert!(
        ((1 << 20) - (1 << 19)..(1 << 20) + (1 << 19)).contains(&above),
        "{above}"
    );
    // Freed while another category is current: charged to the allocator's.
    Category::Activations.scope(|| workbook_sdk::meter::device_freed(tag, 1 << 20));
    let end = meter.snapshot();
    assert_eq!(device(&end), device(&start));
    assert_eq!(
        end.current.get(Category::Activations),
        start.current.get(Category::Activations)
    );
    assert_eq!(end.device_peak_each.get(c) - device(&start), 1 << 20);
    // Live blocks are process-wide too, and the harness's threads allocate
    // and free small blocks of their own: a hundred device buffers stand
    // well clear of that noise.
    let before = meter.snapshot().live_blocks as i64;
    let tags: Vec<u8> = (0..100)
        .map(|_| c.scope(|| workbook_sdk::meter::device_allocated(4096)))
        .collect();
    let blocks = meter.snapshot().live_blocks as i64 - before;
    assert!((100 - 32..=100 + 32).contains(&blocks), "{blocks}");
    for t in tags {
        workbook_sdk::meter::device_freed(t, 4096);
    }
    meter.pop_peak();
}

#[test]
fn pool_figures_of_a_stretch_floor_a_just_reset_high_water_mark_at_what_is_in_use() {
    use workbook_sdk::meter::{MemorySnapshot, PoolReading};
    use workbook_sdk::PoolUse;
    let at = |used, used_high| MemorySnapshot {
        pool: Some(PoolReading {
            used,
            used_high,
            reserved: 1 << 25,
        }),
        ..Default::default()
    };
    let cpu = MemorySnapshot::default();
    assert_eq!(PoolUse::between(&cpu, &cpu), None);
    // A high-water mark reset to zero reads zero until the next allocation.
    let idle = PoolUse::between(&at(4096, 0), &at(4096, 0)).unwrap();
    assert_eq!((idle.peak, idle.peak_above_baseline()), (4096, 0));
    let busy = PoolUse::between(&at(4096, 0), &at(6144, 1 << 20)).unwrap();
    assert_eq!(
        busy,
        PoolUse {
            baseline: 4096,
            peak: 1 << 20,
            end: 6144,
            reserved: 1 << 25
        }
    );
    assert_eq!(busy.peak_above_baseline(), (1 << 20) - 4096);
}
