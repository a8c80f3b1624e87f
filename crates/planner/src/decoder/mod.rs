//! Chapter 5's decoders: the closed-form prediction of a lean training
//! step's peak, and the plan that picks an option to fit a device.
//!
//! Every term is a count of tensors: the training state, what the lean
//! graph keeps for the backward (read off the graph with `candle-ledger`,
//! tensor by tensor), and what the backward holds beside them at its peak.
//! In candle the graph keeps every saved tensor until the loss is dropped,
//! so a step peaks at one of a few moments, each counted by an allocator
//! and written here as the tensors alive then:
//!
//! * at the head's backward: the logits' gradient and the head weight's
//!   gradient passing through candle's gradient store (the product, the
//!   zeros it is added to, and their sum), or, with the fused loss, a
//!   chunk's logits and gradients beside the weight's gradient summed so
//!   far;
//! * at the end, when every gradient exists and the embedding's is made
//!   (and added to the tied head's);
//! * checkpointed, at the head with only the blocks' inputs and one
//!   block's tensors saved, or at the end with nothing saved any more;
//! * at the optimizer's step, for an offloaded or ZeRO optimizer: the
//!   step's gradients (or ZeRO-2's blocks of them) beside the buffers that
//!   move the largest parameter.
//!
//! With ZeRO every term is one rank's, training on its share of the batch;
//! with offload, the device's, the host's memory left out.
//!
//! In half precision on the CPU, candle widens a product's operands and
//! result to f32: those copies are terms too. They are the CPU's: a GPU's
//! products run in bf16, so on a card the bf16 terms overestimate.

mod plan;
mod predict;
mod train;
mod verify;

pub use plan::{plan_decoder, Card, DecoderOption, DecoderPlan, DecoderRequest, CARDS, MARGIN};
pub use predict::{
    predict, predict_peak, saved_per_block, DecoderRecipe, Moment, Prediction, Sharing,
};
pub use train::{train_measured, train_step, Measured, Run, Trainer};
pub use verify::verify;

/// SmolLM2-135M's shape, for the tests.
#[cfg(test)]
fn smollm2() -> workbook_models::llama::LlamaConfig {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../models/smollm2-135m.config.json"
    );
    workbook_models::llama::LlamaConfig::from_file(path).unwrap()
}
