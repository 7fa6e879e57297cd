//! What the request side tells the reply side, the only writer to the
//! client.

pub enum Local {
    /// A reply nbdgw made itself (a refused request).
    Reply { cookie: u64, bytes: Vec<u8> },
    /// A read answered from the read cache: its header, then the cached
    /// blocks' bytes, shared with the cache rather than copied.
    Data {
        cookie: u64,
        header: Vec<u8>,
        data: Vec<bytes::Bytes>,
    },
    /// Finish what is in flight, then close with this reason: the client
    /// sent NBD_CMD_DISC, or nbdgw is shutting down.
    Drain(&'static str),
}

pub const CLIENT_DISCONNECTED: &str = "client sent NBD_CMD_DISC";
pub const SHUTTING_DOWN: &str = "nbdgw shutting down: nothing left in flight";
