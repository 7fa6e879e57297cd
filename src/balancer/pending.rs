//! The connections from trusted balancers still waiting for their PROXY
//! header: bounded in all, and shared fairly between the balancers' TCP
//! addresses. A trusted prefix can be broad (a Kubernetes node CIDR), and
//! any host inside it could otherwise hold every place by sending half a
//! header, so the real balancer's clients would find none. A lone
//! balancer may take the whole bound (a burst of real clients); once it
//! is full, a newcomer from an address holding fewer than the busiest
//! one sheds that one's oldest connection, as admission sheds per source.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::oneshot;

/// The bound, and who holds it.
pub struct Pending {
    bound: usize,
    inner: Mutex<Inner>,
    refusals: crate::logsafe::RefusalLog,
}

#[derive(Default)]
struct Inner {
    /// Per balancer address, oldest first: each place's id and the
    /// sender whose drop sheds it.
    held: HashMap<IpAddr, VecDeque<(u64, oneshot::Sender<()>)>>,
    total: usize,
    next_id: u64,
}

/// A place before the header; given back on drop.
pub struct PendingPlace {
    pending: Arc<Pending>,
    balancer: IpAddr,
    id: u64,
    shed: oneshot::Receiver<()>,
}

impl Pending {
    pub fn new(bound: usize) -> Arc<Self> {
        Arc::new(Pending {
            bound,
            inner: Mutex::new(Inner::default()),
            refusals: Default::default(),
        })
    }

    /// A connection closed for the bound (`shed`: after it had a place),
    /// counted `busy`; said at warn at most once per interval, since a
    /// full bound is what locks a balancer's clients out.
    pub fn refused(&self, metrics: &crate::metrics::Metrics, balancer: IpAddr, shed: bool) {
        metrics.proxy_header("busy");
        metrics.connection("refused");
        let what = match shed {
            true => "shed to make room for a less busy balancer address",
            false => "refused: this address already holds as many as any other",
        };
        tracing::debug!(%balancer, "connection before its PROXY header {what}");
        if let Some(count) = self.refusals.due() {
            tracing::warn!(
                refused = count,
                last_balancer = %balancer,
                bound = self.bound,
                "connections from --proxy-protocol-from balancers closed before their PROXY header: the bound (--max-handshakes plus --handshake-queue) is full; each balancer address gets an equal share (at most one such line every {}s)",
                crate::logsafe::REFUSAL_LOG_EVERY.as_secs()
            );
        }
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A place for a connection from `balancer`, or `None` when the bound
    /// is full and no other address holds more than this one.
    pub fn take(self: &Arc<Self>, balancer: IpAddr) -> Option<PendingPlace> {
        let mut inner = self.inner();
        if inner.total >= self.bound {
            let mine = inner.held.get(&balancer).map_or(0, VecDeque::len);
            let busiest = inner
                .held
                .iter()
                .max_by_key(|(_, places)| places.len())
                .map(|(addr, places)| (*addr, places.len()))?;
            if busiest.1 <= mine + 1 {
                return None;
            }
            // Dropping its sender wakes the shed connection, which closes.
            let places = inner.held.get_mut(&busiest.0)?;
            places.pop_front();
            if places.is_empty() {
                inner.held.remove(&busiest.0);
            }
            inner.total -= 1;
        }
        let (tx, shed) = oneshot::channel();
        inner.next_id += 1;
        let id = inner.next_id;
        inner.held.entry(balancer).or_default().push_back((id, tx));
        inner.total += 1;
        Some(PendingPlace {
            pending: self.clone(),
            balancer,
            id,
            shed,
        })
    }
}

impl PendingPlace {
    /// Resolves once a newcomer from a less busy balancer took this place.
    pub async fn shed(&mut self) {
        let _ = (&mut self.shed).await;
    }
}

impl Drop for PendingPlace {
    fn drop(&mut self) {
        let mut inner = self.pending.inner();
        let Some(places) = inner.held.get_mut(&self.balancer) else {
            return;
        };
        let Some(at) = places.iter().position(|(id, _)| *id == self.id) else {
            return; // shed: counted off already
        };
        places.remove(at);
        if places.is_empty() {
            inner.held.remove(&self.balancer);
        }
        inner.total -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::task::{Context, Poll};

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    fn is_shed(place: &mut PendingPlace) -> bool {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let shed = std::pin::pin!(place.shed());
        shed.poll(&mut cx) == Poll::Ready(())
    }

    #[test]
    fn a_lone_balancer_takes_the_whole_bound_and_no_more() {
        let pending = Pending::new(3);
        let held: Vec<_> = (0..3).map(|_| pending.take(ip(9)).unwrap()).collect();
        assert!(pending.take(ip(9)).is_none());
        drop(held);
        assert_eq!(pending.inner().total, 0);
        assert!(pending.inner().held.is_empty());
    }

    /// The review's case: six slow connections from .8 fill the bound;
    /// the balancer at .9 still gets places, each shedding one of .8's
    /// oldest, until the two hold equal shares.
    #[test]
    fn a_second_address_sheds_the_busiest_down_to_an_equal_share() {
        let pending = Pending::new(6);
        let mut hog: Vec<_> = (0..6).map(|_| pending.take(ip(8)).unwrap()).collect();
        let mut fair = Vec::new();
        for _ in 0..3 {
            fair.push(pending.take(ip(9)).expect("a place for the balancer"));
        }
        assert!(pending.take(ip(9)).is_none(), "shares are equal now");
        assert!(pending.take(ip(8)).is_none());
        let shed: Vec<bool> = hog.iter_mut().map(is_shed).collect();
        assert_eq!(shed, [true, true, true, false, false, false]);
        drop(hog);
        assert_eq!(pending.inner().total, 3);
        drop(fair);
        assert_eq!(pending.inner().total, 0);
    }
}
