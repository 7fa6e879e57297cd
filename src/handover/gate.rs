//! Whether the accept loops accept: the hand-over pauses them while a
//! successor takes the listeners, and either opens them again (the
//! successor failed) or ends them (it serves).

use tokio::sync::watch;

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
pub struct Gate(Option<watch::Receiver<Accepting>>);

/// The hand-over's end, which moves the state (shared by the channel's
/// predecessor and the file-descriptor store's give).
#[derive(Clone)]
pub struct GateControl(std::sync::Arc<watch::Sender<Accepting>>);

impl Gate {
    /// A gate that never closes: no hand-over socket.
    pub fn always() -> Self {
        Gate(None)
    }

    pub fn controlled() -> (GateControl, Gate) {
        let (tx, rx) = watch::channel(Accepting::Yes);
        (GateControl(std::sync::Arc::new(tx)), Gate(Some(rx)))
    }

    pub fn now(&self) -> Accepting {
        self.0.as_ref().map_or(Accepting::Yes, |rx| *rx.borrow())
    }

    pub fn accepting(&self) -> bool {
        self.now() == Accepting::Yes
    }

    /// Resolves at the next change, with the new state; never, for a
    /// gate without control.
    pub async fn changed(&mut self) -> Accepting {
        if let Some(rx) = &mut self.0 {
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
}
