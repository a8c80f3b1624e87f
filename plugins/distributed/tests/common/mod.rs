//! What the parameter tests share.

use workbook_sdk::Plugin;

/// What `plugin` refuses in `p`, one line each: field, what was given, and
/// what is allowed.
pub fn refusals<P: Plugin>(plugin: &P, p: P::Params) -> Vec<String> {
    plugin
        .validate(&p)
        .iter()
        .map(|v| format!("{}: {} ({})", v.field, v.given, v.allowed))
        .collect()
}
