//! `__shfl_xor_sync` as the kernels use it: a butterfly over a warp or a
//! group of lanes leaves every lane holding the group's sum, a lane past
//! its group of `width` reads its own value, and a lane mask counts by its
//! low 5 bits; lanes at different shuffles, a read past a partial warp and
//! a width that is not a power of 2 stop the harness.

use std::path::{Path, PathBuf};

use candle_toolkit_cuda_emulation::{compile, run};

/// The shuffles' harness, compiled (or found compiled).
fn harness() -> PathBuf {
    compile(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/shuffle/harness.cpp"))
}

/// Each thread's (warp sum, group-of-4 sum, value read across groups,
/// value read with lane mask 33).
fn shuffled(block: u32) -> Vec<[i64; 4]> {
    let out = run(&harness(), [block.to_string()]);
    String::from_utf8(out)
        .unwrap()
        .lines()
        .map(|line| {
            let v: Vec<i64> = line.split(' ').map(|x| x.parse().unwrap()).collect();
            [v[0], v[1], v[2], v[3]]
        })
        .collect()
}

#[test]
fn butterflies_sum_over_their_lanes_in_every_warp() {
    let got = shuffled(64);
    assert_eq!(got.len(), 64);
    for (t, [warp, group, crossed, wrapped]) in got.into_iter().enumerate() {
        let t = t as i64;
        let first = t / 32 * 32;
        assert_eq!(warp, (first..first + 32).sum::<i64>(), "thread {t}");
        let start = t / 4 * 4;
        assert_eq!(group, (start..start + 4).sum::<i64>(), "thread {t}");
        // Lane ^ 4 is in the next group of 4 for lanes 0-3 of each 8 and
        // in the previous one for lanes 4-7, which may read it.
        let lane = t % 32;
        let want = if lane % 8 < 4 {
            t * 10
        } else {
            (first + (lane ^ 4)) * 10
        };
        assert_eq!(crossed, want, "thread {t}");
        assert_eq!(wrapped, first + (lane ^ 1), "thread {t}");
    }
}

/// The harness run with `args`, which must fail: what it printed to stderr.
fn stopped(args: &[&str]) -> String {
    let out = std::process::Command::new(harness())
        .args(args)
        .output()
        .unwrap();
    assert!(!out.status.success(), "{args:?} passed");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_shuffle_past_a_partial_warp_stops_the_harness() {
    // 40 threads: a warp of 32 and one of 8. The warp-wide butterfly reads
    // lane 8 and up of an 8-lane warp: the emulation stops rather than make
    // a value up.
    let err = stopped(&["40"]);
    assert!(err.contains("reads lane"), "{err}");
}

#[test]
fn lanes_at_different_shuffles_stop_the_harness() {
    // Even and odd lanes each shuffle once, at two calls: on a card the
    // result is undefined; counted alone the barrier would pair them up.
    let err = stopped(&["32", "split"]);
    assert!(
        err.contains("lanes of a warp reach different shuffles: lane "),
        "{err}"
    );
    assert!(err.contains("harness.cpp:"), "{err}");
}

#[test]
fn a_width_that_is_not_a_power_of_2_stops_the_harness() {
    let err = stopped(&["32", "width"]);
    assert!(err.contains("with width 3: a power of 2 up to 32"), "{err}");
}
