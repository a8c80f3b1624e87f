//! The toolkit's CUDA kernels run on a CPU, for its tests.
//!
//! `include/` holds just enough of CUDA for the toolkit's `.cu` files, and
//! the candle kernels candle-inplace launches (their atomics, bit casts
//! and the headers they include, with their f16 and bf16 kernels where a
//! harness defines `__CUDA_ARCH__` as 800 or more; CUDA's e4m3 8-bit
//! float is declared, and stops a harness that converts one), to compile
//! as C++20:
//! `__global__` functions, blocks of any shape whose threads are real
//! threads meeting at a `std::barrier` for `__syncthreads` (and each warp's
//! at one of its own for `__shfl_xor_sync`), `__shared__`
//! arrays as statics (blocks run one after another), the intrinsics that
//! round each operation on their own, and `__half` and `__nv_bfloat16`
//! with round-to-nearest-even: their conversions and each operation rounded
//! once, as the card's half-type arithmetic (`emulated_half.h`;
//! `tests/halves.rs` holds them to a reference bit for bit). A test writes a C++ harness that includes
//! `emulate.h` and the kernels and launches them with `launch(kernel, grid,
//! block, args...)`; [`compile`] builds it with the C++ compiler in `CXX`
//! (default `c++`: g++ 12 or clang 15 and later) and [`run`] runs it.
//! `values.h` reads and writes a harness's tensors as f64s, which
//! [`run_on_f64`] hands over and reads back.
//!
//! A harness compiled as [`Build::RaceChecked`] runs under ThreadSanitizer,
//! which stops it at a race between two of a block's threads even where
//! the values come out right.
//!
//! Nothing here runs on a GPU, and a kernel that passes here can still
//! differ there: in the device's math library (`expf`, `tanhf`), or in a
//! race between blocks (which run here one after another).
#![warn(missing_docs)]

use std::ffi::OsStr;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime};

/// The directory holding `emulate.h`, `cuda_fp16.h` and `cuda_bf16.h`.
pub fn include_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("include")
}

/// The `-I` options of every harness and kernel file: [`include_dir`], and
/// the kernels' shared header (`candle_kernel_params/elements.cuh`).
fn includes() -> [std::ffi::OsString; 2] {
    let mut ours = std::ffi::OsString::from("-I");
    ours.push(include_dir());
    let mut shared = std::ffi::OsString::from("-I");
    shared.push(candle_kernel_params::include_dir());
    [ours, shared]
}

/// What every harness is compiled with. `-ffp-contract=off` keeps each
/// operation rounded on its own, as the kernels' intrinsics are on a GPU;
/// `-fno-strict-aliasing` lets them read a float tile as `float4`s, as CUDA
/// code does.
const FLAGS: [&str; 6] = [
    "-std=c++20",
    "-O1",
    "-pthread",
    "-w",
    "-ffp-contract=off",
    "-fno-strict-aliasing",
];

/// How a harness is built.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Build {
    /// As it is: the fastest to run.
    Plain,
    /// Under ThreadSanitizer (`-fsanitize=thread`): a run stops, and [`run`]
    /// fails with the report, at the first data race between two of a
    /// block's threads, such as a thread reading a shared tile's element
    /// that another wrote with no `__syncthreads` between them, or two
    /// threads writing one element of an output. The barriers and the
    /// warps' shuffles order what they should, so a kernel without a race
    /// runs clean. Blocks still run one after another: a race between
    /// blocks does not show. A run is several times slower.
    RaceChecked,
}

impl Build {
    /// The compiler's flags on top of [`FLAGS`].
    fn flags(self) -> &'static [&'static str] {
        match self {
            Build::Plain => &[],
            // -g: the report names the kernels' files and lines.
            Build::RaceChecked => &["-fsanitize=thread", "-g"],
        }
    }
}

/// Compiles the harness `source` (C++ that includes `emulate.h` and the
/// kernels) into an executable in [`cache_dir`] and returns its path.
/// Panics with the compiler's messages where it cannot: it is for tests.
/// See [`compile_in`].
pub fn compile(source: &Path) -> PathBuf {
    compile_in(source, &cache_dir())
}

/// [`compile`] as `build` says: [`Build::RaceChecked`] gives an executable
/// that stops at a data race between a block's threads.
pub fn compile_as(source: &Path, build: Build) -> PathBuf {
    compile_built_in(source, &cache_dir(), build)
}

/// Compiles the harness `source` into an executable kept in `dir`, named
/// by the harness and a hash of what the compiler reads (the harness with
/// every file it includes, after the preprocessor), the flags and the
/// compiler's version. So a test run reuses what an earlier run compiled
/// from the same kernels, and an edit to a kernel or a header compiles
/// anew. What is compiled is the very text that was hashed, so a file
/// edited meanwhile cannot land under another version's name.
///
/// The folder does not grow with every edit or every clone. Each compile
/// that builds removes the versions of the same harness file by the same
/// compiler that were last used over [`SUPERSEDED_MINUTES`] minutes ago
/// (a test process still running holds its version's path), and anything
/// last used over [`UNUSED_DAYS`] days ago (a clone at another path, whose
/// line markers name other files, has versions of its own).
pub fn compile_in(source: &Path, dir: &Path) -> PathBuf {
    compile_built_in(source, dir, Build::Plain)
}

/// [`compile_in`] as `build` says. A harness's builds of each kind are
/// versions of their own, so neither replaces the other.
pub fn compile_built_in(source: &Path, dir: &Path, build: Build) -> PathBuf {
    let stem = source
        .file_stem()
        .and_then(OsStr::to_str)
        .unwrap_or("harness");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let version = compiler(
        &cxx,
        "taking the compiler's version for",
        source,
        Command::new(&cxx).arg("--version"),
    );
    // The preprocessor's line markers keep the compiler's messages pointing
    // at the kernels' own files and lines.
    let preprocessed = compiler(
        &cxx,
        "preprocessing",
        source,
        Command::new(&cxx)
            .args(FLAGS)
            .args(build.flags())
            .arg("-E")
            .args(includes())
            .arg(source),
    );
    let mut hasher = DefaultHasher::new();
    (&version, FLAGS, build.flags(), &preprocessed).hash(&mut hasher);
    // A harness file's versions by one compiler share a prefix: its name
    // and a hash of its path and the compiler, so that neither two
    // harnesses of one name nor two compilers replace each other's.
    let mut by_path = DefaultHasher::new();
    std::path::absolute(source)
        .unwrap_or_else(|_| source.to_path_buf())
        .hash(&mut by_path);
    version.hash(&mut by_path);
    build.hash(&mut by_path);
    let family = format!("{stem}-{:08x}-", by_path.finish() as u32);
    let exe = dir.join(format!("{family}{:016x}", hasher.finish()));
    // Marked as used now, which keeps it from the prunes to come. Only a
    // file that is not there is built; one that cannot be marked (another
    // user's) is used as it is.
    match mark_used(&exe) {
        Ok(()) => return exe,
        Err(e) if e.kind() != std::io::ErrorKind::NotFound && exe.is_file() => return exe,
        Err(_) => {}
    }
    std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("making {}: {e}", dir.display()));
    // Built in a folder of this call's own (removed however the call ends),
    // then renamed into place, so that no other test, in this process or
    // another, runs a half-written executable.
    let work = tempfile::Builder::new()
        .prefix(&format!("{stem}."))
        .tempdir_in(dir)
        .unwrap_or_else(|e| panic!("making a folder in {}: {e}", dir.display()));
    let text = work.path().join(format!("{stem}.ii"));
    std::fs::write(&text, &preprocessed)
        .unwrap_or_else(|e| panic!("writing {}: {e}", text.display()));
    let built = work.path().join(stem);
    compiler(
        &cxx,
        match build {
            Build::Plain => "compiling",
            Build::RaceChecked => {
                "compiling (under ThreadSanitizer, whose runtime g++ needs as libtsan: \
                 Debian's libtsan2)"
            }
        },
        source,
        Command::new(&cxx)
            .args(FLAGS)
            .args(build.flags())
            .arg("-o")
            .arg(&built)
            .arg(&text),
    );
    std::fs::rename(&built, &exe)
        .unwrap_or_else(|e| panic!("moving {} to {}: {e}", built.display(), exe.display()));
    prune(dir, &family, &exe);
    exe
}

/// Sets `exe`'s last use to now, under a shared lock: a [`prune`] decides
/// on a file under an exclusive one, so a mark either comes first (and the
/// prune sees it) or waits for the prune, then finds whether the file is
/// still there. Through a read-only handle: the file may be running.
fn mark_used(exe: &Path) -> std::io::Result<()> {
    mark_open(&std::fs::File::open(exe)?, exe)
}

/// [`mark_used`] through `file`, a handle opened on `exe`.
fn mark_open(file: &std::fs::File, exe: &Path) -> std::io::Result<()> {
    file.lock_shared()?;
    // A prune that held the lock may have removed it meanwhile.
    if !exe.is_file() {
        return Err(std::io::ErrorKind::NotFound.into());
    }
    file.set_modified(SystemTime::now())
}

/// Days after its last use that anything in a cache folder is removed.
pub const UNUSED_DAYS: u64 = 7;

/// Minutes after its last use that an earlier version of a harness is
/// removed once a later one is built.
pub const SUPERSEDED_MINUTES: u64 = 60;

/// Removes from `dir` the other versions of the harness whose executables'
/// names start with `family` that were last used over
/// [`SUPERSEDED_MINUTES`] ago, and everything last used over
/// [`UNUSED_DAYS`] ago (a build folder left by a killed test too). Best
/// effort: what another process removed first is left to it, and a file
/// that another process is marking as used right now is kept.
fn prune(dir: &Path, family: &str, keep: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let minutes = |m: u64| Duration::from_secs(m * 60);
    let stale = |idle: Duration| idle > minutes(UNUSED_DAYS * 24 * 60);
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(meta) = entry.metadata() else { continue };
        let Some(idle) = idle_for(&meta) else {
            continue;
        };
        if path == keep {
            continue;
        }
        if meta.is_dir() {
            // A build folder in use is its call's own.
            if stale(idle) {
                let _ = std::fs::remove_dir_all(&path);
            }
            continue;
        }
        let ours = entry.file_name().to_str().is_some_and(|name| {
            name.strip_prefix(family)
                .is_some_and(|hash| hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit()))
        });
        // Removed: anything stale, and this harness's other versions once
        // superseded long enough.
        let due = |idle: Duration| stale(idle) || (ours && idle > minutes(SUPERSEDED_MINUTES));
        if !due(idle) {
            continue;
        }
        // Decided again under an exclusive lock, taken without waiting: a
        // file being marked as used (see `mark_used`) is kept, and a mark
        // made before the lock shows in its last use.
        let Ok(file) = std::fs::File::open(&path) else {
            continue;
        };
        if file.try_lock().is_err() {
            continue;
        }
        let Some(idle) = file.metadata().ok().as_ref().and_then(idle_for) else {
            continue;
        };
        if due(idle) {
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// How long ago what `meta` describes was last used (its modification
/// time, which a mark of use sets); `None` where the system cannot say.
fn idle_for(meta: &std::fs::Metadata) -> Option<Duration> {
    meta.modified().ok()?.elapsed().ok()
}

/// Where [`compile`] keeps its executables: `cuda-emulation/` beside the
/// running test's executable (in cargo's target folder, so `cargo clean`
/// removes them), or `candle-toolkit-cuda-emulation/` under the system's
/// temporary folder where that executable's path is unknown.
pub fn cache_dir() -> PathBuf {
    match std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(Path::to_path_buf))
    {
        Some(dir) => dir.join("cuda-emulation"),
        None => std::env::temp_dir().join("candle-toolkit-cuda-emulation"),
    }
}

/// Every kernel that `sources` define (`extern "C" __global__ void`
/// functions, after the C preprocessor with the kernels' own macros, as
/// nvcc compiles them), by name: each parameter's C type without its name,
/// one space between words and `*`s written together after one space
/// (`const __half *`, `size_t`), as `candle_kernel_params` spells them. A
/// `const` on a parameter passed by value (`const size_t numel`) is left
/// out: it binds the kernel's copy, not what a launch passes.
/// Panics where the preprocessor fails or a declaration cannot be read.
pub fn declarations(sources: &[&Path]) -> std::collections::BTreeMap<String, Vec<String>> {
    declarations_in(sources, None)
}

/// [`declarations`] as nvcc preprocesses `sources` for the compute
/// capability `arch` (`__CUDA_ARCH__`, 900 for sm_90), for kernel files
/// that define some kernels only from a capability on (candle's half-type
/// kernels from 530 and 800).
pub fn declarations_for_arch(
    sources: &[&Path],
    arch: u32,
) -> std::collections::BTreeMap<String, Vec<String>> {
    declarations_in(sources, Some(arch))
}

fn declarations_in(
    sources: &[&Path],
    arch: Option<u32>,
) -> std::collections::BTreeMap<String, Vec<String>> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let mut found = std::collections::BTreeMap::new();
    for source in sources {
        let mut command = Command::new(&cxx);
        command.args(FLAGS);
        if let Some(arch) = arch {
            command.arg(format!("-D__CUDA_ARCH__={arch}"));
        }
        let text = compiler(
            &cxx,
            "preprocessing",
            source,
            command
                .args(["-x", "c++", "-E", "-P"])
                .args(includes())
                .arg(source),
        );
        let text = String::from_utf8_lossy(&text);
        const START: &str = "extern \"C\" __global__ void ";
        let mut rest = text.as_ref();
        while let Some(at) = rest.find(START) {
            rest = &rest[at + START.len()..];
            let open = rest
                .find('(')
                .unwrap_or_else(|| panic!("{}: a kernel without parameters", source.display()));
            let close = rest[open..].find(')').unwrap_or_else(|| {
                panic!("{}: a kernel's parameters do not end", source.display())
            });
            let name = rest[..open].trim().to_string();
            let params = rest[open + 1..open + close]
                .split(',')
                .map(|param| {
                    c_type(param).unwrap_or_else(|| {
                        panic!("{}: `{name}`'s parameter `{param}`", source.display())
                    })
                })
                .collect();
            if found.insert(name.clone(), params).is_some() {
                panic!("{}: `{name}` is defined twice", source.display());
            }
            rest = &rest[open + close..];
        }
    }
    found
}

/// A parameter's C type without its name (`const float * q` gives `const
/// float *`), or `None` where it has no name after its type.
fn c_type(param: &str) -> Option<String> {
    let spaced = param.replace('*', " * ");
    let mut tokens: Vec<&str> = spaced.split_whitespace().collect();
    let name = tokens.pop()?;
    if !name.chars().all(|c| c.is_alphanumeric() || c == '_') {
        return None;
    }
    // A top-level const, which does not change what a launch passes: the
    // whole type's where there is no pointer, the pointer's own after the
    // last `*`.
    if !tokens.contains(&"*") {
        tokens.retain(|t| *t != "const");
    } else if tokens.last() == Some(&"const") {
        tokens.pop();
    }
    if tokens.is_empty() {
        return None;
    }
    let mut out = String::new();
    for (i, token) in tokens.iter().enumerate() {
        if i > 0 && !(*token == "*" && tokens[i - 1] == "*") {
            out.push(' ');
        }
        out.push_str(token);
    }
    Some(out)
}

/// Runs the C++ compiler `cxx` as `command` says, `doing` that to the
/// harness `source`, and returns its standard output. Panics with its
/// messages where it fails.
fn compiler(cxx: &str, doing: &str, source: &Path, command: &mut Command) -> Vec<u8> {
    let out = command.output().unwrap_or_else(|e| {
        panic!(
            "running the C++ compiler `{cxx}`: {e}; the emulated kernels need a C++20 \
             compiler (g++ 12 or clang 15 and later), named in CXX if not `c++`"
        )
    });
    if !out.status.success() {
        panic!(
            "{doing} {} with `{cxx}` failed:\n{}",
            source.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out.stdout
}

/// Runs `exe` with `args` and returns what it wrote to its standard
/// output. Panics with its standard error where it fails. A
/// [`Build::RaceChecked`] executable stops at the first race it finds
/// (unless `TSAN_OPTIONS` says otherwise).
pub fn run<I, S>(exe: &Path, args: I) -> Vec<u8>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let args: Vec<S> = args.into_iter().collect();
    let output = |command: &mut Command| {
        if std::env::var_os("TSAN_OPTIONS").is_none() {
            command.env("TSAN_OPTIONS", "halt_on_error=1");
        }
        command
            .args(&args)
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", exe.display()))
    };
    let mut out = output(&mut Command::new(exe));
    // ThreadSanitizer's runtime in g++ 12 cannot map its shadow memory
    // where the kernel randomizes addresses over more bits (Linux's
    // vm.mmap_rnd_bits above 28); without the randomization it can.
    if !out.status.success()
        && String::from_utf8_lossy(&out.stderr)
            .contains("ThreadSanitizer: unexpected memory mapping")
    {
        out = output(
            Command::new("setarch")
                .arg(std::env::consts::ARCH)
                .arg("--addr-no-randomize")
                .arg(exe),
        );
    }
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
    // A file of this call's own: harnesses are shared between test
    // processes, and a process's tests run on several threads.
    let mut file = tempfile::Builder::new()
        .prefix("candle-cuda-emulation-")
        .suffix(".in")
        .tempfile()
        .unwrap_or_else(|e| panic!("making an input file: {e}"));
    let bytes: Vec<u8> = input.iter().flat_map(|x| x.to_le_bytes()).collect();
    file.write_all(&bytes)
        .unwrap_or_else(|e| panic!("writing {}: {e}", file.path().display()));
    let out = run(
        exe,
        args.iter()
            .copied()
            .map(OsStr::new)
            .chain([file.path().as_os_str()]),
    );
    assert_eq!(out.len() % 8, 0, "{} wrote a partial f64", exe.display());
    out.chunks_exact(8)
        .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parameters_type_is_read_without_its_name() {
        for (param, want) in [
            ("const float *q", Some("const float *")),
            (" const  __half*  q ", Some("const __half *")),
            ("float **p", Some("float **")),
            ("size_t n", Some("size_t")),
            ("unsigned int x", Some("unsigned int")),
            ("const size_t numel", Some("size_t")),
            ("const int n_cols", Some("int")),
            ("const float * const x", Some("const float *")),
            ("const float", None),
            ("float", None),
            ("float *", None),
        ] {
            assert_eq!(c_type(param).as_deref(), want, "{param:?}");
        }
    }

    #[test]
    fn a_mark_waits_for_a_prune_and_finds_what_it_removed() {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("probe-00000000-0123456789abcdef");
        std::fs::write(&exe, b"").unwrap();
        let handle = std::fs::File::open(&exe).unwrap();
        // A prune deciding on the file.
        let pruning = std::fs::File::open(&exe).unwrap();
        pruning.lock().unwrap();
        let marking = {
            let exe = exe.clone();
            std::thread::spawn(move || mark_open(&handle, &exe))
        };
        std::fs::remove_file(&exe).unwrap();
        drop(pruning);
        let err = marking.join().unwrap().unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::NotFound);

        // Without a prune, the mark sets the last use.
        std::fs::write(&exe, b"").unwrap();
        let old = SystemTime::now() - Duration::from_secs(3600);
        std::fs::File::open(&exe)
            .unwrap()
            .set_modified(old)
            .unwrap();
        mark_used(&exe).unwrap();
        let used = std::fs::metadata(&exe).unwrap().modified().unwrap();
        assert!(used.elapsed().unwrap() < Duration::from_secs(600));
    }
}
