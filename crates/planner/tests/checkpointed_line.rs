//! A checkpointed direct step's peak at a batch past the calibrated ones:
//! each segment's recompute and its backward are stretches of their own,
//! so the line of the one that overtakes the others at a larger batch is
//! seen from batches 1, 2 and 4.

use workbook_models::GptConfig;
use workbook_planner::plan::{plan, verify, VerifyRequest};

mod common;

#[test]
fn a_checkpointed_plan_at_four_times_the_calibrated_batch_is_within_one_percent() {
    let mut ctx = common::context();
    // Chapter 3's base model. With the recompute and the backward in one
    // stretch, this prediction was 3.4% under the measured peak (and 3.7%
    // at batch 32): the recompute's line is steeper, the backward's higher
    // at batch 4.
    let req = common::direct_tiled(GptConfig::default(), 16, true);
    let planned = plan(&mut ctx, &req).unwrap();
    let whole = planned
        .candidates
        .iter()
        .find(|c| c.checkpointed && c.micro_batch == 16)
        .expect("a checkpointed option of the whole batch");
    let measured = verify(&mut ctx, &VerifyRequest::new(&req, whole, 2).unwrap(), None).unwrap();
    let error = measured.error();
    assert!(
        error.abs() <= 0.01,
        "predicted {}, measured {}: {:+.2}%",
        measured.predicted,
        measured.peak,
        100.0 * error
    );
}
