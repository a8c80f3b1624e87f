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

    /// The blocks PyTorch's CPU flash kernel picks for `n` queries: 32 query
    /// rows below 192 queries, 64 below 768, 256 from there (more blocks
    /// for short sequences keep every thread busy, larger ones for long
    /// sequences make larger matrix products), and 512 keys.
    ///
    /// ```
    /// use candle_tiled_attention::FlashConfig;
    /// let cfg = FlashConfig::for_length(true, 4096);
    /// assert_eq!((cfg.causal, cfg.q_block, cfg.k_block), (true, 256, 512));
    /// assert_eq!(FlashConfig::for_length(false, 100).q_block, 32);
    /// ```
    pub fn for_length(causal: bool, n: usize) -> Self {
        let q_block = match n {
            0..192 => 32,
            192..768 => 64,
            _ => 256,
        };
        Self {
            causal,
            q_block,
            k_block: 512,
            scale: None,
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
