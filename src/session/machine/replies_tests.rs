//! Byte fixtures for the backend → client half: requests go into an [`Outbox`] as the relay
//! writes them, the backend's replies are fed as bytes (whole, or cut at every size), and the
//! tests check what the client receives, byte for byte, and what the driver is told.

use bytes::BytesMut;

use super::*;
use crate::session::tracker::{Expect, Kind, Mode, Outbox};

// ------------------------------------------------------------------ fixtures

fn msg(tag: u8, body: &[u8]) -> Vec<u8> {
    let mut f = vec![tag];
    f.extend_from_slice(&(body.len() as i32 + 4).to_be_bytes());
    f.extend_from_slice(body);
    f
}

fn row_description() -> Vec<u8> {
    let mut b = vec![0, 1];
    b.extend_from_slice(b"abalance\0");
    b.extend_from_slice(&[0; 18]);
    msg(b'T', &b)
}

fn data_row(cols: &[&[u8]]) -> Vec<u8> {
    let mut b = (cols.len() as i16).to_be_bytes().to_vec();
    for c in cols {
        b.extend_from_slice(&(c.len() as i32).to_be_bytes());
        b.extend_from_slice(c);
    }
    msg(b'D', &b)
}

/// A one-column, one-row SELECT's whole reply, through ReadyForQuery (idle).
fn one_row_select(value: &[u8]) -> Vec<u8> {
    cat(&[
        row_description(),
        data_row(&[value]),
        complete("SELECT 1"),
        ready(b'I'),
    ])
}

fn complete(tag: &str) -> Vec<u8> {
    msg(b'C', format!("{tag}\0").as_bytes())
}

fn ready(status: u8) -> Vec<u8> {
    msg(b'Z', &[status])
}

fn error(severity: &str, code: &str, text: &str, position: Option<u32>) -> Vec<u8> {
    let mut b = format!("S{severity}\0V{severity}\0C{code}\0M{text}\0");
    if let Some(p) = position {
        b.push_str(&format!("P{p}\0"));
    }
    b.push('\0');
    msg(b'E', b.as_bytes())
}

fn cat(parts: &[Vec<u8>]) -> Vec<u8> {
    parts.concat()
}

fn fwd(kind: Kind) -> Expect {
    Expect::new(kind, Mode::Forward)
}

/// A frontend frame of the right type for `kind` (the outbox checks the type).
fn request(kind: Kind) -> Vec<u8> {
    match kind {
        Kind::Parse => msg(b'P', b"\0SELECT 1\0\0\0"),
        Kind::Bind => msg(b'B', b"\0_pgsl_s\0\0\0\0\0\0\0"),
        Kind::DescribePortal => msg(b'D', b"P\0"),
        Kind::DescribeStmt => msg(b'D', b"S_pgsl_s\0"),
        Kind::Execute => msg(b'E', b"\0\0\0\0\0"),
        Kind::Close => msg(b'C', b"S_pgsl_s\0"),
        Kind::Sync => msg(b'S', b""),
        Kind::Query => msg(b'Q', b"SELECT 1\0"),
        Kind::FunctionCall => msg(b'F', b"\0\0\0\0\0\0\0\0\0\0"),
    }
}

fn send(out: &mut Outbox, e: Expect) {
    out.send(e, &request(e.kind));
}

/// The relay's backend side with a client that receives everything.
#[derive(Default)]
struct Session {
    replies: Replies,
    out: Outbox,
    retry: Option<Retry>,
    /// Bytes written for the client, flushes included.
    client: Vec<u8>,
    pending: BytesMut,
    seen: Vec<Seen>,
    flushes: usize,
}

impl Session {
    /// Feeds backend bytes as one read, then runs the core until it wants more.
    fn read(&mut self, bytes: &[u8]) -> Result<(), FrameError> {
        self.replies.buf_mut().extend_from_slice(bytes);
        loop {
            match self
                .replies
                .next(&mut self.out.t, &mut self.retry, &mut self.pending)?
            {
                Next::Read => break,
                Next::Flush => {
                    self.flushes += 1;
                    self.flush();
                }
                Next::Seen(s) => self.seen.push(s),
            }
        }
        self.flush();
        Ok(())
    }

    /// Feeds `bytes` in reads of `size` bytes.
    fn read_in(&mut self, bytes: &[u8], size: usize) {
        for chunk in bytes.chunks(size) {
            self.read(chunk).expect("well-formed fixture");
        }
    }

    fn flush(&mut self) {
        self.client.extend_from_slice(&self.pending);
        self.pending.clear();
    }
}

fn ready_seen() -> Seen {
    Seen {
        ready: true,
        ..Seen::default()
    }
}

fn ready_rows(n: u64) -> Seen {
    Seen {
        rows: n,
        ..ready_seen()
    }
}

fn error_seen(code: &str) -> Seen {
    Seen {
        errored: true,
        code: Some(code.as_bytes().try_into().unwrap()),
        ..Seen::default()
    }
}

// ------------------------------------------------------------------ simple protocol

#[test]
fn a_simple_select_reaches_the_client_byte_for_byte() {
    let mut s = Session::default();
    send(&mut s.out, fwd(Kind::Query));
    let reply = one_row_select(b"0");
    s.read(&reply).unwrap();
    assert_eq!(s.client, reply);
    assert_eq!(s.seen, vec![ready_rows(1)]);
    assert!(s.out.t.idle() && s.replies.quiet());
}

#[test]
fn any_cut_of_the_backend_stream_gives_the_client_the_same_bytes_and_the_driver_the_same_events() {
    let big = vec![b'x'; 3000];
    let reply = cat(&[
        // An injected SET LOCAL (swallowed), the client's query with a long row…
        complete("SET"),
        ready(b'T'),
        row_description(),
        data_row(&[&big, b"y"]),
        data_row(&[b"1"]),
        complete("SELECT 2"),
        ready(b'T'),
        // …and a failing one.
        error(
            "ERROR",
            "42P01",
            "relation \"nope\" does not exist",
            Some(15),
        ),
        ready(b'E'),
    ]);
    let run = |size: usize| {
        let mut s = Session::default();
        s.out
            .query(Mode::Swallow, "SET LOCAL statement_timeout = '1s'");
        send(&mut s.out, fwd(Kind::Query));
        send(&mut s.out, fwd(Kind::Query));
        s.read_in(&reply, size);
        assert!(s.replies.quiet(), "cut {size}");
        (s.client, s.seen)
    };
    let whole = run(reply.len());
    assert_eq!(
        whole.0,
        reply[complete("SET").len() + ready(b'T').len()..],
        "everything but the injected statement's replies"
    );
    assert_eq!(
        whole.1,
        vec![ready_rows(2), error_seen("42P01"), ready_seen()]
    );
    for size in (1..=23).chain([64, 1000, 2999, 3001]) {
        assert_eq!(run(size), whole, "reads of {size} bytes");
    }
}

#[test]
fn a_long_row_is_streamed_not_buffered() {
    let mut s = Session::default();
    send(&mut s.out, fwd(Kind::Query));
    let row = data_row(&[&vec![b'r'; 10_000]]);
    s.read(&row[..100]).unwrap();
    assert_eq!(s.client, row[..100], "forwarded before the row is whole");
    assert!(!s.replies.quiet(), "the rest of the row is owed");
    s.read(&row[100..5_000]).unwrap();
    assert_eq!(s.client.len(), 5_000);
    s.read(&cat(&[
        row[5_000..].to_vec(),
        complete("SELECT 1"),
        ready(b'I'),
    ]))
    .unwrap();
    assert_eq!(s.client[..row.len()], row[..]);
    assert_eq!(s.seen, vec![ready_rows(1)]);
}

#[test]
fn a_large_result_asks_for_flushes_on_the_way() {
    let mut s = Session::default();
    send(&mut s.out, fwd(Kind::Query));
    let row = data_row(&[&[b'v'; 1000]]);
    let mut reply = Vec::new();
    for _ in 0..300 {
        reply.extend_from_slice(&row);
    }
    reply.extend(cat(&[complete("SELECT 300"), ready(b'I')]));
    s.read(&reply).unwrap();
    assert!(s.flushes >= 4, "300 KB in one read: {} flushes", s.flushes);
    assert_eq!(s.client, reply);
}

#[test]
fn injected_timeouts_are_hidden_and_error_positions_point_into_the_clients_text() {
    // `SET LOCAL statement_timeout = ..; <client text>` sent as one Query: the SET's
    // CommandComplete is dropped, an error position is moved back by the prefix.
    let mut s = Session::default();
    let mut e = fwd(Kind::Query);
    e.skip_complete = 1;
    e.pos_shift = 40;
    send(&mut s.out, e);
    s.read(&cat(&[
        complete("SET"),
        error(
            "ERROR",
            "42601",
            "syntax error at or near \"FORM\"",
            Some(49),
        ),
        ready(b'I'),
    ]))
    .unwrap();
    assert_eq!(
        s.client,
        cat(&[
            error(
                "ERROR",
                "42601",
                "syntax error at or near \"FORM\"",
                Some(9)
            ),
            ready(b'I')
        ])
    );
    assert_eq!(s.seen, vec![error_seen("42601"), ready_seen()]);
}

#[test]
fn a_failed_injected_query_is_reported_to_the_driver_not_forwarded() {
    let mut s = Session::default();
    s.out.query(Mode::Swallow, "SET search_path = 'x'");
    send(&mut s.out, fwd(Kind::Query));
    s.read(&cat(&[
        error("ERROR", "42501", "permission denied to set parameter", None),
        ready(b'I'),
        complete("SELECT 0"),
        ready(b'I'),
    ]))
    .unwrap();
    assert_eq!(s.client, cat(&[complete("SELECT 0"), ready(b'I')]));
    assert_eq!(
        s.seen,
        vec![
            Seen {
                injected_failed: true,
                ..Seen::default()
            },
            ready_seen()
        ]
    );
    assert_eq!(
        s.replies.take_injected_failure(),
        "permission denied to set parameter"
    );
}

#[test]
fn a_fatal_error_is_forwarded_and_flagged() {
    let mut s = Session::default();
    send(&mut s.out, fwd(Kind::Query));
    let e = error(
        "FATAL",
        "57P01",
        "terminating connection due to administrator command",
        None,
    );
    s.read(&e).unwrap();
    assert_eq!(s.client, e);
    assert_eq!(
        s.seen,
        vec![Seen {
            fatal: true,
            ..error_seen("57P01")
        }]
    );
}

#[test]
fn a_notification_between_requests_goes_to_the_client() {
    let mut s = Session::default();
    let note = msg(b'A', b"\0\0\0\x07chan\0payload\0");
    s.read(&note).unwrap();
    assert_eq!(s.client, note);
    assert!(s.seen.is_empty());
}

#[test]
fn a_malformed_frame_is_an_error() {
    let mut s = Session::default();
    send(&mut s.out, fwd(Kind::Query));
    assert!(matches!(
        s.read(&[b'Z', 0, 0, 0, 3, b'I']),
        Err(FrameError::BadLength { tag: b'Z', .. })
    ));
    let mut s = Session::default();
    assert!(matches!(
        s.read(&msg(b'Q', b"SELECT 1\0")),
        Err(FrameError::UnknownType { tag: b'Q', .. })
    ));
}

#[test]
fn messages_forwarded_whole_keep_their_order_around_swallowed_and_bad_ones() {
    // One read: an injected SET's replies (swallowed) between two forwarded queries' replies;
    // the client gets exactly the forwarded ones, in order, in one buffer.
    let mut s = Session::default();
    send(&mut s.out, fwd(Kind::Query));
    s.out.query(Mode::Swallow, "SET x = 1");
    send(&mut s.out, fwd(Kind::Query));
    let first = one_row_select(b"1");
    let second = cat(&[complete("UPDATE 2"), ready(b'I')]);
    s.read(&cat(&[
        first.clone(),
        complete("SET"),
        ready(b'I'),
        second.clone(),
    ]))
    .unwrap();
    assert_eq!(s.client, cat(&[first, second]));
    // Messages before a malformed one still go to the client before the error ends it.
    let mut s = Session::default();
    send(&mut s.out, fwd(Kind::Query));
    let good = cat(&[row_description(), data_row(&[b"7"])]);
    assert!(matches!(
        s.read(&cat(&[good.clone(), vec![b'Z', 0, 0, 0, 3, b'I']])),
        Err(FrameError::BadLength { tag: b'Z', .. })
    ));
    assert_eq!(&s.pending[..], &good[..]);
}

// ------------------------------------------------------------------ extended protocol

#[test]
fn an_error_mid_pipeline_skips_to_sync_and_later_answers_keep_their_place() {
    // Batch 1 prepares statement 7 and fails at its Parse; batch 2 uses a statement the
    // proxy knows is prepared, so its Parse is answered here — after batch 1's replies.
    let mut s = Session::default();
    let mut parse = fwd(Kind::Parse);
    parse.stmt = Some(7);
    send(&mut s.out, parse);
    for k in [Kind::Bind, Kind::Execute, Kind::Sync] {
        send(&mut s.out, fwd(k));
    }
    s.out.answer_here(Kind::Parse);
    for k in [Kind::Bind, Kind::Execute, Kind::Sync] {
        send(&mut s.out, fwd(k));
    }
    let e = error("ERROR", "42601", "syntax error", Some(8));
    s.read(&cat(&[
        e.clone(),
        ready(b'I'),
        msg(b'2', b""),
        data_row(&[b"1"]),
        complete("SELECT 1"),
        ready(b'I'),
    ]))
    .unwrap();
    assert_eq!(
        s.client,
        cat(&[
            e,
            ready(b'I'),
            msg(b'1', b""),
            msg(b'2', b""),
            data_row(&[b"1"]),
            complete("SELECT 1"),
            ready(b'I'),
        ])
    );
    assert_eq!(
        s.seen,
        vec![
            Seen {
                not_prepared: true,
                ..error_seen("42601")
            },
            ready_seen(),
            ready_rows(1)
        ]
    );
    assert_eq!(s.replies.take_not_prepared(), vec![7]);
    assert!(s.out.t.idle());
}

#[test]
fn a_close_answered_here_waits_for_the_replies_before_it() {
    let mut s = Session::default();
    send(&mut s.out, fwd(Kind::Bind));
    send(&mut s.out, fwd(Kind::Execute));
    s.out.answer_here(Kind::Close);
    send(&mut s.out, fwd(Kind::Sync));
    // Nothing from the backend yet: the Close's answer must not jump ahead.
    s.read(&[]).unwrap();
    assert!(s.client.is_empty());
    s.read(&cat(&[msg(b'2', b""), complete("SELECT 0")]))
        .unwrap();
    assert_eq!(
        s.client,
        cat(&[msg(b'2', b""), complete("SELECT 0"), msg(b'3', b"")])
    );
    s.read(&ready(b'I')).unwrap();
    assert!(s.out.t.idle());
}

/// A batch of `kinds` starting with the Bind of proxy statement 42, sent and recorded for a
/// replay, as the relay leaves it.
fn replayable(kinds: &[Kind]) -> Session {
    let mut s = Session::default();
    for &k in kinds {
        let mut e = fwd(k);
        if k == Kind::Bind {
            e.target = Some(42);
        }
        send(&mut s.out, e);
    }
    let frames = kinds.iter().map(|&k| request(k)).collect();
    s.retry = Some(Retry::recorded(42, frames));
    s
}

#[test]
fn a_stale_plan_is_hidden_then_replayed_once() {
    // Bind + Describe + Execute + Sync of statement 42, recorded for a replay: the 0A000 and
    // the batch's ReadyForQuery never reach the client, the driver is told to replay.
    let mut s = replayable(&[Kind::Bind, Kind::DescribePortal, Kind::Execute, Kind::Sync]);
    s.read(&cat(&[
        error(
            "ERROR",
            "0A000",
            "cached plan must not change result type",
            None,
        ),
        ready(b'I'),
    ]))
    .unwrap();
    assert!(
        s.client.is_empty(),
        "the client sees nothing of the first try"
    );
    assert_eq!(
        s.seen,
        vec![
            Seen {
                stale: Some(42),
                ..Seen::default()
            },
            Seen {
                replay: true,
                ..Seen::default()
            }
        ]
    );
    assert!(s.retry.is_some(), "the driver takes the batch to replay it");
}

#[test]
fn a_stale_plan_of_a_batch_without_describe_reaches_the_client() {
    // A driver that relies on a description from an earlier round trip gets the 0A000 as
    // Postgres sends it (rows of a shape it did not ask for would be worse); the statement is
    // still forgotten, so its next use re-prepares it.
    let mut s = replayable(&[Kind::Bind, Kind::Execute, Kind::Sync]);
    let e = error(
        "ERROR",
        "0A000",
        "cached plan must not change result type",
        None,
    );
    let reply = cat(&[e, ready(b'I')]);
    s.read(&reply).unwrap();
    assert_eq!(s.client, reply);
    assert_eq!(
        s.seen,
        vec![
            Seen {
                stale: Some(42),
                ..error_seen("0A000")
            },
            ready_seen()
        ]
    );
    assert!(s.retry.is_none(), "the batch is over");
}

#[test]
fn a_batch_whose_rows_went_out_is_not_replayed() {
    let mut s = replayable(&[Kind::Bind, Kind::DescribePortal, Kind::Execute, Kind::Sync]);
    // Rows reached the client, then an error of the same class: replaying would send the
    // rows twice.
    let e = error(
        "ERROR",
        "0A000",
        "cached plan must not change result type",
        None,
    );
    let reply = cat(&[
        msg(b'2', b""),
        row_description(),
        data_row(&[b"1"]),
        e,
        ready(b'I'),
    ]);
    s.read(&reply).unwrap();
    assert_eq!(s.client, reply);
    assert_eq!(s.seen, vec![error_seen("0A000"), ready_seen()]);
    assert!(s.retry.is_none());
}

// ------------------------------------------------------------------ COPY

#[test]
fn copy_out_streams_its_data_and_ends_the_request() {
    let mut s = Session::default();
    send(&mut s.out, fwd(Kind::Query));
    let reply = cat(&[
        msg(b'H', b"\0\0\x01\0\0"),
        msg(b'd', &[b'a'; 500]),
        msg(b'd', b"b\n"),
        msg(b'c', b""),
        complete("COPY 2"),
        ready(b'I'),
    ]);
    s.read_in(&reply, 37);
    assert_eq!(s.client, reply);
    assert_eq!(s.seen, vec![ready_rows(2)]);
    assert!(s.out.t.idle());
}

#[test]
fn copy_in_holds_the_backend_until_its_command_completes() {
    let mut s = Session::default();
    send(&mut s.out, fwd(Kind::Query));
    s.read(&msg(b'G', b"\0\0\x01\0\0")).unwrap();
    assert!(s.out.t.copy_in && !s.out.t.idle());
    // The client's CopyData and CopyDone owe no reply of their own.
    s.out.pass(&msg(b'd', b"1\n"));
    s.out.pass(&msg(b'c', b""));
    s.read(&cat(&[complete("COPY 1"), ready(b'I')])).unwrap();
    assert_eq!(s.seen, vec![ready_rows(1)]);
    assert!(s.out.t.idle());
}

// ------------------------------------------------------------------ settings read-back

#[test]
fn the_settings_read_back_is_read_whole_and_never_forwarded() {
    let mut s = Session::default();
    s.out
        .query(Mode::Capture, "SELECT name, setting FROM pg_settings ..");
    let reply = cat(&[
        row_description(),
        data_row(&[b"search_path", b"\"$user\", public"]),
        data_row(&[b"TimeZone", b"UTC"]),
        complete("SELECT 2"),
        ready(b'I'),
    ]);
    s.read_in(&reply, 9);
    assert!(s.client.is_empty());
    assert_eq!(
        s.seen,
        vec![Seen {
            captured: true,
            ..Seen::default()
        }]
    );
    assert_eq!(
        s.replies.take_settings(),
        vec![
            ("TimeZone".into(), "UTC".into()),
            ("search_path".into(), "\"$user\", public".into()),
        ]
    );
    assert!(s.out.t.idle());
}

#[test]
fn a_half_read_message_is_left_for_the_cleanup() {
    let mut s = Session::default();
    send(&mut s.out, fwd(Kind::Query));
    let row = data_row(&[&[b'z'; 200]]);
    s.read(&row[..50]).unwrap();
    let (skip, buffered) = s.replies.take_rest();
    assert_eq!(skip, row.len() - 50, "the rest of the streamed row");
    assert!(buffered.is_empty());
    let mut s = Session::default();
    send(&mut s.out, fwd(Kind::Query));
    s.read(&complete("SELECT 1")[..3]).unwrap();
    let (skip, buffered) = s.replies.take_rest();
    assert_eq!((skip, &buffered[..]), (0, &complete("SELECT 1")[..3]));
}
