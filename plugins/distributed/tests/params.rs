//! The data-parallel cell's parameters: what it refuses, and with what
//! message; and what a build without MPI says.

use workbook_distributed::{Params, ZeroStages};

mod common;
use common::refusals;

#[test]
fn the_defaults_are_valid() {
    assert_eq!(
        refusals(&ZeroStages, Params::default()),
        Vec::<String>::new()
    );
}

#[test]
fn rank_counts_may_split_the_batch_unevenly_but_not_past_its_rows() {
    let p = Params {
        batch: 12,
        ranks: vec![1, 0, 8, 13, 65],
        ..Params::default()
    };
    assert_eq!(
        refusals(&ZeroStages, p),
        [
            "ranks[1]: 0 (allowed: at least 1)",
            "ranks[3]: 13 (allowed: at most the batch, 12 rows (each rank trains on one row \
             at least))",
            "ranks[4]: 65 (allowed: at most 64)",
        ]
    );
}

#[test]
fn an_empty_list_of_ranks_is_refused() {
    let p = Params {
        ranks: vec![],
        ..Params::default()
    };
    assert_eq!(
        refusals(&ZeroStages, p),
        ["ranks: [] (allowed: a list of at least 1 entry)"]
    );
}

#[test]
fn sizes_and_limits_are_checked() {
    let p = Params {
        layers: 0,
        steps: 0,
        timeout_seconds: 0.0,
        ..Params::default()
    };
    let r = refusals(&ZeroStages, p);
    assert_eq!(r.len(), 3, "{r:?}");
    assert!(r[0].starts_with("layers: 0"), "{r:?}");
    assert!(r[1].starts_with("steps: 0"), "{r:?}");
    assert!(r[2].starts_with("timeout_seconds: 0"), "{r:?}");
}

#[test]
fn a_width_that_cannot_be_halved_is_refused() {
    let p = Params {
        width: 1,
        ..Params::default()
    };
    assert_eq!(refusals(&ZeroStages, p), ["width: 1 (allowed: at least 2)"]);
}

#[cfg(not(feature = "mpi"))]
#[test]
fn without_mpi_a_job_says_what_to_install() {
    use workbook_distributed::launch::{launch, Job};
    let job = Job {
        ranks: 2,
        layers: 1,
        width: 8,
        batch: 4,
        steps: 1,
        seed: 1,
        precision: workbook_planner::stage::Precision::F32,
        timeout: std::time::Duration::from_secs(5),
        max_memory: None,
    };
    let err = launch(&job).unwrap_err().to_string();
    assert!(
        err.contains("built without the `mpi` feature")
            && err.contains("apt install openmpi-bin libopenmpi-dev libclang-dev"),
        "{err}"
    );
}
