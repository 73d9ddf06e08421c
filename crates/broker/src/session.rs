//! The broker's read-only view of one order-5 session in the region's session table
//! (written by the sequencer): its committed high-water mark and whether the epoch a
//! connection speaks for has been fenced.

use embarcadero_region::{unix_ms, Region, SessionState};
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct SessionView {
    topic: u32,
    client_id: u64,
    epoch: u64,
    /// `session_key_hash` of the key this connection's hello presented.
    key_hash: u64,
    slot: Option<u32>,
    /// The session's slot was seen holding another client's session: the sequencer
    /// ended this one (idle) and gave its slot away.
    expired: bool,
    /// When this view last raised the slot's last-active stamp.
    touched_ms: u64,
}

/// What a connection needs to know about its session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionStatus {
    /// Every batch below this is committed in the GOI.
    pub committed_hwm: u64,
    /// Every batch below this is on every disk replica (replicated topics).
    pub durable_hwm: u64,
    /// The connection's epoch was fenced or superseded by a newer one.
    pub fenced: bool,
    /// The session's current epoch in the table (0: the sequencer has not seen it).
    pub epoch: u64,
    /// The opener of `epoch` (`Hello::opener`); 0 when unknown, which matches any.
    pub opener: u32,
    /// The table marks `epoch` fenced (a gap at its head outlived the lease).
    pub epoch_fenced: bool,
    /// The session ended while this connection was open: it was idle and its slot in
    /// the session table went to another session. Its marks are gone.
    pub expired: bool,
    /// The session is bound to another key than this connection's: the connection does
    /// not own it (a hijack attempt, or a client that lost its key).
    pub foreign_key: bool,
}

impl SessionStatus {
    /// Whether `opener` may be the publisher that opened the session's current epoch:
    /// the table names it, or does not know (0), or the hello does not say (0).
    pub fn opened_by(&self, opener: u32) -> bool {
        self.opener == 0 || opener == 0 || self.opener == opener
    }

    /// Batches below this count as acknowledged at `ack_level`: committed, and for
    /// ack 2 also durable. A client resumes (after a fence or a reconnect) from here.
    pub fn acked_hwm(&self, ack_level: u8) -> u64 {
        if ack_level == 2 {
            self.durable_hwm.min(self.committed_hwm)
        } else {
            self.committed_hwm
        }
    }
}

/// How often a connected session's last-active stamp is raised. Far below any sensible
/// `session_idle_evict`, and rare enough to cost nothing.
const TOUCH_EVERY_MS: u64 = 1_000;

impl SessionView {
    pub fn new(topic: u32, client_id: u64, epoch: u64, key_hash: u64) -> Self {
        Self {
            topic,
            client_id,
            epoch,
            key_hash,
            slot: None,
            expired: false,
            touched_ms: 0,
        }
    }

    /// The session's current status; a session the sequencer has not seen yet has
    /// committed nothing.
    pub fn status(&mut self, region: &Region) -> SessionStatus {
        let unknown = |expired| SessionStatus {
            committed_hwm: 0,
            durable_hwm: 0,
            fenced: false,
            epoch: 0,
            opener: 0,
            epoch_fenced: false,
            expired,
            foreign_key: false,
        };
        if self.expired {
            return unknown(true);
        }
        let record = match self
            .slot
            .map(|slot| (slot, region.session_read(self.topic, slot)))
        {
            Some((slot, Some(r))) if r.client_id == self.client_id => Some((slot, r)),
            // A session never moves, so once its slot holds another client's, it ended
            // (even if its client id has a newer session elsewhere).
            Some((_, Some(_))) => {
                self.expired = true;
                return unknown(true);
            }
            _ => region.session_find(self.topic, self.client_id),
        };
        let Some((slot, r)) = record else {
            return unknown(false);
        };
        self.slot = Some(slot);
        SessionStatus {
            committed_hwm: r.committed_hwm,
            durable_hwm: region
                .session_durable_hwm(self.topic, slot)
                .load(std::sync::atomic::Ordering::Acquire),
            fenced: r.session_epoch > self.epoch
                || (r.session_epoch == self.epoch && r.state == SessionState::Fenced),
            epoch: r.session_epoch,
            opener: r.opener,
            epoch_fenced: r.state == SessionState::Fenced,
            expired: false,
            foreign_key: r.key_hash != 0 && r.key_hash != self.key_hash,
        }
    }

    /// The client id the session belongs to.
    pub fn client_id(&self) -> u64 {
        self.client_id
    }

    /// Raises the session's last-active stamp (at most once a second): its client is
    /// connected, so the session must not be taken for idle and ended.
    pub fn touch(&mut self, region: &Region, now_ms: u64) {
        if let Some(slot) = self.slot {
            if now_ms >= self.touched_ms + TOUCH_EVERY_MS {
                region.session_touch(self.topic, slot, now_ms);
                self.touched_ms = now_ms;
            }
        }
    }

    /// True when the sequencer passed this connection's batch at `pbr_index` of `broker`'s
    /// log (the ordered frontier is beyond it) without the table holding the session: it
    /// found no slot to give it (all taken by sessions active within the idle threshold,
    /// or not yet on the replicas).
    ///
    /// The sequencer writes the table before it moves the frontier, so the table is
    /// looked up again after the frontier is read: a view whose last `status` came before
    /// the sequencer admitted the session must not take it for dropped.
    pub fn dropped_without_slot(&mut self, region: &Region, broker: u32, pbr_index: u64) -> bool {
        if self.slot.is_some() {
            return false;
        }
        let ordered = region
            .log(self.topic, broker)
            .ordered_pbr
            .load(std::sync::atomic::Ordering::Acquire);
        if ordered <= pbr_index {
            return false;
        }
        self.status(region);
        self.slot.is_none() && !self.expired
    }

    /// True when the session has no slot in the table and, by the stamps, cannot get one:
    /// every slot holds another client's session, active within `idle_evict`. The hello's
    /// early refusal; the sequencer may refuse a session for more reasons (see
    /// `service`, which learns it from the ordered frontier).
    pub fn crowded_out(&self, region: &Region, idle_evict: Duration) -> bool {
        self.slot.is_none()
            && region.session_find(self.topic, self.client_id).is_none()
            && !region.session_table_has_room(self.topic, unix_ms(), idle_evict.as_millis() as u64)
    }
}

/// The error text of a SessionsExhausted frame.
pub fn exhausted_message(topic: &str, idle_evict: Duration) -> String {
    format!(
        "all {} order-5 session slots of topic {topic:?} hold other clients' sessions, each \
         active within the last {} s (sequencer.session_idle_evict_secs) and not ended by \
         its publisher (a publisher that closes ends its session; one dropped or killed \
         without closing holds it until idle that long); retry when one has ended or been \
         idle that long, publish with a client id that has a session on it, or use \
         another topic",
        embarcadero_region::SESSION_SLOTS,
        idle_evict.as_secs()
    )
}

/// The error text of a SessionExpired frame.
pub fn expired_message(idle_evict: Duration) -> String {
    format!(
        "this order-5 session ended while the connection was open: it was idle for more than \
         {} s (sequencer.session_idle_evict_secs), or a publisher of it ended it on closing, \
         and its slot in the session table went to a new session, so its deduplication marks \
         are gone; batches not yet acknowledged may or may not be in the log: start a new \
         session (a new publisher) and resend them",
        idle_evict.as_secs()
    )
}

/// The error text of a SessionKeyMismatch frame.
pub fn foreign_key_message(client_id: u64) -> String {
    format!(
        "the order-5 session of client id {client_id} is bound to another session key: this \
         connection does not own it; a publisher keeps its key for the session's life, so a \
         restarted one that lost it must publish with a new client id"
    )
}

/// The SessionFenced refusal of `epoch`, carrying the committed high-water mark `hwm`
/// in the frame's `arg` for the client to resend from, and the session's `current`
/// epoch.
pub fn fenced(epoch: u64, hwm: u64, current: u64) -> crate::net::Refusal {
    let frame = embarcadero_wire::ErrorFrame::session_fenced(epoch, hwm, current);
    crate::net::Refusal {
        code: frame.code,
        batch_seq: frame.batch_seq,
        session_epoch: frame.session_epoch,
        message: frame.message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use embarcadero_region::{Capacities, SessionRecord, TopicMeta, SESSION_SLOTS};

    fn region() -> (tempfile::TempDir, Region) {
        let dir = tempfile::tempdir().unwrap();
        let caps = Capacities {
            max_topics: 1,
            brokers: 1,
            goi_slots: 64,
            pbr_slots: 64,
            segment_bytes: 4096,
            segments_per_broker: 4,
            seg_map_slots: 8,
        };
        let r = Region::create(&dir.path().join("r"), caps).unwrap();
        r.write_topic_meta(0, &TopicMeta::new("s", 5));
        (dir, r)
    }

    fn record(client_id: u64, committed_hwm: u64, last_active_ms: u64) -> SessionRecord {
        SessionRecord {
            state: SessionState::Open,
            client_id,
            session_epoch: 1,
            opener: 0,
            committed_hwm,
            last_active_ms,
            opened_at: 0,
            key_hash: 0,
        }
    }

    #[test]
    fn a_connection_with_another_key_than_the_sessions_reads_as_foreign() {
        let (_d, r) = region();
        let mut owner = SessionView::new(0, 7, 1, 0xa);
        let mut thief = SessionView::new(0, 7, 1, 0xb);
        r.session_write(0, 3, &record(7, 5, 1));
        assert!(
            !thief.status(&r).foreign_key,
            "an unbound session (rebuilt from disk) takes any key"
        );
        r.session_write(
            0,
            3,
            &SessionRecord {
                key_hash: 0xa,
                ..record(7, 5, 1)
            },
        );
        assert!(!owner.status(&r).foreign_key);
        assert!(thief.status(&r).foreign_key);
        assert_eq!(thief.status(&r).committed_hwm, 5);
    }

    #[test]
    fn a_session_admitted_after_the_last_status_is_not_taken_for_dropped() {
        let (_d, r) = region();
        let mut view = SessionView::new(0, 7, 1, 0);
        assert_eq!(view.status(&r).committed_hwm, 0, "not seen yet");
        assert!(
            !view.dropped_without_slot(&r, 0, 0),
            "the frontier has not passed the batch"
        );
        // The sequencer admits the session and orders its batch in slot 0: table first,
        // then the frontier. The view's last status came before both.
        r.session_write(0, 3, &record(7, 1, 1));
        r.sequencer_line(0, 0)
            .ordered_pbr
            .advance(1, std::sync::atomic::Ordering::Release);
        assert!(!view.dropped_without_slot(&r, 0, 0));
        assert_eq!(
            view.status(&r).committed_hwm,
            1,
            "the view found the session"
        );
    }

    #[test]
    fn a_batch_passed_with_no_session_in_the_table_was_dropped_without_a_slot() {
        let (_d, r) = region();
        let mut view = SessionView::new(0, 7, 1, 0);
        r.sequencer_line(0, 0)
            .ordered_pbr
            .advance(1, std::sync::atomic::Ordering::Release);
        assert!(view.dropped_without_slot(&r, 0, 0));
        assert!(
            !view.dropped_without_slot(&r, 0, 1),
            "a batch the frontier has not passed"
        );
    }

    #[test]
    fn a_session_whose_slot_goes_to_another_client_reads_as_expired() {
        let (_d, r) = region();
        let mut view = SessionView::new(0, 7, 1, 0);
        let s = view.status(&r);
        assert!(
            !s.expired && s.committed_hwm == 0,
            "not seen yet is not expired"
        );
        r.session_write(0, 3, &record(7, 5, 1));
        let s = view.status(&r);
        assert!(!s.expired);
        assert_eq!(s.committed_hwm, 5);
        // The sequencer ends the session and gives slot 3 to client 8.
        r.session_write(0, 3, &record(8, 1, 2));
        assert!(view.status(&r).expired);
        // For good: the client's marks are gone even if it shows up again elsewhere.
        r.session_write(0, 4, &record(7, 1, 3));
        assert!(view.status(&r).expired);
        // Also when the client id's new session is found first, and then its old slot
        // is seen holding another client.
        let mut old = SessionView::new(0, 9, 1, 0);
        r.session_write(0, 5, &record(9, 4, 1));
        old.status(&r);
        r.session_write(0, 6, &record(9, 1, 4));
        r.session_write(0, 5, &record(10, 1, 4));
        let s = old.status(&r);
        assert!(s.expired && s.committed_hwm == 0, "{s:?}");
        // A fresh connection of client 7 sees its new session.
        assert_eq!(SessionView::new(0, 7, 1, 0).status(&r).committed_hwm, 1);
    }

    #[test]
    fn touching_raises_the_stamp_at_most_once_a_second() {
        let (_d, r) = region();
        r.session_write(0, 0, &record(7, 1, 1_000));
        let mut view = SessionView::new(0, 7, 1, 0);
        view.touch(&r, 5_000);
        assert_eq!(
            r.session_read(0, 0).unwrap().last_active_ms,
            1_000,
            "slot unknown yet"
        );
        view.status(&r);
        view.touch(&r, 5_000);
        view.touch(&r, 5_500);
        assert_eq!(r.session_read(0, 0).unwrap().last_active_ms, 5_000);
        view.touch(&r, 6_000);
        assert_eq!(r.session_read(0, 0).unwrap().last_active_ms, 6_000);
        // The sequencer's rewrite never lowers it.
        r.session_write(0, 0, &record(7, 2, 5_800));
        assert_eq!(r.session_read(0, 0).unwrap().last_active_ms, 6_000);
    }

    #[test]
    fn a_new_session_is_crowded_out_only_when_no_slot_is_free_or_idle() {
        let (_d, r) = region();
        let now = unix_ms();
        let idle = Duration::from_secs(600);
        let view = SessionView::new(0, 9999, 1, 0);
        for slot in 0..SESSION_SLOTS - 1 {
            r.session_write(0, slot, &record(slot as u64, 1, now));
        }
        assert!(!view.crowded_out(&r, idle), "one slot free");
        r.session_write(0, SESSION_SLOTS - 1, &record(500, 1, now - 600_001));
        assert!(
            !view.crowded_out(&r, idle),
            "one session idle for longer than 600 s"
        );
        r.session_touch(0, SESSION_SLOTS - 1, now);
        assert!(view.crowded_out(&r, idle));
    }
}
