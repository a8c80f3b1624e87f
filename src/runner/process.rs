//! Running one cell in a worker process of its own (see
//! [`workbook_sdk::protocol`]): a crash, an abort, a signal or the time
//! limit ends that cell alone, and what it recorded before is kept.

use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use workbook_sdk::output::CellOutput;
use workbook_sdk::protocol::{CellEnd, Message, Request, MAX_LINE_BYTES, PROTOCOL_VERSION};

use crate::child::{self, Group, Line};
use crate::excerpt::excerpt;
use workbook_sdk::worker::CellOutcome;

/// How to start a worker: a program and its arguments, which together serve
/// one [`Request`] on standard input (`workbook worker`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerCommand {
    /// The program.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
}

impl WorkerCommand {
    /// An external plugin's program, which takes no arguments.
    pub fn external(program: &std::path::Path) -> Self {
        Self {
            program: program.to_path_buf(),
            args: Vec::new(),
        }
    }

    /// This executable, as `workbook worker`.
    pub fn current_exe() -> std::io::Result<Self> {
        Ok(Self {
            program: std::env::current_exe()?,
            args: vec!["worker".into()],
        })
    }
}

/// What the worker said of itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hello {
    pub device: String,
    pub meter: String,
}

/// How a worker's cell went.
pub(crate) enum WorkerResult {
    /// It ran (to its end or to its failure): the outcome, and the worker's
    /// hello if it got that far.
    Ran(Box<CellOutcome>, Option<Hello>),
    /// The worker cannot run cells at all (no device; another protocol).
    Fatal(String),
}

/// What the parent watches for while a worker runs.
pub(crate) struct Watch<'a> {
    pub limit: Duration,
    pub interrupt: Option<&'a AtomicBool>,
    pub progress: &'a dyn Fn(&str),
    /// The cap the worker was given, to name when it ran out of memory.
    pub max_memory: Option<u64>,
}

/// The error of the cell that was running when the run was stopped.
const INTERRUPTED: &str = "interrupted: the run was stopped (Ctrl-C) while this cell ran";

/// How often the parent looks at the interrupt flag while it waits.
const TICK: Duration = Duration::from_millis(100);

enum Event {
    Message(Box<Message>),
    Garbled(String),
    /// A line past the protocol's cap: reading stopped there.
    Overlong(String),
}

/// How long a stopped worker's group has after SIGTERM (time for `mpirun`
/// to end its ranks) before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(3);

/// How long the readers of a finished worker's pipes may take to see them
/// close; past it they are left behind rather than waited on.
const READER_GRACE: Duration = Duration::from_secs(2);

/// Runs one cell's request in a new worker.
pub(crate) fn run(command: &WorkerCommand, request: &Request, watch: &Watch<'_>) -> WorkerResult {
    let start = Instant::now();
    let mut spawned = child::command(&command.program);
    spawned
        .args(&command.args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut group = match Group::spawn(&mut spawned) {
        Ok(g) => g,
        Err(e) => {
            return WorkerResult::Fatal(format!(
                "cannot start the worker process {}: {e}",
                command.program.display()
            ))
        }
    };
    // The request is small: written whole, then the pipe is closed.
    if let Some(mut stdin) = group.child().stdin.take() {
        let mut line = serde_json::to_string(request).unwrap_or_default();
        line.push('\n');
        // A worker that died at once is reported from its exit below.
        let _ = stdin.write_all(line.as_bytes());
    }
    let (tx, rx) = mpsc::channel::<Event>();
    let stdout = group.child().stdout.take();
    let reader = std::thread::spawn(move || {
        let Some(stdout) = stdout else { return };
        child::read_lines(stdout, MAX_LINE_BYTES, |line| {
            let event = match line {
                Line::Text(text) => match serde_json::from_str::<Message>(&text) {
                    Ok(m) => Event::Message(Box::new(m)),
                    Err(_) => Event::Garbled(excerpt(text.trim(), 200)),
                },
                bad @ Line::NotUtf8 { .. } => Event::Garbled(bad.problem().unwrap_or_default()),
                long @ Line::TooLong { .. } => Event::Overlong(long.problem().unwrap_or_default()),
            };
            tx.send(event).is_ok()
        });
    });
    let stderr_tail = child::read_tail(group.child().stderr.take());

    let mut output = CellOutput::default();
    let mut hello = None;
    let mut end: Option<CellEnd> = None;
    let mut stopped: Option<String> = None;
    let mut garbled: Option<String> = None;
    let mut fatal: Option<String> = None;
    let mut exited_at: Option<Instant> = None;
    let deadline = start + watch.limit;
    // Until the cell's end arrives: after it, nothing the cell did can be
    // lost, and neither the time limit nor Ctrl-C may rewrite how it ended.
    while end.is_none() {
        if watch.interrupt.is_some_and(|i| i.load(Ordering::SeqCst)) {
            stopped = Some(INTERRUPTED.into());
            break;
        }
        let now = Instant::now();
        if now >= deadline {
            stopped = Some(format!(
                "stopped at the time limit of {} (set `timeout` in the cell, or `--timeout \
                 SECONDS`)",
                seconds_text(watch.limit)
            ));
            break;
        }
        match rx.recv_timeout(TICK.min(deadline - now)) {
            Ok(Event::Message(m)) => match *m {
                Message::Hello {
                    protocol,
                    device,
                    meter,
                } => {
                    if protocol != PROTOCOL_VERSION {
                        fatal = Some(format!(
                            "the worker {} speaks protocol version {protocol}; this runner \
                             speaks version {PROTOCOL_VERSION}",
                            command.program.display()
                        ));
                        break;
                    }
                    hello = Some(Hello { device, meter });
                }
                Message::Printed { line } => output.printed.push(line),
                Message::Metric { name, value } => {
                    output.metrics.insert(name, value);
                }
                Message::Region(r) => output.regions.push(r),
                Message::Table(t) => output.tables.push(t),
                Message::Figure(f) => output.figures.push(f),
                Message::Progress { message } => (watch.progress)(&message),
                Message::End(e) => end = Some(e),
                Message::Described { .. } | Message::Checked { .. } => {
                    garbled.get_or_insert("an answer to another request than a run".into());
                }
                // Before the hello the worker cannot run cells at all; after
                // it, whatever failed is this cell's alone.
                Message::Fatal { message } if hello.is_none() => {
                    fatal = Some(message);
                    break;
                }
                Message::Fatal { message } => {
                    stopped = Some(message);
                    break;
                }
            },
            Ok(Event::Garbled(line)) => {
                garbled.get_or_insert(line);
            }
            Ok(Event::Overlong(why)) => {
                stopped = Some(format!(
                    "the cell's worker process broke the protocol: {why} (what it sent \
                     before that line is kept)"
                ));
                break;
            }
            Err(RecvTimeoutError::Timeout) => {
                // A worker that died while a process it started still holds
                // its output open: what it wrote is read within the grace.
                match exited_at {
                    None if group.exited() => exited_at = Some(Instant::now()),
                    Some(t) if t.elapsed() >= READER_GRACE => break,
                    _ => {}
                }
            }
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    if stopped.is_none()
        && end.is_none()
        && watch.interrupt.is_some_and(|i| i.load(Ordering::SeqCst))
    {
        // The flag may be set after the loop's last look, while it ended
        // for another reason (the worker's output closed): the run was
        // stopped all the same.
        stopped = Some(INTERRUPTED.into());
    }
    // A stopped worker is ended with everything it started; one that ended
    // its cell gets time to exit, and whatever it leaves in its group (a
    // process still holding its pipes) is killed then.
    let status = if stopped.is_some() || fatal.is_some() {
        group.end(STOP_GRACE)
    } else {
        group.wait(EXIT_GRACE)
    };
    let _ = child::join_within(reader, READER_GRACE);
    let tail = stderr_tail.recv_timeout(READER_GRACE).unwrap_or_default();
    if let Some(message) = fatal {
        return WorkerResult::Fatal(message);
    }
    let seconds = start.elapsed().as_secs_f64();
    let error = match (stopped, &end) {
        (Some(why), _) => Some(why),
        (None, Some(_)) => None,
        (None, None) => Some(died(
            status.ok(),
            &tail,
            garbled.as_deref(),
            // On a GPU the cap is the card's: a heap that ran out ran into
            // the machine's memory instead.
            watch.max_memory.filter(|_| {
                hello
                    .as_ref()
                    .is_none_or(|h| crate::assertion::OnDevice::Cpu.covers(&h.device))
            }),
        )),
    };
    let end = match end {
        Some(mut e) => {
            if error.is_some() {
                e.error = error;
            }
            e
        }
        None => CellEnd {
            error,
            ..CellEnd::failed(String::new(), seconds)
        },
    };
    WorkerResult::Ran(Box::new(CellOutcome { output, end }), hello)
}

/// How long a worker that has ended its cell may take to exit (freeing a
/// large heap, tearing down a CUDA context) before it is killed.
const EXIT_GRACE: Duration = Duration::from_secs(30);

fn seconds_text(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{s:.0} s")
    } else {
        format!("{s} s")
    }
}

/// Why a worker ended without ending its cell.
fn died(
    status: Option<ExitStatus>,
    stderr: &[u8],
    garbled: Option<&str>,
    max_memory: Option<u64>,
) -> String {
    use std::os::unix::process::ExitStatusExt;
    let how = match status {
        Some(s) if s.signal().is_some() => {
            let sig = s.signal().unwrap_or_default();
            match sig {
                libc::SIGKILL => "was killed by SIGKILL (the kernel's out-of-memory killer does \
                                  this when memory runs out)"
                    .to_string(),
                libc::SIGABRT => "aborted (SIGABRT)".to_string(),
                libc::SIGSEGV => "crashed (SIGSEGV)".to_string(),
                libc::SIGINT => "was interrupted (SIGINT)".to_string(),
                libc::SIGTERM => "was terminated (SIGTERM)".to_string(),
                other => format!("was killed by signal {other}"),
            }
        }
        Some(s) => match s.code() {
            Some(code) => format!("exited with status {code}"),
            None => "ended".to_string(),
        },
        None => "could not be waited for".to_string(),
    };
    let said = String::from_utf8_lossy(stderr);
    // What the process said of its end: the allocator's or a panic's line
    // where there is one, else its last line that is not a backtrace's.
    let telling = workbook_sdk::worker::DYING_WORDS;
    let lines: Vec<&str> = said.lines().collect();
    // A panic's line ends in its location, and its message is the next line.
    let with_next = |i: usize| match (lines[i].trim_end().ends_with(':'), lines.get(i + 1)) {
        (true, Some(next)) => format!("{} {}", lines[i].trim(), next.trim()),
        _ => lines[i].to_string(),
    };
    let last = (0..lines.len())
        .rev()
        .find(|&i| telling.iter().any(|t| lines[i].contains(t)))
        .map(with_next)
        .or_else(|| {
            lines
                .iter()
                .rev()
                .find(|l| {
                    let t = l.trim_start();
                    !t.is_empty()
                        && !t.starts_with("note:")
                        && !t.starts_with("stack backtrace")
                        && !t.starts_with(|c: char| c.is_ascii_digit())
                        && !t.starts_with("at ")
                })
                .map(|l| l.to_string())
        })
        .map(|l| excerpt(l.trim(), 300));
    let mut message = String::new();
    let out_of_memory = said.contains("memory allocation of");
    if out_of_memory {
        message.push_str("out of memory: ");
    }
    message.push_str(&format!(
        "the cell's worker process {how} before the cell ended"
    ));
    if let Some(last) = last {
        message.push_str(&format!("; it said: {last}"));
    }
    if let (true, Some(limit)) = (out_of_memory, max_memory) {
        message.push_str(&format!(
            "; a cell may hold at most {} at once here (`--max-memory`)",
            bytesize::ByteSize::b(limit).display().iec()
        ));
    }
    if let Some(g) = garbled {
        message.push_str(&format!(
            "; it wrote a line that is not the protocol's: {g}"
        ));
    }
    message
}

/// Sets `flag` when the process is asked to stop (Ctrl-C, SIGTERM), once
/// per process; later calls share the first flag.
pub fn interrupt_flag() -> Arc<AtomicBool> {
    static FLAG: std::sync::OnceLock<Arc<AtomicBool>> = std::sync::OnceLock::new();
    FLAG.get_or_init(|| {
        let flag = Arc::new(AtomicBool::new(false));
        let set = flag.clone();
        // Without a handler, Ctrl-C still ends the run, only without its
        // report: not a reason to refuse to run.
        let _ = ctrlc::set_handler(move || set.store(true, Ordering::SeqCst));
        flag
    })
    .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panics_message_is_quoted_with_its_location() {
        let stderr = b"\nthread 'workbook cell' panicked at plugins/x/src/lib.rs:10:5:\n\
                       the plugin gave up\nnote: run with `RUST_BACKTRACE=1`\n";
        let said = died(None, stderr, None, None);
        assert_eq!(
            said,
            "the cell's worker process could not be waited for before the cell ended; it \
             said: thread 'workbook cell' panicked at plugins/x/src/lib.rs:10:5: the plugin \
             gave up"
        );
    }

    #[test]
    fn an_allocation_failure_names_the_cap() {
        let said = died(
            None,
            b"memory allocation of 4096 bytes failed\n",
            None,
            Some(1 << 30),
        );
        assert_eq!(
            said,
            "out of memory: the cell's worker process could not be waited for before the \
             cell ended; it said: memory allocation of 4096 bytes failed; a cell may hold at \
             most 1.0 GiB at once here (`--max-memory`)"
        );
    }
}
