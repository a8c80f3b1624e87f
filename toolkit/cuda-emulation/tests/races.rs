//! A race-checked build (`Build::RaceChecked`) stops at a race between a
//! block's threads, on shared memory or on an output, and names the
//! kernel's line; barriers and shuffles order what they should, so a
//! kernel without a race runs clean and gives the plain build's result.

use std::path::{Path, PathBuf};

use candle_toolkit_cuda_emulation::{compile_as, run, Build};

fn harness(name: &str, build: Build) -> PathBuf {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/{name}/harness.cpp"));
    compile_as(&source, build)
}

/// What each thread read from its neighbour, by either build.
fn read(build: Build) -> Vec<i64> {
    let out = run(&harness("races", build), ["barrier"]);
    String::from_utf8(out)
        .unwrap()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect()
}

#[test]
fn a_block_without_a_race_runs_clean_and_gives_the_plain_result() {
    let want: Vec<i64> = (0..64).map(|t| 3 * ((t + 1) % 64) + 1).collect();
    assert_eq!(read(Build::Plain), want);
    assert_eq!(read(Build::RaceChecked), want);
}

/// The race-checked harness run with `mode`, which must fail: what `run`
/// panics with (the harness's standard error).
fn raced(mode: &str) -> String {
    let exe = harness("races", Build::RaceChecked);
    let err = std::panic::catch_unwind(|| run(&exe, [mode])).expect_err("no race was reported");
    match err.downcast::<String>() {
        Ok(message) => *message,
        Err(_) => panic!("run panicked without a message"),
    }
}

#[test]
fn a_tile_read_with_no_barrier_after_its_write_is_a_race() {
    let err = raced("none");
    assert!(err.contains("ThreadSanitizer: data race"), "{err}");
    // The neighbour's read, at the kernel's line.
    assert!(err.contains("races/harness.cpp:22"), "{err}");
}

#[test]
fn threads_writing_one_output_element_race() {
    let err = raced("same");
    assert!(err.contains("ThreadSanitizer: data race"), "{err}");
    assert!(err.contains("races/harness.cpp:23"), "{err}");
}

#[test]
fn warp_shuffles_order_their_exchanges() {
    // The shuffle harness's butterflies, race-checked: each exchange of a
    // warp's slots is ordered by the warp's barriers.
    let plain = run(&harness("shuffle", Build::Plain), ["64"]);
    let checked = run(&harness("shuffle", Build::RaceChecked), ["64"]);
    assert_eq!(checked, plain);
}
