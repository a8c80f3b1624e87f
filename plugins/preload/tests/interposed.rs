//! The interposer in a process of its own: this test runs itself again
//! with the library preloaded and counting, and checks there, through the
//! SDK's `KernelMeter`, that the counts are exact by category, that a free
//! is charged to what allocated, and that peaks nest.

use std::alloc::{alloc, dealloc, Layout};
use std::path::PathBuf;
use std::process::Command;

use workbook_sdk::meter::{Category, KernelMeter, Meter};

/// The library beside this test's executable.
fn library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    [
        deps.join("libworkbook_preload.so"),
        deps.join("../libworkbook_preload.so"),
    ]
    .into_iter()
    .find(|p| p.exists())
    .expect("cargo builds the library before its tests")
}

fn child(test: &str, count: bool) -> std::process::Output {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([test, "--exact", "--nocapture", "--test-threads", "1"])
        .env("LD_PRELOAD", library())
        .env("WORKBOOK_PRELOAD_CHILD", "1");
    if count {
        cmd.env("WORKBOOK_HEAP_COUNT", "1");
    } else {
        cmd.env_remove("WORKBOOK_HEAP_COUNT");
    }
    cmd.output().unwrap()
}

fn in_child() -> bool {
    std::env::var_os("WORKBOOK_PRELOAD_CHILD").is_some()
}

fn bytes_of(meter: &KernelMeter, c: Category) -> u64 {
    meter.snapshot().current.get(c)
}

#[test]
fn preloaded_and_counting_every_byte_is_counted_by_category() {
    if !in_child() {
        let out = child(
            "preloaded_and_counting_every_byte_is_counted_by_category",
            true,
        );
        let said = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{said}");
        assert!(said.contains("1 passed"), "{said}");
        return;
    }
    let meter = KernelMeter::new().expect("the interposer is loaded");
    let c = Category::Parameters;
    let before = bytes_of(&meter, c);
    // 1000 x 1000 f32, zeroed (calloc) and not (malloc).
    let zeros = c.scope(|| vec![0f32; 1_000_000]);
    assert_eq!(bytes_of(&meter, c) - before, 4_000_000);
    let mut grown: Vec<f32> = c.scope(|| Vec::with_capacity(1000));
    assert_eq!(bytes_of(&meter, c) - before, 4_004_000);
    // Grown (realloc) under another category: the block stays what it was.
    Category::Other.scope(|| grown.reserve_exact(1_000_000));
    assert_eq!(bytes_of(&meter, c) - before, 8_000_000);
    // Over-aligned (posix_memalign through Rust's System allocator).
    let layout = Layout::from_size_align(12_345, 4096).unwrap();
    // SAFETY: a non-zero size; freed below with the same layout.
    // (black_box: an allocation nothing reads may be optimised away.)
    let p = std::hint::black_box(c.scope(|| unsafe { alloc(layout) }));
    assert!(!p.is_null() && (p as usize).is_multiple_of(4096));
    assert_eq!(bytes_of(&meter, c) - before, 8_012_345);
    // SAFETY: allocated above with this layout.
    unsafe { dealloc(p, layout) };
    // Freed under another category: charged back to parameters.
    Category::Activations.scope(|| drop((zeros, grown)));
    assert_eq!(bytes_of(&meter, c), before);
    assert_eq!(Category::current(), Category::Other);
    // A frame's peak is its own; the enclosing frame keeps the higher.
    let act = |m: &KernelMeter| m.snapshot().peak_each.get(Category::Activations);
    meter.push_peak();
    let base = bytes_of(&meter, Category::Activations);
    drop(Category::Activations.scope(|| vec![1u8; 5_000_000]));
    meter.push_peak();
    drop(Category::Activations.scope(|| vec![1u8; 1_000_000]));
    assert_eq!(act(&meter), base + 1_000_000);
    meter.pop_peak();
    assert_eq!(act(&meter), base + 5_000_000);
    meter.pop_peak();
}

#[test]
fn preloaded_without_counting_the_process_runs_on_glibc_alone() {
    if !in_child() {
        let out = child(
            "preloaded_without_counting_the_process_runs_on_glibc_alone",
            false,
        );
        let said = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{said}");
        assert!(said.contains("1 passed"), "{said}");
        return;
    }
    let meter = KernelMeter::new().expect("the interposer is loaded");
    let before = meter.snapshot().current.total();
    let v = Category::Parameters.scope(|| vec![1u8; 1_000_000]);
    // Nothing is counted: a compiler the kernel starts pays nothing.
    assert_eq!(meter.snapshot().current.total(), before);
    assert_eq!(before, 0);
    drop(v);
}

#[test]
fn without_the_interposer_there_is_no_kernel_meter() {
    if in_child() {
        return;
    }
    assert!(KernelMeter::new().is_err());
}
