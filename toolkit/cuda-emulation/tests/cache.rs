//! `compile` keeps one executable per version of a harness: the same
//! sources give the same executable without compiling again, an edit to a
//! file the harness includes gives another, which replaces the earlier
//! one once that has gone unused for an hour, and what has gone unused for
//! a week goes, unless another process is marking it as used at that
//! moment. Each test keeps its executables in a folder of its own.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use candle_toolkit_cuda_emulation::{compile, compile_in, run, SUPERSEDED_MINUTES, UNUSED_DAYS};

fn harness(dir: &Path, value: u32) -> PathBuf {
    std::fs::write(
        dir.join("value.h"),
        format!("constexpr int VALUE = {value};\n"),
    )
    .unwrap();
    let source = dir.join("cache_probe.cpp");
    std::fs::write(
        &source,
        "#include <cstdio>\n#include \"value.h\"\nint main() { std::printf(\"%d\", VALUE); }\n",
    )
    .unwrap();
    source
}

/// Sets `path`'s last use `minutes` ago.
fn used_ago(path: &Path, minutes: u64) {
    let when = SystemTime::now() - Duration::from_secs(minutes * 60);
    std::fs::File::open(path)
        .unwrap()
        .set_modified(when)
        .unwrap();
}

fn inode(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().ino()
}

#[test]
fn a_harness_compiles_once_per_version_of_what_it_includes() {
    let (dir, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let source = harness(dir.path(), 1);

    let first = compile_in(&source, cache.path());
    assert_eq!(run(&first, [] as [&str; 0]), b"1");
    // A compile renames a new file into place: the same inode is the same
    // file, not made again.
    let made = inode(&first);
    let again = compile_in(&source, cache.path());
    assert_eq!(again, first);
    assert_eq!(inode(&again), made);

    // The harness's own text is unchanged; only the header it includes.
    let source = harness(dir.path(), 2);
    let second = compile_in(&source, cache.path());
    assert_ne!(second, first);
    assert_eq!(run(&second, [] as [&str; 0]), b"2");
    // The first was used a moment ago: a test still running may hold it.
    assert!(first.exists(), "{} went while in use", first.display());

    // Once unused for longer than that, the next version replaces both.
    used_ago(&first, SUPERSEDED_MINUTES + 1);
    used_ago(&second, SUPERSEDED_MINUTES + 1);
    let third = compile_in(&harness(dir.path(), 3), cache.path());
    assert!(!first.exists(), "{} was kept", first.display());
    assert!(!second.exists(), "{} was kept", second.display());
    assert_eq!(run(&third, [] as [&str; 0]), b"3");
}

#[test]
fn a_version_being_marked_as_used_is_not_pruned() {
    let (dir, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let first = compile_in(&harness(dir.path(), 1), cache.path());
    used_ago(&first, SUPERSEDED_MINUTES + 1);
    // Another test process marking it as used right now holds a shared lock.
    let marking = std::fs::File::open(&first).unwrap();
    marking.lock_shared().unwrap();
    let second = compile_in(&harness(dir.path(), 2), cache.path());
    assert!(
        first.exists(),
        "{} went while being marked",
        first.display()
    );
    drop(marking);
    // Once no one holds it, the next version that builds removes it.
    used_ago(&second, SUPERSEDED_MINUTES + 1);
    let third = compile_in(&harness(dir.path(), 3), cache.path());
    assert!(!first.exists(), "{} was kept", first.display());
    assert!(!second.exists(), "{} was kept", second.display());
    assert_eq!(run(&third, [] as [&str; 0]), b"3");
}

#[test]
fn what_went_unused_for_a_week_goes_and_what_a_test_used_stays() {
    let (dir, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // A harness compiled long ago and used again now: it stays.
    let source = dir.path().join("reused_probe.cpp");
    std::fs::write(&source, "int main() { return 0; }\n").unwrap();
    let reused = compile_in(&source, cache.path());
    let made = inode(&reused);
    used_ago(&reused, (UNUSED_DAYS + 1) * 24 * 60);
    assert_eq!(compile_in(&source, cache.path()), reused);
    assert_eq!(inode(&reused), made, "reused, not compiled again");

    // Others' files: another clone's executables, a build folder left by a
    // killed test.
    let other = |name: &str, days: u64| {
        let path = cache.path().join(name);
        if name.ends_with(".build") {
            std::fs::create_dir(&path).unwrap();
        } else {
            std::fs::write(&path, b"").unwrap();
        }
        used_ago(&path, days * 24 * 60);
        path
    };
    let stale = other("stale_probe-00000000-0123456789abcdef", UNUSED_DAYS + 1);
    let stale_folder = other("stale_probe.build", UNUSED_DAYS + 1);
    let recent = other("recent_probe-00000000-0123456789abcdef", UNUSED_DAYS - 1);

    // A compile that builds prunes.
    let fresh = compile_in(&harness(dir.path(), 4), cache.path());
    assert_eq!(run(&fresh, [] as [&str; 0]), b"4");
    assert!(!stale.exists(), "{} was kept", stale.display());
    assert!(
        !stale_folder.exists(),
        "{} was kept",
        stale_folder.display()
    );
    assert!(recent.exists(), "{} went", recent.display());
    assert!(reused.exists(), "{} went", reused.display());
}

#[test]
fn compile_keeps_its_executables_beside_the_test() {
    let dir = tempfile::tempdir().unwrap();
    let source = dir
        .path()
        .join(format!("beside_probe_{}.cpp", std::process::id()));
    std::fs::write(&source, "int main() { return 0; }\n").unwrap();
    let exe = compile(&source);
    let beside = std::env::current_exe().unwrap();
    assert_eq!(
        exe.parent(),
        Some(beside.parent().unwrap().join("cuda-emulation").as_path())
    );
    std::fs::remove_file(exe).unwrap();
}

#[test]
fn a_kernel_that_does_not_compile_is_named_at_its_own_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("broken.h"),
        "int f() {\n  return undeclared;\n}\n",
    )
    .unwrap();
    let source = dir.path().join("broken_probe.cpp");
    std::fs::write(
        &source,
        "#include \"broken.h\"\nint main() { return f(); }\n",
    )
    .unwrap();
    let panic = std::panic::catch_unwind(|| compile(&source)).unwrap_err();
    let message = panic.downcast_ref::<String>().expect("a formatted panic");
    assert!(
        message.starts_with(&format!("compiling {} with `", source.display())),
        "{message}"
    );
    assert!(message.contains("broken.h:2:"), "{message}");
}
