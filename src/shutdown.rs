//! The gateway's shutdown, as every connection sees it: running, then
//! draining (SIGTERM: finish what is in flight, refuse what is new), then
//! cut (the grace period is over).

use tokio::sync::watch;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    Running,
    Draining,
    Cut,
}

/// Owned by the accept loop, which moves the phase forward.
pub struct ShutdownControl(watch::Sender<Phase>);

/// Each connection's view of the phase.
#[derive(Clone)]
pub struct Shutdown(watch::Receiver<Phase>);

impl ShutdownControl {
    pub fn new() -> (Self, Shutdown) {
        let (tx, rx) = watch::channel(Phase::Running);
        (ShutdownControl(tx), Shutdown(rx))
    }

    pub fn enter(&self, phase: Phase) {
        self.0.send_if_modified(|now| {
            let later = phase > *now;
            if later {
                *now = phase;
            }
            later
        });
    }
}

impl Shutdown {
    pub fn is_draining(&self) -> bool {
        *self.0.borrow() >= Phase::Draining
    }

    /// Resolves once draining has begun.
    pub async fn draining(&mut self) {
        self.reached(Phase::Draining).await
    }

    /// Resolves once the grace period is over.
    pub async fn cut(&mut self) {
        self.reached(Phase::Cut).await
    }

    async fn reached(&mut self, phase: Phase) {
        // The control is dropped only when the accept loop is gone, and
        // with it every reason to go on.
        let _ = self.0.wait_for(|now| *now >= phase).await;
    }
}
