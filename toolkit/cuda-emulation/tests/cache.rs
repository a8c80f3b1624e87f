//! `compile` keeps one executable per version of a harness: the same
//! sources give the same executable without compiling again, and an edit to
//! a file the harness includes gives another.

use std::path::Path;

use candle_toolkit_cuda_emulation::{compile, run};

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
    let made = std::fs::metadata(&first).unwrap().modified().unwrap();

    let again = compile(&source);
    assert_eq!(again, first);
    assert_eq!(std::fs::metadata(&again).unwrap().modified().unwrap(), made);

    // The harness's own text is unchanged; only the header it includes.
    let source = harness(dir.path(), value + 1);
    let edited = compile(&source);
    assert_ne!(edited, first);
    assert_eq!(
        run(&edited, [] as [&str; 0]),
        (value + 1).to_string().as_bytes()
    );

    for exe in [first, edited] {
        std::fs::remove_file(exe).unwrap();
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
