//! Model checks of the lease/ticket hand-off under every interleaving loom explores (those of
//! the credit accounting are in `gpucache_dataplane::credits`). Built only with
//! `RUSTFLAGS="--cfg loom"`; every test name carries `loom`, so `cargo test --lib loom` selects
//! them.

use loom::thread;

use gpucache_dataplane::credits::{CreditClass, CreditPool, CreditUsage, Credits};

use super::lease::{RequestKey, StorageLease, Ticket, TicketId, WaitOutcome};

#[test]
fn loom_lease_drop_races_ready_expiry_and_returns_credits_once() {
    loom::model(|| {
        let pool = CreditPool::new(Credits::new(2, 2));
        let ticket = Ticket::new(TicketId(1), RequestKey(1));
        let grant = pool.acquire(CreditClass::Read, Credits::new(1, 2)).expect("grant");
        assert!(ticket.hold_ready(grant).is_ok());
        let lease = StorageLease::new(ticket.clone());
        let owner = thread::spawn(move || drop(lease));
        let expired = ticket.end(WaitOutcome::Detached);
        drop(expired);
        owner.join().expect("lease thread");
        assert_eq!(pool.usage(), CreditUsage::default());
        assert!(!ticket.is_attached());
    });
}
