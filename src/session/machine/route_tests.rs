//! Routing decisions without a server: which statements and batches a replica may serve, which
//! statements count as writes, and when read-your-writes lets a read go to a replica.

use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use std::time::Instant;

use super::*;
use crate::classify::Classifier;
use crate::protocol::messages;
use crate::protocol::tag::{frontend, target};

fn classifier() -> Classifier {
    Classifier::new(0, 1 << 16)
}

fn parse(out: &mut BytesMut, name: &str, sql: &str) {
    messages::parse_named(out, name.as_bytes(), sql.as_bytes(), b"\0\0");
}

fn bind(out: &mut BytesMut, stmt: &str) {
    messages::bind_renamed(out, b"", stmt.as_bytes(), b"\0\0\0\0\0\0");
}

fn execute(out: &mut BytesMut) {
    messages::raw(out, frontend::EXECUTE, &[b"\0", &0i32.to_be_bytes()]);
}

/// Judges a batch against a classifier, with `known` as the statements prepared before it.
fn judged(opened_by: Option<&str>, rest: &[u8], known: &[(&str, &str)]) -> bool {
    let c = classifier();
    batch_reads(opened_by.map(str::as_bytes), rest, |item| match item {
        Item::Parse(q) => routable(&c.classify(std::str::from_utf8(q).expect("utf8"))),
        Item::Bind(name) => known
            .iter()
            .find(|(n, _)| n.as_bytes() == name)
            .is_some_and(|(_, sql)| routable(&c.classify(sql))),
    })
}

#[test]
fn plain_reads_are_routable_and_the_rest_is_not() {
    let c = classifier();
    for sql in [
        "SELECT 1",
        "select id, v from notes where id = $1",
        "SELECT count(*) FROM notes",
    ] {
        assert!(routable(&c.classify(sql)), "{sql}");
    }
    for sql in [
        "INSERT INTO notes (v) VALUES ($1)",
        "SELECT * FROM notes FOR UPDATE",
        "SELECT 1; SELECT 2",
        "BEGIN",
        "SET search_path = x",
        "SELECT set_config('a.b', 'c', false)",
        "SELECT my_function()",
        "SELECT nextval('s')",
        "SELECT pg_catalog.setval('s', 5)",
        "SELECT id FROM notes WHERE pg_try_advisory_xact_lock(id)",
        "SELECT txid_current()",
    ] {
        assert!(!routable(&c.classify(sql)), "{sql}");
    }
}

#[test]
fn writes_and_unknowns_count_as_writes_and_transaction_control_does_not() {
    let c = classifier();
    for sql in [
        "BEGIN",
        "commit",
        "ROLLBACK",
        "SAVEPOINT a",
        "release savepoint a",
        "SELECT 1",
    ] {
        assert!(!may_write(&c.classify(sql)), "{sql}");
    }
    for sql in [
        "INSERT INTO notes (v) VALUES ($1)",
        "UPDATE notes SET v = 'x'",
        "CREATE TABLE t (a int)",
        "SELECT my_function()",
        "SELECT * FROM notes FOR UPDATE",
        "BEGIN; INSERT INTO notes (v) VALUES ('a'); COMMIT",
        "COMMIT PREPARED 'x'",
        "PREPARE TRANSACTION 'x'",
        "CALL p()",
        "SELECT nextval('s')",
    ] {
        assert!(may_write(&c.classify(sql)), "{sql}");
    }
}

#[test]
fn a_batch_of_reads_up_to_its_sync_is_routable() {
    // Parse(unnamed) opened the batch: Bind, Describe, Execute, Sync follow.
    let mut b = BytesMut::new();
    bind(&mut b, "");
    messages::target(&mut b, frontend::DESCRIBE, target::PORTAL, b"");
    execute(&mut b);
    messages::sync(&mut b);
    assert!(judged(Some(""), &b, &[]));
    // A second read parsed and bound in the same batch, and a Flush.
    let mut b = BytesMut::new();
    bind(&mut b, "a");
    execute(&mut b);
    parse(&mut b, "b", "SELECT count(*) FROM notes");
    bind(&mut b, "b");
    execute(&mut b);
    messages::raw(&mut b, frontend::FLUSH, &[]);
    messages::sync(&mut b);
    assert!(judged(Some("a"), &b, &[]));
    // Opened by a Bind of a read prepared earlier.
    let mut b = BytesMut::new();
    execute(&mut b);
    bind(&mut b, "s0");
    execute(&mut b);
    messages::sync(&mut b);
    assert!(judged(None, &b, &[("s0", "SELECT 1")]));
}

#[test]
fn a_batch_with_a_write_an_unknown_or_no_sync_stays_on_the_primary() {
    // A write parsed later in the batch.
    let mut b = BytesMut::new();
    bind(&mut b, "");
    execute(&mut b);
    parse(&mut b, "w", "INSERT INTO notes (v) VALUES ($1)");
    bind(&mut b, "w");
    execute(&mut b);
    messages::sync(&mut b);
    assert!(!judged(Some(""), &b, &[]));
    // A Bind of a statement prepared earlier that writes, or that the proxy never saw.
    for known in [&[("s1", "DELETE FROM notes")][..], &[]] {
        let mut b = BytesMut::new();
        bind(&mut b, "s1");
        execute(&mut b);
        messages::sync(&mut b);
        assert!(!judged(None, &b, known), "{known:?}");
    }
    // A simple Query inside the batch.
    let mut b = BytesMut::new();
    bind(&mut b, "");
    messages::query(&mut b, "SELECT 1");
    messages::sync(&mut b);
    assert!(!judged(Some(""), &b, &[]));
    // The Sync has not arrived (a Flush is not one), or arrived cut short.
    let mut b = BytesMut::new();
    bind(&mut b, "");
    execute(&mut b);
    messages::raw(&mut b, frontend::FLUSH, &[]);
    assert!(!judged(Some(""), &b, &[]));
    let mut cut = b.clone();
    messages::sync(&mut cut);
    assert!(!judged(Some(""), &cut[..cut.len() - 1], &[]));
    // Too many messages before the Sync.
    let mut b = BytesMut::new();
    for _ in 0..MAX_BATCH_MESSAGES {
        execute(&mut b);
    }
    messages::sync(&mut b);
    assert!(!judged(Some(""), &b, &[]));
    // Garbage.
    assert!(!judged(Some(""), b"S\0\0\0\x02", &[]));
}

#[test]
fn a_bind_of_a_name_parsed_in_the_batch_follows_that_parse() {
    // `s1` was a read before the batch; the batch parses it again as a write.
    let mut b = BytesMut::new();
    parse(&mut b, "s1", "UPDATE notes SET v = 'x'");
    bind(&mut b, "s1");
    execute(&mut b);
    messages::sync(&mut b);
    assert!(!judged(None, &b, &[("s1", "SELECT 1")]));
    // And the other way round: a write before, a read now (the Parse is judged).
    let mut b = BytesMut::new();
    parse(&mut b, "s1", "SELECT 1");
    bind(&mut b, "s1");
    execute(&mut b);
    messages::sync(&mut b);
    assert!(judged(None, &b, &[("s1", "DELETE FROM notes")]));
}

#[test]
fn read_your_writes_waits_for_the_replayed_position_or_the_window() {
    let now = Instant::now();
    let mut any = Fresh::Any;
    assert!(any.allows(None, now));

    // The position read is still running: no replica qualifies, whatever it replayed.
    let mark = Arc::new(WalMark::default());
    let mut f = Fresh::Replayed(Arc::clone(&mark));
    assert!(!f.allows(Some(Lsn::MAX), now));
    let mut f2 = Fresh::Replayed(Arc::new(WalMark::known(Lsn(0x1_0000_0000))));
    assert!(!f2.allows(None, now), "an unknown replay position is stale");
    assert!(!f2.allows(Some(Lsn(0xFFFF_FFFF)), now), "behind the write");
    assert!(
        f2.allows(Some(Lsn(0x1_0000_0000)), now),
        "exactly at the write"
    );
    assert!(matches!(f2, Fresh::Any), "satisfied once, dropped");
    assert!(f2.allows(None, now));
    assert!(!f.allows(Some(Lsn(1)), now), "still pending");

    let mut w = Fresh::After(now + Duration::from_millis(500));
    assert!(!w.allows(Some(Lsn::MAX), now));
    assert!(!w.allows(Some(Lsn::MAX), now + Duration::from_millis(499)));
    assert!(w.allows(None, now + Duration::from_millis(500)));
}
