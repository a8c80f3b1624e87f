//! The toolkit's CUDA kernels run on a CPU, for its tests.
//!
//! `include/` holds just enough of CUDA for the toolkit's `.cu` files to
//! compile as C++20: `__global__` functions, a block's threads as real
//! threads meeting at a `std::barrier` for `__syncthreads`, `__shared__`
//! arrays as statics (blocks run one after another), the intrinsics that
//! round each operation on their own, and `__half` and `__nv_bfloat16`
//! with round-to-nearest-even. A test writes a C++ harness that includes
//! `emulate.h` and the kernels and launches them with `launch(kernel, grid,
//! block, args...)`; [`compile`] builds it with the C++ compiler in `CXX`
//! (default `c++`: g++ 12 or clang 15 and later) and [`run`] runs it.
//! `values.h` reads and writes a harness's tensors as f64s, which
//! [`run_on_f64`] hands over and reads back.
//!
//! Nothing here runs on a GPU, and a kernel that passes here can still
//! differ there: in the device's math library (`expf`, `tanhf`), or in a
//! race between threads that this schedule does not show.
#![warn(missing_docs)]

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The directory holding `emulate.h`, `cuda_fp16.h` and `cuda_bf16.h`.
pub fn include_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("include")
}

/// Compiles the harness `source` (C++ that includes `emulate.h` and the
/// kernels) into an executable in a directory of its own under the
/// system's temporary directory, and returns its path. Panics with the
/// compiler's messages where it cannot: it is for tests.
pub fn compile(source: &Path) -> PathBuf {
    let stem = source
        .file_stem()
        .and_then(OsStr::to_str)
        .unwrap_or("harness");
    let dir = std::env::temp_dir().join(format!(
        "candle-cuda-emulation-{}-{stem}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("making {}: {e}", dir.display()));
    let exe = dir.join(stem);
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let out = Command::new(&cxx)
        .args([
            "-std=c++20",
            "-O1",
            "-pthread",
            "-w",
            "-ffp-contract=off",
            "-I",
        ])
        .arg(include_dir())
        .arg("-o")
        .arg(&exe)
        .arg(source)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "running the C++ compiler `{cxx}`: {e}; the emulated kernels need a C++20 \
                 compiler (g++ 12 or clang 15 and later), named in CXX if not `c++`"
            )
        });
    assert!(
        out.status.success(),
        "compiling {} with `{cxx}` failed:\n{}",
        source.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

/// Runs `exe` with `args` and returns what it wrote to its standard
/// output. Panics with its standard error where it fails.
pub fn run<I, S>(exe: &Path, args: I) -> Vec<u8>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let out = Command::new(exe)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", exe.display()));
    assert!(
        out.status.success(),
        "{} failed: {}",
        exe.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// Runs `exe` with `args` and then the path of a file holding `input` (f64s,
/// little-endian, as `values.h` reads them), and returns its standard
/// output read as f64s (as `values.h` writes them).
pub fn run_on_f64(exe: &Path, args: &[&str], input: &[f64]) -> Vec<f64> {
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, Ordering::Relaxed);
    let path = exe.with_extension(format!("{call}.in"));
    let bytes: Vec<u8> = input.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(&path, bytes).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    let out = run(
        exe,
        args.iter()
            .copied()
            .map(OsStr::new)
            .chain([path.as_os_str()]),
    );
    let _ = std::fs::remove_file(&path);
    assert_eq!(out.len() % 8, 0, "{} wrote a partial f64", exe.display());
    out.chunks_exact(8)
        .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
        .collect()
}
