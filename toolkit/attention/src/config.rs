//! What an attention call is configured with.

use candle_core::{bail, Result};

/// Causality, block sizes and scale of an attention call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlashConfig {
    /// Query `i` sees keys `0..=i` only.
    pub causal: bool,
    /// Query rows per block.
    pub q_block: usize,
    /// Key columns per block.
    pub k_block: usize,
    /// The scores' scale; `None` is `1 / sqrt(head_dim)`.
    pub scale: Option<f64>,
}

impl Default for FlashConfig {
    fn default() -> Self {
        Self {
            causal: false,
            q_block: 128,
            k_block: 128,
            scale: None,
        }
    }
}

impl FlashConfig {
    /// The default blocks, causal or not.
    pub fn causal(causal: bool) -> Self {
        Self {
            causal,
            ..Self::default()
        }
    }

    /// An error naming the block size that cannot be used.
    ///
    /// ```
    /// use candle_tiled_attention::FlashConfig;
    /// let bad = FlashConfig { q_block: 0, ..Default::default() };
    /// let err = bad.validate().unwrap_err().to_string();
    /// assert!(err.starts_with("q_block is 0: a block holds at least 1 row"));
    /// ```
    pub fn validate(&self) -> Result<()> {
        if self.q_block == 0 {
            bail!("q_block is 0: a block holds at least 1 row");
        }
        if self.k_block == 0 {
            bail!("k_block is 0: a block holds at least 1 column");
        }
        if let Some(s) = self.scale {
            if !s.is_finite() {
                bail!("scale is {s}: it must be finite");
            }
        }
        Ok(())
    }
}
