//! Whether the accept loops accept: the hand-over pauses them while a
//! successor takes the listeners, and either opens them again (the
//! successor failed) or ends them (it serves).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use tokio::sync::watch;

/// Who may unlink the listening sockets' paths (client mode's `--listen`
/// socket file): this process until it tells a successor Go; from then
/// on the successor accepts on them, so no exit path of this process may
/// remove the path it serves (review C1).
const PATH_OURS: u8 = 0;
const PATH_GIVEN: u8 = 1;
const PATH_RELEASED: u8 = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accepting {
    Yes,
    /// The listeners are with a successor that has not said it serves;
    /// connections wait in the kernel's backlog, which both hold.
    Paused,
    /// The successor serves: stop for good (the server drains).
    HandedOver,
}

/// Each accept loop's view.
#[derive(Clone)]
pub struct Gate(Option<(watch::Receiver<Accepting>, Arc<AtomicU8>)>);

/// The hand-over's end, which moves the state (shared by the channel's
/// predecessor and the file-descriptor store's give).
#[derive(Clone)]
pub struct GateControl(Arc<watch::Sender<Accepting>>, Arc<AtomicU8>);

impl Gate {
    /// A gate that never closes: no hand-over socket.
    pub fn always() -> Self {
        Gate(None)
    }

    pub fn controlled() -> (GateControl, Gate) {
        let (tx, rx) = watch::channel(Accepting::Yes);
        let path = Arc::new(AtomicU8::new(PATH_OURS));
        (
            GateControl(Arc::new(tx), path.clone()),
            Gate(Some((rx, path))),
        )
    }

    pub fn now(&self) -> Accepting {
        self.0
            .as_ref()
            .map_or(Accepting::Yes, |(rx, _)| *rx.borrow())
    }

    /// True if this process still owns the listeners' paths and may
    /// remove them as it closes; from then on no successor is told Go.
    /// False once a successor was told Go: the paths are its.
    pub fn release_paths(&self) -> bool {
        let Some((_, path)) = &self.0 else {
            return true;
        };
        match path.compare_exchange(PATH_OURS, PATH_RELEASED, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(_) => true,
            Err(now) => now == PATH_RELEASED,
        }
    }

    pub fn accepting(&self) -> bool {
        self.now() == Accepting::Yes
    }

    /// Resolves at the next change, with the new state; never, for a
    /// gate without control.
    pub async fn changed(&mut self) -> Accepting {
        if let Some((rx, _)) = &mut self.0 {
            if rx.changed().await.is_ok() {
                return *rx.borrow_and_update();
            }
        }
        std::future::pending().await
    }
}

impl GateControl {
    pub fn set(&self, state: Accepting) {
        self.0.send_replace(state);
    }

    /// Before Go: the listeners' paths become the successor's. False if
    /// this process already released them (it is closing and removes
    /// them): then no Go may be sent.
    pub fn give_paths(&self) -> bool {
        let was =
            self.1
                .compare_exchange(PATH_OURS, PATH_GIVEN, Ordering::SeqCst, Ordering::SeqCst);
        matches!(was, Ok(_) | Err(PATH_GIVEN))
    }

    /// The successor gave up after Go and the listeners are taken back:
    /// their paths are this process's again.
    pub fn take_paths_back(&self) {
        let _ = self
            .1
            .compare_exchange(PATH_GIVEN, PATH_OURS, Ordering::SeqCst, Ordering::SeqCst);
    }
}
