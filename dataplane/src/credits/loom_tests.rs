//! Model checks of the lock-free credit accounting under every interleaving loom explores.
//! Built only with `RUSTFLAGS="--cfg loom"`; every test name carries `loom`, so
//! `cargo test --lib loom` selects them.

use loom::thread;

use super::{CreditClass, CreditPool, CreditUsage, Credits};

fn assert_within(pool: &CreditPool) {
    let budget = pool.budget();
    let usage = pool.usage();
    assert!(usage.total.operations <= budget.operations, "operations over budget: {usage:?}");
    assert!(usage.total.host_blocks <= budget.host_blocks, "host blocks over budget: {usage:?}");
    assert!(usage.backup.operations <= budget.operations / 2, "backup ops over half: {usage:?}");
    assert!(usage.backup.host_blocks <= budget.host_blocks / 2, "backup host over half: {usage:?}");
    assert!(usage.backup.operations <= usage.total.operations, "backup above total: {usage:?}");
}

#[test]
fn loom_credits_two_threads_stay_within_budget_and_backup_share() {
    loom::model(|| {
        // Backup share: one operation, one Host block.
        let pool = CreditPool::new(Credits::new(3, 3));
        let other = pool.clone();
        let backup = thread::spawn(move || {
            let grant = other.acquire(CreditClass::Backup, Credits::new(1, 1));
            assert_within(&other);
            let got = grant.is_ok();
            drop(grant);
            got
        });
        let mine = pool.acquire(CreditClass::Backup, Credits::new(1, 1));
        assert_within(&pool);
        let read = pool.acquire(CreditClass::Read, Credits::new(2, 2));
        assert_within(&pool);
        let mine_ok = mine.is_ok();
        drop(mine);
        drop(read);
        let theirs_ok = backup.join().expect("backup thread");
        // The share admits one backup at a time, so at least one of the two got it.
        assert!(mine_ok || theirs_ok);
        assert_eq!(pool.usage(), CreditUsage::default());
    });
}

#[test]
fn loom_credits_refusal_rolls_back_under_contention() {
    loom::model(|| {
        // Two operations but one Host block: one reader wins, the other must give its
        // operation back.
        let pool = CreditPool::new(Credits::new(2, 1));
        let other = pool.clone();
        let t = thread::spawn(move || {
            let grant = other.acquire(CreditClass::Read, Credits::new(1, 1));
            assert_within(&other);
            grant.is_ok()
        });
        let mine = pool.acquire(CreditClass::Read, Credits::new(1, 1));
        assert_within(&pool);
        let mine_ok = mine.is_ok();
        drop(mine);
        let theirs_ok = t.join().expect("reader thread");
        assert!(mine_ok || theirs_ok, "someone gets the only Host block");
        assert_eq!(pool.usage(), CreditUsage::default(), "no charge leaks from a refusal");
    });
}
