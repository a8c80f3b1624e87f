//! The processes the runner starts (a cell's worker, an external plugin
//! asked to describe itself): each leads a process group of its own and
//! dies with the thread that started it, even when the runner is killed
//! with SIGKILL; its output is read in lines of bounded length; and it is
//! ended as a whole group, so that nothing it started outlives it.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, ExitStatus};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::excerpt::excerpt;

/// A command for `program` whose process leads a new process group and
/// receives SIGKILL when the thread that spawns it ends (Linux's parent
/// death signal): spawn it from a thread that outlives the process.
pub fn command(program: &Path) -> Command {
    use std::os::unix::process::CommandExt;
    let mut command = Command::new(program);
    command.process_group(0);
    let parent = std::process::id();
    // SAFETY: the closure runs between fork and exec, and calls only
    // prctl(2) and getppid(2), which are async-signal-safe.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The runner may have died between the fork and the prctl.
            if libc::getppid() as u32 != parent {
                return Err(std::io::Error::other("the runner ended while starting it"));
            }
            Ok(())
        });
    }
    command
}

/// A process started by [`command`], with the process group it leads.
#[derive(Debug)]
pub struct Group {
    child: Child,
    reaped: Option<ExitStatus>,
}

impl Group {
    /// Starts `command` (made by [`command`]).
    pub fn spawn(command: &mut Command) -> std::io::Result<Self> {
        Ok(Self {
            child: command.spawn()?,
            reaped: None,
        })
    }

    /// The process, for its pipes.
    pub fn child(&mut self) -> &mut Child {
        &mut self.child
    }

    /// Whether the leader has exited, without reaping it: while it is not
    /// reaped, its pid (the group's id) cannot be reused, so signalling
    /// the group reaches no stranger.
    pub fn exited(&self) -> bool {
        if self.reaped.is_some() {
            return true;
        }
        // SAFETY: waitid(2) on our own child, into a zeroed siginfo_t.
        unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            let r = libc::waitid(
                libc::P_PID,
                self.child.id() as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            );
            r != 0 || info.si_pid() != 0
        }
    }

    fn signal(&self, signal: libc::c_int) {
        if self.reaped.is_none() {
            // SAFETY: the group's leader is our unreaped child (see `exited`).
            unsafe { libc::killpg(self.child.id() as libc::pid_t, signal) };
        }
    }

    /// Ends the whole group: SIGTERM (which lets `mpirun` end its ranks),
    /// then after `grace`, or at once when the leader is gone, SIGKILL to
    /// whatever is left; then reaps the leader.
    pub fn end(&mut self, grace: Duration) -> std::io::Result<ExitStatus> {
        self.signal(libc::SIGTERM);
        self.wait(grace)
    }

    /// Waits up to `limit` for the leader to exit by itself, then kills
    /// whatever is left of its group (a process it started that still
    /// holds its pipes, or the leader itself past the limit) and reaps it.
    pub fn wait(&mut self, limit: Duration) -> std::io::Result<ExitStatus> {
        // A worker exits within a millisecond or two of its cell's end: a
        // coarser poll would add its period to every cell.
        let until = Instant::now() + limit;
        while !self.exited() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.signal(libc::SIGKILL);
        self.reap()
    }

    fn reap(&mut self) -> std::io::Result<ExitStatus> {
        if let Some(status) = self.reaped {
            return Ok(status);
        }
        let status = self.child.wait()?;
        self.reaped = Some(status);
        Ok(status)
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        if self.reaped.is_none() {
            self.signal(libc::SIGKILL);
            let _ = self.reap();
        }
    }
}

/// One line a process wrote, as [`read_lines`] reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Line {
    /// A line of text, without its newline.
    Text(String),
    /// A line that is not UTF-8: its number (from 1), the offset of its
    /// first invalid byte, and an excerpt with that byte replaced.
    NotUtf8 {
        /// The line's number, from 1.
        number: usize,
        /// The byte offset of the first invalid byte within the line.
        offset: usize,
        /// The line, invalid bytes replaced, cut to a readable length.
        excerpt: String,
    },
    /// A line that ran past the cap without ending: reading stops there.
    TooLong {
        /// The line's number, from 1.
        number: usize,
        /// The cap it ran past, in bytes.
        cap: usize,
    },
}

impl Line {
    /// What is wrong with the line, for a message; `None` for text.
    pub fn problem(&self) -> Option<String> {
        match self {
            Line::Text(_) => None,
            Line::NotUtf8 {
                number,
                offset,
                excerpt,
            } => Some(format!(
                "its line {number} is not UTF-8 (an invalid byte at offset {offset}): {excerpt}"
            )),
            Line::TooLong { number, cap } => Some(format!(
                "its line {number} ran past the protocol's cap of {} without ending",
                bytesize::ByteSize::b(*cap as u64).display().iec()
            )),
        }
    }
}

/// Reads `stream` line by line, each line at most `cap` bytes, handing
/// each to `each` until it answers `false`, the stream ends, or a line
/// runs past `cap` (handed over as [`Line::TooLong`], the last).
pub fn read_lines(stream: impl Read, cap: usize, mut each: impl FnMut(Line) -> bool) {
    let mut reader = BufReader::new(stream);
    let mut buf = Vec::new();
    let mut number = 0;
    loop {
        buf.clear();
        let limit = cap as u64 + 1;
        match (&mut reader).take(limit).read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        number += 1;
        if buf.last() == Some(&b'\n') {
            buf.pop();
        } else if buf.len() > cap {
            each(Line::TooLong { number, cap });
            return;
        }
        let line = match String::from_utf8(std::mem::take(&mut buf)) {
            Ok(text) => Line::Text(text),
            Err(e) => Line::NotUtf8 {
                number,
                offset: e.utf8_error().valid_up_to(),
                excerpt: excerpt(String::from_utf8_lossy(e.as_bytes()).trim(), 200),
            },
        };
        if !each(line) {
            return;
        }
    }
}

/// The last bytes of a process's standard error kept for its message.
pub const STDERR_TAIL: usize = 4096;

/// Reads `stream` to its end on a thread of its own (so that the process
/// never stalls on a full pipe) and sends its last [`STDERR_TAIL`] bytes or
/// so once it closes.
pub fn read_tail(stream: Option<impl Read + Send + 'static>) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut tail = Vec::new();
        if let Some(mut stream) = stream {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stream.read(&mut buf) {
                if n == 0 {
                    break;
                }
                tail.extend_from_slice(&buf[..n]);
                if tail.len() > 2 * STDERR_TAIL {
                    tail.drain(..tail.len() - STDERR_TAIL);
                }
            }
        }
        let _ = tx.send(tail);
    });
    rx
}

/// Joins `handle` if its thread ends within `limit`; otherwise leaves it
/// running (a reader blocked on a pipe that some stray process holds) and
/// answers `None`, so that the runner never waits on it unbounded.
pub fn join_within<T>(handle: JoinHandle<T>, limit: Duration) -> Option<T> {
    let until = Instant::now() + limit;
    while !handle.is_finished() {
        if Instant::now() >= until {
            return None;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    handle.join().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(input: &[u8], cap: usize) -> Vec<Line> {
        let mut out = Vec::new();
        read_lines(input, cap, |l| {
            out.push(l);
            true
        });
        out
    }

    #[test]
    fn lines_are_cut_at_the_cap_and_bad_utf8_is_named_with_its_offset() {
        assert_eq!(
            lines(b"ab\ncd", 4),
            [Line::Text("ab".into()), Line::Text("cd".into())]
        );
        // Exactly the cap is a line; one byte more is not.
        assert_eq!(lines(b"abcd\n", 4), [Line::Text("abcd".into())]);
        assert_eq!(
            lines(b"ok\nabcde\nnever", 4),
            [Line::Text("ok".into()), Line::TooLong { number: 2, cap: 4 }]
        );
        let bad = lines(b"x\nab\xffcd\ny\n", 64);
        assert_eq!(
            bad,
            [
                Line::Text("x".into()),
                Line::NotUtf8 {
                    number: 2,
                    offset: 2,
                    excerpt: "ab\u{fffd}cd".into()
                },
                Line::Text("y".into()),
            ]
        );
        assert_eq!(
            bad[1].problem().unwrap(),
            "its line 2 is not UTF-8 (an invalid byte at offset 2): ab\u{fffd}cd"
        );
        assert_eq!(
            Line::TooLong {
                number: 7,
                cap: 64 << 20
            }
            .problem()
            .unwrap(),
            "its line 7 ran past the protocol's cap of 64.0 MiB without ending"
        );
    }

    #[test]
    fn a_group_is_ended_with_what_it_started() {
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("grandchild");
        let mut command = command(Path::new("/bin/sh"));
        command.args([
            "-c",
            &format!("sleep 600 & echo $! > {}; wait", pidfile.display()),
        ]);
        let mut group = Group::spawn(&mut command).unwrap();
        let until = Instant::now() + Duration::from_secs(10);
        let grandchild: i32 = loop {
            if let Some(pid) = std::fs::read_to_string(&pidfile)
                .ok()
                .and_then(|t| t.trim().parse().ok())
            {
                break pid;
            }
            assert!(Instant::now() < until, "the shell never started its child");
            std::thread::sleep(Duration::from_millis(5));
        };
        group.end(Duration::from_secs(2)).unwrap();
        // The grandchild was SIGTERMed with its group; it is not ours to
        // reap, so wait for it to vanish (or become a zombie of init's).
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let state = std::fs::read_to_string(format!("/proc/{grandchild}/stat"));
            match state {
                Err(_) => break,
                Ok(s) if s.split_whitespace().nth(2) == Some("Z") => break,
                Ok(_) => {}
            }
            assert!(Instant::now() < until, "the grandchild outlived its group");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}
