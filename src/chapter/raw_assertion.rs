//! An assertion as a chapter writes it: an expression, or a table that
//! also names the device it states a fact of.
//!
//! ```toml
//! assertions = [
//!   "peak_lean < 0.8 * peak_candle",
//!   { expr = "peak_bf16 > 1.05 * peak_f16", device = "cpu" },
//! ]
//! ```

use std::fmt;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use toml::Spanned;

/// One entry of `assertions` or `full_size_assertions`.
pub(super) struct RawAssertion {
    /// The expression.
    pub expr: String,
    /// Where the expression is, in the table form (the entry's own span
    /// locates the plain form).
    pub expr_span: Option<std::ops::Range<usize>>,
    /// The device it is checked on, where it names one.
    pub device: Option<Spanned<String>>,
}

/// The table form.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OnDeviceTable {
    expr: Spanned<String>,
    #[serde(default)]
    device: Option<Spanned<String>>,
}

impl<'de> Deserialize<'de> for RawAssertion {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Entry;
        impl<'de> Visitor<'de> for Entry {
            type Value = RawAssertion;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(
                    "an expression (\"peak < 0.5 * plain\"), or a table naming the device it \
                     holds on ({ expr = \"...\", device = \"cpu\" })",
                )
            }

            fn visit_str<E: de::Error>(self, expr: &str) -> Result<RawAssertion, E> {
                Ok(RawAssertion {
                    expr: expr.to_string(),
                    expr_span: None,
                    device: None,
                })
            }

            fn visit_map<M: MapAccess<'de>>(self, map: M) -> Result<RawAssertion, M::Error> {
                let t = OnDeviceTable::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(RawAssertion {
                    expr_span: Some(t.expr.span()),
                    expr: t.expr.into_inner(),
                    device: t.device,
                })
            }
        }
        deserializer.deserialize_any(Entry)
    }
}

/// An assertion: an expression, or a table naming the device it holds on.
#[derive(schemars::JsonSchema)]
#[serde(untagged, deny_unknown_fields)]
#[allow(dead_code)] // describes the format; never built
pub(super) enum AssertionSchema {
    /// An expression over the cell's metrics that must be true
    /// (`peak_ratio < 0.5`).
    Expr(String),
    /// An expression that states a fact of one kind of device: checked where
    /// the cell ran on it, reported as skipped elsewhere.
    OnDevice {
        /// The expression.
        expr: String,
        /// `cpu` or `cuda`; every device where absent.
        #[schemars(regex(pattern = r"^(cpu|cuda)$"))]
        device: Option<String>,
    },
}
