//! What the planner's integration tests share: a context on the CPU under
//! the counting allocator, and a request for f32 direct_tiled plans.

use std::sync::Arc;

use workbook_models::{GptConfig, Recipe};
use workbook_planner::plan::PlanRequest;
use workbook_sdk::candle::{DType, Device};
use workbook_sdk::meter::{CountingAllocator, CpuMeter};
use workbook_sdk::Context;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// A context on the CPU, metered by the counting allocator.
pub fn context() -> Context {
    let meter = Arc::new(CpuMeter::new().unwrap());
    Context::new(Device::Cpu, meter, false)
}

/// A plan for `model` at `batch` sequences with the direct tiled recipe in
/// f32 on one process, within 1 TiB (so the whole batch fits), with or
/// without checkpointing as an option.
pub fn direct_tiled(model: GptConfig, batch: usize, checkpointing: bool) -> PlanRequest {
    PlanRequest {
        model,
        batch,
        budget: 1 << 40,
        margin: 0.05,
        dtypes: vec![DType::F32],
        recipes: vec![Recipe::DirectTiled],
        checkpointing,
        seed: 5,
        ranks: 1,
        stages: Vec::new(),
    }
}
