//! `workbook new-plugin`: a plugin crate to start from.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use workbook::Workbook;

use super::say;

/// The arguments of `workbook new-plugin`.
#[derive(Args, Debug)]
pub struct NewPluginArgs {
    /// The plugin's name (lowercase letters, digits, `-`, `_`).
    pub name: String,
    /// The folder to create [default: ./workbook-plugin-NAME].
    #[arg(long, value_name = "DIR")]
    pub path: Option<PathBuf>,
    /// The SDK's folder (crates/sdk of a workbook source tree)
    /// [default: the one this binary was built from].
    #[arg(long, value_name = "DIR")]
    pub sdk: Option<PathBuf>,
}

/// `workbook new-plugin NAME`.
pub fn new_plugin(wb: &Workbook, args: &NewPluginArgs) -> anyhow::Result<ExitCode> {
    let (name, path, sdk) = (&args.name, args.path.as_deref(), args.sdk.as_deref());
    let dir = path
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(format!("workbook-plugin-{name}")));
    let sdk = match sdk {
        Some(s) => s.to_path_buf(),
        None => workbook::new_plugin::built_sdk().ok_or_else(|| {
            anyhow::anyhow!(
                "the SDK's source is not where this workbook was built from; give its folder \
                 with --sdk DIR (crates/sdk of a workbook source tree)"
            )
        })?,
    };
    workbook::new_plugin::write(name, &dir, &sdk, &wb.registry().names())?;
    let d = dir.display();
    say(&format!(
        "created {d}: the `{name}` plugin, its test, and chapters/{name}.toml\n\n\
         next:\n  \
         cd {d}\n  \
         cargo test                      # its test: the buffer counted to the byte\n  \
         cargo build\n  \
         export PATH=\"${{CARGO_TARGET_DIR:-$PWD/target}}/debug:$PATH\"   # where cargo built it\n  \
         workbook describe {name}\n  \
         workbook run chapters/{name}.toml --check\n"
    ))?;
    Ok(ExitCode::SUCCESS)
}
