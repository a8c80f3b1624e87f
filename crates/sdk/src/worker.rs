//! Serving plugins over the [`protocol`](crate::protocol): what
//! `workbook worker` does for the built-in plugins, and what an external
//! plugin's `main` ([`crate::main!`]) does for its one.

use std::io::{BufRead, IsTerminal};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use crate::device::{self, DeviceChoice};
use crate::output::{CellOutput, PoolUse};
use crate::protocol::{
    Body, CellEnd, Message, ParamError, Request, RunCell, Verdict, PROTOCOL_VERSION,
};
use crate::{Context, DynPlugin, Meter};

/// The stack of a cell's thread. candle walks and drops autograd graphs
/// recursively, one frame per op: a graph of 100,000 ops overflows the usual
/// 8 MiB, and a stack overflow aborts the process where a panic would not.
/// The memory is reserved, not committed, until used.
pub const CELL_STACK: usize = 1 << 30;

/// What a cell's run produced: what it recorded, and how it ended.
#[derive(Debug, Clone)]
pub struct CellOutcome {
    /// What the plugin recorded, up to its end or its failure.
    pub output: CellOutput,
    /// How it ended, and its memory over the whole cell.
    pub end: CellEnd,
}

/// What a Rust process writes on standard error as it dies of its own
/// accord: a failed allocation (and the abort after it), a panic, a stack
/// overflow. A runner that quotes a dead process looks for these lines
/// first, before a tail that a backtrace or MPI's banner may fill.
pub const DYING_WORDS: [&str; 3] = [
    "memory allocation of",
    "panicked at",
    "has overflowed its stack",
];

/// A panic's payload as an error.
pub fn panicked(payload: &(dyn std::any::Any + Send)) -> anyhow::Error {
    let message = if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with no message".to_string()
    };
    anyhow::anyhow!("panicked: {message}")
}

/// Runs `plugin` with `params` in `ctx`; its errors and panics become the
/// outcome's error, and what it recorded before them is kept.
pub fn execute(
    plugin: &dyn DynPlugin,
    params: &toml::Table,
    mut ctx: Context,
    meter: &Arc<dyn Meter>,
) -> CellOutcome {
    let start = Instant::now();
    // The cell's own frame: its peak is the true high-water mark of the
    // cell, its regions' included, whatever they open and close inside it.
    meter.push_peak();
    let before = meter.snapshot();
    let result = catch_unwind(AssertUnwindSafe(|| plugin.run_with(&mut ctx, params)))
        .unwrap_or_else(|payload| Err(panicked(payload.as_ref())));
    let seconds = start.elapsed().as_secs_f64();
    let after = meter.snapshot();
    meter.pop_peak();
    CellOutcome {
        output: ctx.into_output(),
        end: CellEnd {
            error: result.err().map(|e| format!("{e:#}")),
            seconds,
            baseline: before.current,
            peak_bytes: after.peak,
            peak_by_category: after.peak_by_category,
            end: after.current,
            pool: PoolUse::between(&before, &after),
        },
    }
}

/// The protocol's channel: the standard output the process was started
/// with, once [`claim_stdout`] has moved it aside.
static PROTOCOL: std::sync::OnceLock<std::sync::Mutex<std::io::BufWriter<std::fs::File>>> =
    std::sync::OnceLock::new();

/// Keeps standard output for the protocol alone: the runner's pipe moves to
/// a descriptor of its own, and descriptor 1 becomes standard error, so a
/// plugin's `println!` reaches the terminal's error stream instead of
/// garbling a protocol line. (A cell's lines for the report go through
/// `Context::print`.)
fn claim_stdout() {
    use std::os::fd::FromRawFd;
    if PROTOCOL.get().is_some() {
        return;
    }
    use std::io::Write;
    let _ = std::io::stdout().flush();
    // SAFETY: dup and dup2 on this process's own standard descriptors; the
    // new descriptor is owned by the `File` alone.
    let fd = unsafe { libc::dup(1) };
    if fd < 0 {
        return;
    }
    if unsafe { libc::dup2(2, 1) } < 0 {
        unsafe { libc::close(fd) };
        return;
    }
    let file = unsafe { std::fs::File::from_raw_fd(fd) };
    let _ = PROTOCOL.set(std::sync::Mutex::new(std::io::BufWriter::with_capacity(
        1 << 16,
        file,
    )));
}

/// Writes one message to the runner. A runner that has gone away cannot be
/// told anything more: the process ends.
fn send(message: &Message) {
    let written = match PROTOCOL.get() {
        Some(out) => {
            let mut out = out.lock().unwrap_or_else(|e| e.into_inner());
            message.write_line(&mut *out)
        }
        None => message.write_line(&mut std::io::stdout().lock()),
    };
    if written.is_err() {
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

/// The error of a peer that speaks another version.
pub fn other_version(runner: u64) -> String {
    format!(
        "the runner speaks protocol version {runner}; this process speaks version \
         {PROTOCOL_VERSION}"
    )
}

/// Reads one request from `input` and answers it on standard output, with
/// `plugins`.
pub fn serve(plugins: &[&dyn DynPlugin], mut input: impl BufRead) -> ExitCode {
    claim_stdout();
    let mut line = String::new();
    if let Err(e) = input.read_line(&mut line) {
        return fatal(format!("cannot read the request: {e}"));
    }
    let request: Request = match serde_json::from_str(&line) {
        Ok(r) => r,
        Err(e) => {
            // Say which version this process speaks, in case that is why.
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
    let find = |name: &str| plugins.iter().copied().find(|p| p.name() == name);
    let names = || {
        plugins
            .iter()
            .map(|p| p.name())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match request.body {
        Body::Describe => {
            send(&Message::Described {
                protocol: PROTOCOL_VERSION,
                plugins: plugins.iter().map(|p| p.info()).collect(),
            });
            ExitCode::SUCCESS
        }
        Body::Check { plugin, tables } => {
            let Some(plugin) = find(&plugin) else {
                return fatal(format!(
                    "plugin `{plugin}` is not served here; served: {}",
                    names()
                ));
            };
            let verdicts = tables
                .into_iter()
                .map(|t| match serde_json::from_value::<toml::Table>(t) {
                    Ok(table) => plugin.verdict(&table),
                    Err(e) => Verdict {
                        params: Err(ParamError {
                            field: String::new(),
                            message: format!("the parameters are not a table: {e}"),
                        }),
                        violations: Vec::new(),
                        memory_floor: None,
                        unavailable: None,
                    },
                })
                .collect();
            send(&Message::Checked { verdicts });
            ExitCode::SUCCESS
        }
        Body::Run(cell) => {
            let Some(plugin) = find(&cell.plugin) else {
                return cell_error(format!(
                    "plugin `{}` is not served here; served: {}",
                    cell.plugin,
                    names()
                ));
            };
            run(plugin, cell)
        }
    }
}

fn run(plugin: &dyn DynPlugin, request: RunCell) -> ExitCode {
    let Some(choice) = DeviceChoice::from_name(&request.device) else {
        return fatal(format!(
            "unknown device `{}`; expected auto, cpu or cuda",
            request.device
        ));
    };
    let device = match device::select(choice) {
        Ok(d) => d,
        Err(e) => return fatal(e),
    };
    let meter = match device::meter_for(&device) {
        Ok(m) => m,
        Err(e) => return fatal(e.to_string()),
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
            .stack_size(CELL_STACK)
            .spawn_scoped(scope, || {
                if let Err(e) = device::warm_up(&device) {
                    return Err(format!("the device does not answer: {e}"));
                }
                send(&Message::Hello {
                    protocol: PROTOCOL_VERSION,
                    device: device::name(&device),
                    meter: meter.name().to_string(),
                });
                // The heap is held to the cap on the CPU, and to the
                // machine's memory where no cap is given (a runner that
                // could not tell the device sends none) or where the cap is
                // the card's; on a GPU the cap is the card's.
                let machine = device::meminfo("MemTotal:");
                let heap_cap = request.max_memory.or(machine);
                if let Some(why) = refusal_here(plugin, &params, &device, &meter, heap_cap) {
                    send(&Message::End(CellEnd::failed(why, 0.0)));
                    return Ok(());
                }
                if device.is_cpu() {
                    crate::meter::set_limit(heap_cap);
                } else {
                    crate::meter::set_device_limit(request.max_memory);
                    crate::meter::set_limit(machine);
                }
                let ctx =
                    Context::new(device.clone(), meter.clone(), request.check).with_sink(send);
                let CellOutcome { mut end, .. } = execute(plugin, &params, ctx, &meter);
                crate::meter::set_limit(None);
                crate::meter::set_device_limit(None);
                let refused = crate::meter::take_device_refusal();
                if let (Some(error), Some(refused)) = (&end.error, refused) {
                    // candle's words for it are the driver's error code. A
                    // refusal the plugin caught (a search for the largest
                    // batch that fits) is not what failed the cell.
                    if error.contains("CUDA_ERROR_OUT_OF_MEMORY") {
                        end.error = Some(format!("{refused}; the cell's error: {error}"));
                    }
                }
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
            panicked(payload.as_ref())
        )),
        Err(e) => fatal(format!("cannot start the cell's thread: {e}")),
    }
}

/// Why a cell is not started here: its plugin's floor is above the room it
/// has. On the CPU, `cpu_cap`. On a GPU, what the
/// card has free, with what the memory pool holds unused, which it hands
/// out first; the runner holds the cell to an explicit `--max-memory`
/// before it starts a worker, and only the worker knows the card.
fn refusal_here(
    plugin: &dyn DynPlugin,
    params: &toml::Table,
    device: &candle_core::Device,
    meter: &Arc<dyn Meter>,
    cpu_cap: Option<u64>,
) -> Option<String> {
    let floor = plugin.memory_floor_of(params)?;
    if device.is_cpu() {
        return crate::plugin::refusal(&floor, cpu_cap?, "a cell may hold here (`--max-memory`)");
    }
    let pooled = meter
        .snapshot()
        .pool
        .map_or(0, |p| p.reserved.saturating_sub(p.used));
    let room = device::gpu_free_memory(device)?.saturating_add(pooled);
    crate::plugin::refusal(&floor, room, &format!("free on {}", device::name(device)))
}

/// Runs one cell of `plugin` in this process, on the CPU, as a runner would:
/// for a plugin's own tests. The counting allocator must be the program's
/// global allocator (a test file declares it as [`crate::main!`] does). A
/// metric recorded but not declared in [`Plugin::metrics`](crate::Plugin)
/// is the outcome's error, as it fails the cell under a runner.
pub fn run_cell<P: crate::Plugin>(
    plugin: &P,
    params: &P::Params,
    check: bool,
) -> anyhow::Result<CellOutcome> {
    // Through JSON, as a runner sends them: a plugin without parameters
    // (`()`) has none to write, which TOML cannot say.
    let table = match serde_json::to_value(params)? {
        serde_json::Value::Null => toml::Table::new(),
        v => serde_json::from_value::<toml::Table>(v)?,
    };
    let device = candle_core::Device::Cpu;
    let meter = device::meter_for(&device)?;
    std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("workbook cell".into())
            .stack_size(CELL_STACK)
            .spawn_scoped(scope, || -> anyhow::Result<CellOutcome> {
                device::warm_up(&device)?;
                let ctx = Context::new(device.clone(), meter.clone(), check);
                let mut outcome = execute(plugin, &table, ctx, &meter);
                let declared = plugin.metrics();
                let extra = crate::metric::undeclared(
                    &declared,
                    outcome.output.metrics.keys().map(String::as_str),
                );
                if !extra.is_empty() && outcome.end.error.is_none() {
                    outcome.end.error = Some(format!(
                        "recorded metrics not declared in `Plugin::metrics`: {}",
                        extra.join(", ")
                    ));
                }
                Ok(outcome)
            })?
            .join()
            .map_err(|payload| panicked(payload.as_ref()))?
    })
}

/// The `main` of an external plugin: answers one request on standard
/// input. Use it through [`crate::main!`], which also installs the counting
/// allocator the CPU meter reads.
pub fn serve_plugin(plugin: impl DynPlugin) -> ExitCode {
    let stdin = std::io::stdin();
    if stdin.is_terminal() {
        eprintln!(
            "`{name}` is a workbook plugin: it answers a runner on standard input, not a \
             person. Put this program on PATH (or in a `plugins` folder beside a chapter), \
             name it in a chapter with `plugin = \"{name}\"`, and run that chapter with \
             `workbook run`; `workbook describe {name}` shows its parameters and metrics.",
            name = plugin.name()
        );
        return ExitCode::from(2);
    }
    serve(&[&plugin], stdin.lock())
}

/// The whole `main.rs` of an external plugin:
///
/// ```ignore
/// workbook_sdk::main!(MyPlugin);
/// ```
///
/// It installs the counting allocator (so the plugin's memory is measured
/// exactly as a built-in plugin's is) and serves the protocol on standard
/// input and output. Build it as an executable named
/// `workbook-plugin-NAME`, where NAME is the plugin's name.
#[macro_export]
macro_rules! main {
    ($plugin:expr) => {
        #[global_allocator]
        static WORKBOOK_ALLOCATOR: $crate::meter::CountingAllocator =
            $crate::meter::CountingAllocator;

        fn main() -> ::std::process::ExitCode {
            $crate::worker::serve_plugin($plugin)
        }
    };
}
