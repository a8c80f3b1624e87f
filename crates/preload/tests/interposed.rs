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
    if !in_preloaded_child(
        "preloaded_and_counting_every_byte_is_counted_by_category",
        true,
    ) {
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

/// Runs `test` again in a child with the library preloaded and counting;
/// true in the child, where the test goes on.
fn in_counting_child(test: &str) -> bool {
    in_preloaded_child(test, true)
}

/// Runs `test` again in a child with the library preloaded, counting or
/// not, and checks that it passed there; true in the child, where the test
/// goes on.
fn in_preloaded_child(test: &str, count: bool) -> bool {
    if in_child() {
        return true;
    }
    let out = child(test, count);
    let said =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("1 passed"), "{said}");
    false
}

extern "C" {
    // Not in the libc crate; glibc has them.
    fn valloc(size: usize) -> *mut libc::c_void;
    fn pvalloc(size: usize) -> *mut libc::c_void;
}

fn errno() -> i32 {
    // SAFETY: this thread's errno.
    unsafe { *libc::__errno_location() }
}

#[test]
fn the_c_allocators_other_entries_count_and_fail_as_glibcs_do() {
    if !in_counting_child("the_c_allocators_other_entries_count_and_fail_as_glibcs_do") {
        return;
    }
    let meter = KernelMeter::new().expect("the interposer counts");
    let c = Category::Inputs;
    let before = bytes_of(&meter, c);
    let page = 4096;
    // SAFETY: C allocations freed below; the null ones are not used.
    unsafe {
        let _tag = c.enter();
        let a = libc::memalign(64, 100);
        let b = libc::aligned_alloc(256, 512);
        let v = valloc(10);
        let p = pvalloc(0);
        // A non-power-of-two alignment is rounded up, as glibc does.
        let odd = libc::memalign(48, 7);
        // (black_box: the compiler knows these functions and may drop an
        // allocation whose block nothing reads.)
        let [a, b, v, p, odd] = std::hint::black_box([a, b, v, p, odd]);
        for (ptr, align) in [(a, 64), (b, 256), (v, page), (p, page), (odd, 64)] {
            assert!(!ptr.is_null() && (ptr as usize).is_multiple_of(align));
        }
        // pvalloc(0) is one page.
        assert_eq!(
            bytes_of(&meter, c) - before,
            100 + 512 + 10 + page as u64 + 7
        );
        // Growing an over-aligned block keeps its category.
        drop(_tag);
        let grown = Category::Other.scope(|| libc::realloc(a, 1000));
        assert!(!grown.is_null());
        assert_eq!(
            bytes_of(&meter, c) - before,
            1000 + 512 + 10 + page as u64 + 7
        );
        for ptr in [grown, b, v, p, odd] {
            libc::free(ptr);
        }
        assert_eq!(bytes_of(&meter, c), before);
        // Sizes that cannot be: null, ENOMEM, nothing counted (black_box:
        // the compiler may take an allocation it can see to succeed).
        use std::hint::black_box as bb;
        *libc::__errno_location() = 0;
        assert!(bb(libc::calloc(bb(usize::MAX / 2), 4)).is_null());
        assert_eq!(errno(), libc::ENOMEM);
        *libc::__errno_location() = 0;
        assert!(bb(libc::memalign(bb(1 << 40), 8)).is_null());
        assert_eq!(errno(), libc::ENOMEM);
        *libc::__errno_location() = 0;
        assert!(bb(libc::malloc(bb(usize::MAX - 8))).is_null());
        assert_eq!(errno(), libc::ENOMEM);
        let mut out = std::ptr::null_mut();
        assert_eq!(libc::posix_memalign(&mut out, 24, 8), libc::EINVAL);
        assert_eq!(bytes_of(&meter, c), before);
    }
}

#[test]
fn libraries_loaded_later_with_thread_locals_do_not_reach_the_allocator_again() {
    if !in_counting_child(
        "libraries_loaded_later_with_thread_locals_do_not_reach_the_allocator_again",
    ) {
        return;
    }
    // Thirty libraries with thread-locals of their own (copies of this
    // one), as evcxr loads one per cell: the threads' tables of them grow.
    let dir = tempfile::tempdir().unwrap();
    for i in 0..30 {
        let copy = dir.path().join(format!("libcopy{i}.so"));
        std::fs::copy(library(), &copy).unwrap();
        let name = std::ffi::CString::new(copy.to_str().unwrap()).unwrap();
        // SAFETY: a library whose constructors do nothing; kept loaded.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!handle.is_null(), "dlopen {}", copy.display());
    }
    let meter = KernelMeter::new().expect("the interposer counts");
    let c = Category::Activations;
    let before = bytes_of(&meter, c);
    let held = std::thread::spawn(move || c.scope(|| vec![1u8; 3_000_000]))
        .join()
        .unwrap();
    assert_eq!(bytes_of(&meter, c) - before, 3_000_000);
    drop(held);
    assert_eq!(bytes_of(&meter, c), before);
}

#[test]
fn a_tag_out_of_range_is_not_set() {
    if !in_counting_child("a_tag_out_of_range_is_not_set") {
        return;
    }
    type Swap = unsafe extern "C" fn(u32, u8) -> u8;
    // SAFETY: the library's export, of this signature.
    let swap: Swap = unsafe {
        let p = libc::dlsym(libc::RTLD_DEFAULT, c"workbook_heap_v2_swap_tag".as_ptr());
        assert!(!p.is_null());
        std::mem::transmute::<*mut libc::c_void, Swap>(p)
    };
    let _params = Category::Parameters.enter();
    // SAFETY: as above.
    unsafe {
        assert_eq!(swap(0, 99), Category::Parameters as u8);
        assert_eq!(swap(1, 7), 0);
    }
    assert_eq!(Category::current(), Category::Parameters);
}

#[test]
fn preloaded_without_counting_the_process_runs_on_glibc_alone() {
    if !in_preloaded_child(
        "preloaded_without_counting_the_process_runs_on_glibc_alone",
        false,
    ) {
        return;
    }
    // Loaded, not counting (a compiler the kernel starts): no meter, said
    // so, and allocations go to glibc untouched.
    let err = KernelMeter::new().unwrap_err().to_string();
    assert!(err.contains("does not count this process"), "{err}");
    let v = Category::Parameters.scope(|| vec![1u8; 1_000_000]);
    assert_eq!(v.iter().map(|&b| u64::from(b)).sum::<u64>(), 1_000_000);
}

#[test]
fn without_the_interposer_there_is_no_kernel_meter() {
    if in_child() {
        return;
    }
    let err = KernelMeter::new().unwrap_err().to_string();
    assert!(
        err.contains("the counting allocator is not installed"),
        "{err}"
    );
}
