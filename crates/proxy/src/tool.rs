//! Running the kernel's command-line tools (`nft`, `iptables-restore`, `iptables-save`, ...):
//! one child process, optional input on stdin, stdout back. Both backends' kernel errors carry
//! a [`ToolError`] as their `Tool` variant.

use std::io::Write as _;
use std::process::{Command, Stdio};

/// A tool that could not be run or that failed.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    /// The program could not be started or waited for.
    #[error("could not run `{program}`")]
    Spawn {
        /// The command line.
        program: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The program exited with a failure status.
    #[error("`{program}` failed ({status}): {stderr}")]
    Rejected {
        /// The command line.
        program: String,
        /// Exit status.
        status: std::process::ExitStatus,
        /// The first lines of what it printed on stderr, joined with ` | `.
        stderr: String,
    },
}

/// Runs `cmd` (described as `program` in errors), feeding `input` on stdin; returns stdout.
pub fn run(mut cmd: Command, program: &str, input: Option<&str>) -> Result<String, ToolError> {
    let spawn_error = |source| ToolError::Spawn {
        program: program.to_string(),
        source,
    };
    let mut child = cmd
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(spawn_error)?;
    if let Some(input) = input {
        let mut stdin = child.stdin.take().expect("piped stdin");
        // A write error means the tool exited early; its status and stderr say why.
        let _ = stdin.write_all(input.as_bytes());
    }
    let out = child.wait_with_output().map_err(spawn_error)?;
    if !out.status.success() {
        // Keep the message short: nft echoes the failing line and a caret line.
        let stderr = String::from_utf8_lossy(&out.stderr);
        return Err(ToolError::Rejected {
            program: program.to_string(),
            status: out.status,
            stderr: stderr.lines().take(6).collect::<Vec<_>>().join(" | "),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
