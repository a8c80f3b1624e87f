//! `workbook describe`: a plugin's parameters and metrics.

use std::process::ExitCode;

use clap::{Args, ValueEnum};
use workbook::registry::Unusable;
use workbook::Workbook;

use super::say;

/// The arguments of `workbook describe`.
#[derive(Args, Debug)]
pub struct DescribeArgs {
    /// A plugin's name.
    pub plugin: Option<String>,
    /// Output format on stdout.
    #[arg(long, value_enum, default_value_t = DescribeFormat::Text)]
    pub format: DescribeFormat,
}

/// How `describe` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DescribeFormat {
    /// Readable text.
    Text,
    /// The plugins' descriptions as JSON: name, description, the JSON
    /// Schema of the parameters, the metrics.
    Json,
    /// The Markdown reference page (docs/plugins.md).
    Markdown,
}

/// `workbook describe [PLUGIN]`.
pub fn describe(wb: &Workbook, args: &DescribeArgs) -> anyhow::Result<ExitCode> {
    let (plugin, format) = (args.plugin.as_deref(), args.format);
    let registry = wb.registry();
    let infos: Vec<workbook::sdk::PluginInfo> = match plugin {
        Some(name) => match registry.resolve(name) {
            Ok(p) => vec![p.info()],
            Err(Unusable::Refused(why)) => anyhow::bail!("plugin `{name}` cannot be used: {why}"),
            Err(Unusable::Unknown) => anyhow::bail!(
                "unknown plugin `{}`{}; plugins: {}",
                workbook::excerpt::quote(name),
                workbook::suggest::did_you_mean(name, registry.names()),
                registry.names().join(", ")
            ),
        },
        None => registry.iter().map(|p| p.info()).collect(),
    };
    let text = match format {
        DescribeFormat::Text => infos
            .iter()
            .map(workbook::describe::text)
            .collect::<Vec<_>>()
            .join("\n"),
        DescribeFormat::Json => {
            let mut json = match (plugin, infos.as_slice()) {
                (Some(_), [one]) => serde_json::to_string_pretty(one)?,
                _ => serde_json::to_string_pretty(&infos)?,
            };
            json.push('\n');
            json
        }
        DescribeFormat::Markdown => workbook::describe::markdown(&infos),
    };
    say(&text)?;
    Ok(ExitCode::SUCCESS)
}
