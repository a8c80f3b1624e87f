//! The worker: the process that runs one cell for a runner, speaking the
//! protocol of [`workbook_sdk::protocol`] over its standard input and
//! output. `workbook worker` is this; the runner starts one per cell.

use std::io::BufRead;
use std::process::ExitCode;

use workbook_sdk::protocol::{CellEnd, Message, Request, PROTOCOL_VERSION};
use workbook_sdk::Context;

use crate::registry::Registry;
use crate::runner::{self, CellOutcome, DeviceChoice};

/// Writes one message to standard output. A runner that has gone away
/// cannot be told anything more: the worker ends.
fn send(message: &Message) {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if message.write_line(&mut out).is_err() {
        std::process::exit(3);
    }
}

fn fatal(message: String) -> ExitCode {
    send(&Message::Fatal { message });
    ExitCode::from(2)
}

fn cell_error(message: String) -> ExitCode {
    send(&Message::End(CellEnd::failed(message, 0.0)));
    ExitCode::SUCCESS
}

fn other_version(runner: u64) -> String {
    format!(
        "the runner speaks protocol version {runner}; this worker speaks version \
         {PROTOCOL_VERSION}"
    )
}

/// Reads one request from `input` and runs it with `registry`'s plugins,
/// answering on standard output.
pub fn serve(registry: &Registry, mut input: impl BufRead) -> ExitCode {
    let mut line = String::new();
    if let Err(e) = input.read_line(&mut line) {
        return fatal(format!("cannot read the request: {e}"));
    }
    let request: Request = match serde_json::from_str(&line) {
        Ok(r) => r,
        Err(e) => {
            // Say which version this worker speaks, in case that is why.
            let version = serde_json::from_str::<serde_json::Value>(&line)
                .ok()
                .and_then(|v| v.get("protocol").and_then(|p| p.as_u64()));
            return fatal(match version {
                Some(v) if v != u64::from(PROTOCOL_VERSION) => other_version(v),
                _ => format!("the request is not protocol version {PROTOCOL_VERSION}'s: {e}"),
            });
        }
    };
    if request.protocol != PROTOCOL_VERSION {
        return fatal(other_version(request.protocol.into()));
    }
    let Some(choice) = DeviceChoice::from_name(&request.device) else {
        return fatal(format!(
            "unknown device `{}`; expected auto, cpu or cuda",
            request.device
        ));
    };
    let device = match runner::select_device(choice) {
        Ok(d) => d,
        Err(e) => return fatal(e.to_string()),
    };
    let meter = match runner::select_meter(&device) {
        Ok(m) => m,
        Err(e) => return fatal(e.to_string()),
    };
    let Some(plugin) = registry.get(&request.plugin) else {
        return cell_error(format!(
            "plugin `{}` is not registered in this worker; its plugins: {}",
            request.plugin,
            registry.names().join(", ")
        ));
    };
    let params: toml::Table = match serde_json::from_value(request.params.clone()) {
        Ok(p) => p,
        Err(e) => return cell_error(format!("the parameters are not a table: {e}")),
    };
    // The cell runs on a thread with the stack candle's recursive graph
    // walks need, warmed up itself (gemm's packing buffers are per thread).
    let ran = std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("workbook cell".into())
            .stack_size(runner::CELL_STACK)
            .spawn_scoped(scope, || {
                if let Err(e) = workbook_sdk::device::warm_up(&device) {
                    return Err(format!("the device does not answer: {e}"));
                }
                send(&Message::Hello {
                    protocol: PROTOCOL_VERSION,
                    device: runner::device_name(&device),
                    meter: meter.name().to_string(),
                });
                workbook_sdk::meter::set_limit(request.max_memory);
                let ctx =
                    Context::new(device.clone(), meter.clone(), request.check).with_sink(send);
                let CellOutcome { end, .. } = runner::execute(plugin, &params, ctx, &meter);
                workbook_sdk::meter::set_limit(None);
                send(&Message::End(end));
                Ok(())
            })
            .map(|h| h.join())
    });
    match ran {
        Ok(Ok(Ok(()))) => ExitCode::SUCCESS,
        Ok(Ok(Err(e))) => fatal(e),
        Ok(Err(payload)) => fatal(format!(
            "the cell's thread failed: {}",
            runner::panicked(payload.as_ref())
        )),
        Err(e) => fatal(format!("cannot start the cell's thread: {e}")),
    }
}
