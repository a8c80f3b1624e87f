//! The `gpt_ranks` cell in a build without MPI: the one process is still
//! planned and measured, and what to install is said once for every rank
//! count it could not run.

#![cfg(not(feature = "mpi"))]

use std::sync::Arc;

use workbook_distributed::gpt::Params;
use workbook_distributed::launch::INSTALL;
use workbook_distributed::GptRanks;
use workbook_models::gpt::testing::SMALL;
use workbook_sdk::candle::Device;
use workbook_sdk::meter::{CountingAllocator, CpuMeter};
use workbook_sdk::{Context, Plugin};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

#[test]
fn one_process_is_measured_and_the_install_is_said_once() {
    let p = Params {
        model: SMALL,
        batch: 4,
        ranks: vec![1, 2, 4],
        ..Params::default()
    };
    let meter = Arc::new(CpuMeter::new().unwrap());
    let mut ctx = Context::new(Device::Cpu, meter, true);
    let err = GptRanks.run(&mut ctx, p).unwrap_err().to_string();
    assert_eq!(
        err,
        format!(
            "2 and 4 ranks: this runs MPI ranks, and this workbook was built without the `mpi` \
             feature: {INSTALL}"
        )
    );
    let metrics = &ctx.output().metrics;
    let error = metrics["single_error"];
    assert!(error.abs() < 0.05, "{metrics:?}");
    assert!(metrics["single_peak"] > 0.0, "{metrics:?}");
    assert!(!metrics.keys().any(|k| k.contains("_n2_")), "{metrics:?}");
}
