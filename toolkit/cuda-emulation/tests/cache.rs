//! `compile` keeps one executable per version of a harness: the same
//! sources give the same executable without compiling again, an edit to a
//! file the harness includes gives another in its place, and what no test
//! has run for a week goes.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, SystemTime};

use candle_toolkit_cuda_emulation::{cache_dir, compile, run, UNUSED_DAYS};

fn harness(dir: &Path, value: u32) -> std::path::PathBuf {
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

#[test]
fn a_harness_compiles_once_per_version_of_what_it_includes() {
    let dir = tempfile::tempdir().unwrap();
    // A value of this run's own, so no earlier run's executable matches.
    let value = std::process::id();
    let source = harness(dir.path(), value);

    let first = compile(&source);
    assert_eq!(run(&first, [] as [&str; 0]), value.to_string().as_bytes());
    // A compile renames a new file into place: the same inode is the same
    // file, not made again.
    let inode = std::fs::metadata(&first).unwrap().ino();

    let again = compile(&source);
    assert_eq!(again, first);
    assert_eq!(std::fs::metadata(&again).unwrap().ino(), inode);

    // The harness's own text is unchanged; only the header it includes.
    let source = harness(dir.path(), value + 1);
    let edited = compile(&source);
    assert_ne!(edited, first);
    assert_eq!(
        run(&edited, [] as [&str; 0]),
        (value + 1).to_string().as_bytes()
    );
    // The new version replaced the old one.
    assert!(!first.exists(), "{} was kept", first.display());

    std::fs::remove_file(edited).unwrap();
}

#[test]
fn what_no_test_ran_for_a_week_goes_and_what_one_ran_stays() {
    let dir = tempfile::tempdir().unwrap();
    let cache = cache_dir();
    std::fs::create_dir_all(&cache).unwrap();
    let id = std::process::id();
    let file = |name: &str, age_days: u64| {
        let path = cache.join(format!("{name}-{id}-00000000-0123456789abcdef"));
        std::fs::write(&path, b"").unwrap();
        let when = SystemTime::now() - Duration::from_secs(age_days * 24 * 60 * 60);
        std::fs::File::open(&path)
            .unwrap()
            .set_modified(when)
            .unwrap();
        path
    };
    let stale = file("stale", UNUSED_DAYS + 1);
    let recent = file("recent", UNUSED_DAYS - 1);
    // A harness compiled earlier and run again: used now, however old.
    let source = dir.path().join("reused_probe.cpp");
    std::fs::write(&source, format!("int main() {{ return {}; }}\n", id % 100)).unwrap();
    let reused = compile(&source);
    let old = SystemTime::now() - Duration::from_secs((UNUSED_DAYS + 1) * 24 * 60 * 60);
    std::fs::File::open(&reused)
        .unwrap()
        .set_modified(old)
        .unwrap();
    assert_eq!(compile(&source), reused);

    // A new compile prunes.
    let fresh = harness(dir.path(), id.wrapping_add(7));
    let exe = compile(&fresh);
    assert!(!stale.exists(), "{} was kept", stale.display());
    assert!(recent.exists(), "{} went", recent.display());
    assert!(reused.exists(), "{} went", reused.display());

    for path in [recent, reused, exe] {
        std::fs::remove_file(path).unwrap();
    }
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
