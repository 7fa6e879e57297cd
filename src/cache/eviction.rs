//! The block store's slots: a block put in a free slot or one the CLOCK
//! hand frees, removed, and every block of a generation dropped. Apart
//! from `BlockMap`'s export bookkeeping (the parent module), which calls
//! these.

use bytes::Bytes;

use super::{BlockMap, Events, Generation, Live, Slot};

impl BlockMap {
    pub(super) fn put(
        &mut self,
        key: (Generation, u64),
        data: Bytes,
        prefetched: bool,
        events: &mut Events,
    ) {
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None if self.slots.len() < self.max_blocks => {
                self.slots.push(None);
                self.slots.len() - 1
            }
            None => self.evict_one(events),
        };
        let len = data.len() as u64;
        self.bytes += len;
        events.bytes_delta += len as i64;
        events.inserted += 1;
        events.inserted_bytes += len;
        self.index.insert(key, slot);
        if let Some(state) = self.export_of(key.0) {
            state.blocks += 1;
        }
        self.slots[slot] = Some(Slot {
            key,
            data,
            uses: 0,
            prefetched,
        });
    }

    pub(super) fn export_of(&mut self, generation: Generation) -> Option<&mut Live> {
        self.live.get_mut(&generation)
    }

    /// Sweeps the clock hand to a block used no more since the hand last
    /// passed, and frees its slot. Ends within `MAX_USES + 1` turns: each
    /// pass lowers every count it does not take.
    fn evict_one(&mut self, events: &mut Events) -> usize {
        loop {
            let at = self.hand;
            self.hand = (self.hand + 1) % self.slots.len();
            match self.slots[at].as_mut() {
                Some(slot) if slot.uses > 0 => slot.uses -= 1,
                Some(_) => {
                    self.remove(at, events);
                    events.evicted += 1;
                    // `remove` put it on the free list for others.
                    self.free.pop();
                    return at;
                }
                None => return at,
            }
        }
    }

    pub(super) fn remove(&mut self, at: usize, events: &mut Events) {
        let Some(slot) = self.slots[at].take() else {
            return;
        };
        self.index.remove(&slot.key);
        let len = slot.data.len() as u64;
        self.bytes -= len;
        events.bytes_delta -= len as i64;
        if slot.prefetched {
            events.read_ahead_wasted += len;
        }
        if let Some(state) = self.export_of(slot.key.0) {
            state.blocks = state.blocks.saturating_sub(1);
        }
        self.free.push(at);
    }

    pub(super) fn drop_generation(&mut self, generation: Generation) -> Events {
        let mut events = Events::default();
        self.pending.retain(|(g, _)| *g != generation);
        for at in 0..self.slots.len() {
            if self.slots[at]
                .as_ref()
                .is_some_and(|slot| slot.key.0 == generation)
            {
                self.remove(at, &mut events);
                events.dropped += 1;
            }
        }
        events
    }
}
