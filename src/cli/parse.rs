//! The values of flags: each parser's error says what is allowed.

use std::time::Duration;

use workbook::DeviceChoice;

pub fn parse_budget(s: &str) -> Result<u64, String> {
    bytes_above_zero(s, "the budget")
}

pub fn parse_dtype(s: &str) -> Result<workbook_sdk::candle::DType, String> {
    workbook_sdk::parse_dtype(s)
        .map_err(|_| format!("`{s}` is not a dtype; expected one of: f32, bf16, f16"))
}

/// The most steps `plan --verify` runs: its peak is reached within the
/// first few, and each step's measurement is kept for the report.
pub const MOST_STEPS: usize = 10_000;

pub fn parse_steps(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=MOST_STEPS).contains(&n) => Ok(n),
        _ => Err(format!(
            "`{s}` is not a number of steps; allowed: 1 to {MOST_STEPS}"
        )),
    }
}

/// A number of ranks from 1 to `most`.
fn ranks_up_to(s: &str, most: usize) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=most).contains(&n) => Ok(n),
        _ => Err(format!(
            "`{s}` is not a number of ranks; allowed: 1 to {most}"
        )),
    }
}

/// `plan --ranks`: the planner rehearses one rank of any job.
pub fn parse_ranks(s: &str) -> Result<usize, String> {
    ranks_up_to(s, 1024)
}

/// `run --ranks`: what a data-parallel cell allows.
pub fn parse_run_ranks(s: &str) -> Result<usize, String> {
    ranks_up_to(s, workbook_distributed::MAX_RANKS)
}

pub fn parse_job_seconds(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!(
            "`{s}` is not a time limit; allowed: a whole number of seconds, at least 1"
        )),
    }
}

pub fn parse_stage(s: &str) -> Result<workbook_planner::Stage, String> {
    use workbook_planner::Stage;
    match Stage::ALL.into_iter().find(|stage| stage.name() == s) {
        Some(stage) => Ok(stage),
        None => Err(format!(
            "`{s}` is not a stage; allowed: {}",
            Stage::ALL.map(Stage::name).join(", ")
        )),
    }
}

pub fn parse_recipe(s: &str) -> Result<workbook_models::Recipe, String> {
    use workbook_models::Recipe;
    Recipe::from_name(s).ok_or_else(|| {
        format!(
            "`{s}` is not a recipe; expected one of: {}",
            Recipe::ALL.map(Recipe::name).join(", ")
        )
    })
}

pub fn parse_device(s: &str) -> Result<DeviceChoice, String> {
    DeviceChoice::from_name(s).ok_or_else(|| {
        format!(
            "`{s}` is not a device; expected one of: {}",
            DeviceChoice::ALL.map(DeviceChoice::name).join(", ")
        )
    })
}

pub fn parse_seconds(s: &str) -> Result<Duration, String> {
    let value: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    workbook::chapter::seconds(value)
}

/// A size such as `8GiB`, above zero; `what` names it in the error.
pub fn bytes_above_zero(s: &str, what: &str) -> Result<u64, String> {
    let size: bytesize::ByteSize = s.parse().map_err(|e| {
        format!("`{s}` is not a size ({e}); write it as bytes or with a unit: 8GiB, 500MB")
    })?;
    if size.as_u64() == 0 {
        return Err(format!("{what} must be above 0 bytes"));
    }
    Ok(size.as_u64())
}

pub fn parse_size(s: &str) -> Result<u64, String> {
    bytes_above_zero(s, "the memory limit")
}
