//! Ctrl-C and SIGTERM while the lab runs: the first one asks the lab to stop at the next
//! check and tear down; a second one, while teardown is under way, exits at once (and says
//! how to remove what is left).

use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};

use anyhow::Context;
use nix::sys::signal::Signal;

/// Set by a signal; checked by the lab between steps and inside every wait.
#[derive(Debug, Clone)]
pub struct Interrupt {
    signal: Arc<AtomicI32>,
}

/// The lab stopped because of a signal.
#[derive(Debug, thiserror::Error)]
#[error("interrupted by {name}")]
pub struct Interrupted {
    /// The signal's name (`SIGINT`, `SIGTERM`).
    pub name: &'static str,
    /// The signal's number: the exit code is 128 plus it, as a shell reports.
    pub number: i32,
}

impl Interrupt {
    /// Installs handlers for SIGINT and SIGTERM on a thread of their own. `second` is called
    /// (on that thread) if another signal arrives after the first; it should exit the process.
    pub fn install(second: impl Fn(&'static str) + Send + 'static) -> anyhow::Result<Self> {
        let signal = Arc::new(AtomicI32::new(0));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let flag = signal.clone();
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                use tokio::signal::unix::{SignalKind, signal};
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(err) => {
                        let _ = ready_tx.send(Err(err));
                        return;
                    }
                };
                runtime.block_on(async move {
                    let (mut int, mut term) = match (
                        signal(SignalKind::interrupt()),
                        signal(SignalKind::terminate()),
                    ) {
                        (Ok(int), Ok(term)) => (int, term),
                        (Err(err), _) | (_, Err(err)) => {
                            let _ = ready_tx.send(Err(err));
                            return;
                        }
                    };
                    let _ = ready_tx.send(Ok(()));
                    loop {
                        let number = tokio::select! {
                            _ = int.recv() => Signal::SIGINT as i32,
                            _ = term.recv() => Signal::SIGTERM as i32,
                        };
                        if flag.swap(number, Ordering::SeqCst) != 0 {
                            second(name_of(number));
                        }
                    }
                });
            })
            .context("start the signal thread")?;
        ready_rx
            .recv()
            .context("signal thread ended")?
            .context("install SIGINT/SIGTERM handlers")?;
        Ok(Self { signal })
    }

    /// `Err` once a signal has arrived.
    pub fn check(&self) -> Result<(), Interrupted> {
        match self.signal.load(Ordering::SeqCst) {
            0 => Ok(()),
            number => Err(Interrupted {
                name: name_of(number),
                number,
            }),
        }
    }

    /// Sleeps up to `d`, waking early (with `Err`) when a signal arrives.
    pub fn sleep(&self, d: std::time::Duration) -> Result<(), Interrupted> {
        let deadline = std::time::Instant::now() + d;
        loop {
            self.check()?;
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Ok(());
            }
            std::thread::sleep(left.min(std::time::Duration::from_millis(50)));
        }
    }
}

fn name_of(number: i32) -> &'static str {
    if number == Signal::SIGINT as i32 {
        "SIGINT"
    } else {
        "SIGTERM"
    }
}
