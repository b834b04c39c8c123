//! An isolation oracle for the session core, without sockets: random pipelines of client
//! requests, mixed with what the proxy injects (timeout `SET`s, re-Parses, settings replays,
//! the capture query) and with requests it answers itself (a Parse of a statement already
//! prepared, a Close it keeps cached), run through a [`SessionCore`] — its outbox and
//! tracker, its replies (the bytes cut into reads of random sizes), its tally and its release
//! decision — against a simulated Postgres. What the client receives through the proxy must
//! be exactly what it would receive talking to Postgres directly with its own requests: the
//! same replies in the same order, nothing of the proxy's own requests, errors skipping to
//! Sync as Postgres does; the backend is never released while a reply is owed and always
//! once none is; every statement counted is completed by a ReadyForQuery. Admission,
//! checkouts and parking are the driver's and not in play here.
//!
//! [`check`] builds a scenario from arbitrary bytes: the unit tests feed it a seeded random
//! stream, the `relay_oracle` fuzz target whatever libFuzzer finds (compiled for tests and
//! under `cfg(fuzzing)` only).

use bytes::BytesMut;

use super::replies::Next;
use super::statements::Statements;
use super::{CoreLimits, SessionCore, release};
use crate::config::PoolMode;
use crate::session::tracker::{Expect, Kind, Mode};

/// Who a request belongs to.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Origin {
    Client,
    /// The proxy's own (`Swallow`, or `Capture`); never fails in these scenarios.
    Injected(Mode),
    /// The client's, answered by the proxy (nothing sent).
    AnsweredHere,
}

#[derive(Debug, Clone, Copy)]
struct Op {
    kind: Kind,
    origin: Origin,
    /// The simulated server fails this request (client requests only).
    fails: bool,
}

/// The frontend tag and a body; a failing request's body starts with `!`.
fn encode(buf: &mut BytesMut, op: Op) {
    let tag = match op.kind {
        Kind::Parse => b'P',
        Kind::Bind => b'B',
        Kind::DescribeStmt => b'D',
        Kind::DescribePortal => b'D',
        Kind::Execute => b'E',
        Kind::Close => b'C',
        Kind::Sync => b'S',
        Kind::Query => b'Q',
        Kind::FunctionCall => b'F',
    };
    let body: &[u8] = match (op.kind, op.fails) {
        (Kind::DescribeStmt, _) => b"S",
        (Kind::DescribePortal, _) => b"P",
        (_, true) => b"!",
        (_, false) => b".",
    };
    buf.extend_from_slice(&[tag]);
    buf.extend_from_slice(&(body.len() as i32 + 4).to_be_bytes());
    buf.extend_from_slice(body);
}

/// What Postgres answers to a byte stream of requests: `(tag, first body byte)` per message.
fn postgres(bytes: &[u8]) -> Vec<(u8, Option<u8>)> {
    let mut out = Vec::new();
    let mut failed = false; // extended protocol: skip to Sync after an error
    let mut rest = bytes;
    while !rest.is_empty() {
        let tag = rest[0];
        let len = i32::from_be_bytes(rest[1..5].try_into().unwrap()) as usize;
        let body = &rest[5..1 + len];
        rest = &rest[1 + len..];
        let fails = body.first() == Some(&b'!');
        match tag {
            b'Q' | b'F' => {
                failed = false;
                if fails {
                    out.push((b'E', None));
                } else if tag == b'Q' {
                    out.extend([(b'T', None), (b'D', None), (b'C', None)]);
                } else {
                    out.push((b'V', None));
                }
                out.push((b'Z', Some(b'I')));
            }
            b'S' => {
                failed = false;
                out.push((b'Z', Some(b'I')));
            }
            b'H' => {}
            _ if failed => {}
            _ if fails => {
                failed = true;
                out.push((b'E', None));
            }
            b'P' => out.push((b'1', None)),
            b'B' => out.push((b'2', None)),
            b'C' => out.push((b'3', None)),
            b'E' => out.extend([(b'D', None), (b'C', None)]),
            b'D' if body == b"S" => out.extend([(b't', None), (b'T', None)]),
            b'D' => out.push((b'T', None)),
            other => panic!("unexpected frontend message {}", char::from(other)),
        }
    }
    out
}

/// The backend's replies as bytes: a ReadyForQuery carries its status, an error its fields.
fn frames(replies: &[(u8, Option<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for &(tag, first) in replies {
        let body: Vec<u8> = match (tag, first) {
            (b'E', _) => b"SERROR\0VERROR\0CXX000\0Mfailed\0\0".to_vec(),
            (_, Some(b)) => vec![b],
            (b'C', None) => b"SELECT 1\0".to_vec(),
            (b'D' | b'T', None) => vec![0, 0],
            _ => Vec::new(),
        };
        out.push(tag);
        out.extend_from_slice(&(body.len() as i32 + 4).to_be_bytes());
        out.extend_from_slice(&body);
    }
    out
}

/// What a client sees through the proxy: a [`SessionCore`] (its outbox and tracker, its
/// `Replies`, its tally and its release decision) between it and `postgres`, the replies
/// arriving in reads of `cuts[round]` bytes. `steps` are the requests in the order the relay
/// makes them, in rounds: all of a round is written before the server answers it
/// (pipelining). Besides the bytes, the core's bookkeeping must hold: while a round is owed
/// the backend may not be released, once every reply is in it must be; and every statement
/// the tally was given is completed by a ReadyForQuery the client saw.
fn through_proxy(rounds: &[Vec<Op>], cuts: &[usize]) -> Vec<u8> {
    let mut core = SessionCore::new(
        PoolMode::Transaction,
        BytesMut::new(),
        CoreLimits {
            max_message: 1 << 20,
        },
        Statements::new(true, 0, 100),
        true,
        false,
    );
    let class = std::sync::Arc::new(crate::classify::fingerprint::analyze("SELECT 1", 1 << 20));
    let now = std::time::Instant::now();
    let (mut tracked, mut completed) = (0u64, 0u64);
    let mut seen = Vec::new();
    for (n, round) in rounds.iter().enumerate() {
        for &op in round {
            let mode = match op.origin {
                Origin::Client => Mode::Forward,
                Origin::Injected(m) => m,
                Origin::AnsweredHere => {
                    core.out.answer_here(op.kind);
                    continue;
                }
            };
            let e = Expect::new(op.kind, mode);
            match (op.origin, op.kind) {
                // As the relay does: a Query or FunctionCall is completed by its own
                // ReadyForQuery, a Bind by the one of the Sync still to come.
                (Origin::Client, Kind::Query | Kind::FunctionCall) => {
                    core.send_ready_with(e, |buf| encode(buf, op));
                    let ready = core.last_ready();
                    core.track(class.clone(), 0, now, ready);
                    tracked += 1;
                }
                (Origin::Client, Kind::Sync) => core.send_ready_with(e, |buf| encode(buf, op)),
                (Origin::Client, Kind::Bind) => {
                    let ready = core.last_ready() + 1;
                    core.track(class.clone(), 0, now, ready);
                    tracked += 1;
                    core.out.send_with(e, |buf| encode(buf, op));
                }
                _ => core.out.send_with(e, |buf| encode(buf, op)),
            }
        }
        core.out.t.answer_synthetic(&mut core.cout);
        let owed = !core.out.t.idle();
        let bytes = frames(&postgres(core.out.pending()));
        if owed {
            assert_eq!(
                release::decide(core.quiet(true)),
                release::Decision::Busy,
                "released while replies are owed"
            );
        }
        core.out.clear();
        for read in bytes.chunks(cuts.get(n).copied().unwrap_or(usize::MAX).max(1)) {
            core.replies.buf_mut().extend_from_slice(read);
            loop {
                match core.next_reply() {
                    Ok(Next::Read) => break,
                    Ok(Next::Seen(s)) if s.ready => {
                        core.ready(now, s.rows, |_| completed += 1);
                    }
                    Ok(_) => {}
                    Err(e) => panic!("the simulated server's bytes are well formed: {e}"),
                }
            }
        }
    }
    assert!(
        core.out.t.idle(),
        "the backend owes nothing at the end: {:?}",
        core.out.t
    );
    assert!(
        core.replies.quiet(),
        "every byte of the backend was handled"
    );
    assert_eq!(
        release::decide(core.quiet(true)),
        release::Decision::Release,
        "a transaction-mode backend goes back once everything is answered"
    );
    assert_eq!(
        completed, tracked,
        "every statement completed by a ReadyForQuery"
    );
    // The client's bytes, whole frames: their types in order.
    let mut rest = &core.cout[..];
    while !rest.is_empty() {
        seen.push(rest[0]);
        let len = i32::from_be_bytes(rest[1..5].try_into().unwrap()) as usize;
        rest = &rest[1 + len..];
    }
    seen
}

/// What the client would see talking to Postgres itself.
fn direct(rounds: &[Vec<Op>]) -> Vec<u8> {
    let mut seen = Vec::new();
    for round in rounds {
        let mut buf = BytesMut::new();
        for &op in round {
            if op.origin == Origin::Client || op.origin == Origin::AnsweredHere {
                encode(&mut buf, op);
            }
        }
        seen.extend(postgres(&buf).into_iter().map(|(t, _)| t));
    }
    seen
}

/// Where a scenario's choices come from: one byte each (0 once the input is used up, so
/// every input makes a finite scenario).
struct Choices<'a>(&'a [u8]);

impl Choices<'_> {
    fn next(&mut self) -> u64 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                u64::from(b)
            }
            None => 0,
        }
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

/// One unit of work as the relay writes it: a simple query, or an extended batch to its Sync.
fn unit(r: &mut Choices<'_>, out: &mut Vec<Op>) {
    let client = |kind, fails| Op {
        kind,
        origin: Origin::Client,
        fails,
    };
    let injected = |kind| Op {
        kind,
        origin: Origin::Injected(Mode::Swallow),
        fails: false,
    };
    if r.chance(40) {
        // Simple protocol: maybe a settings replay or timeout SET first, then the query.
        if r.chance(40) {
            out.push(injected(Kind::Query));
        }
        let kind = if r.chance(15) {
            Kind::FunctionCall
        } else {
            Kind::Query
        };
        out.push(client(kind, r.chance(15)));
        if r.chance(15) {
            // The session-settings read-back at the end of a transaction.
            out.push(Op {
                kind: Kind::Query,
                origin: Origin::Injected(Mode::Capture),
                fails: false,
            });
        }
        return;
    }
    // Extended protocol, one or more statements, then Sync.
    for _ in 0..1 + r.next() % 3 {
        if r.chance(50) {
            let origin = if r.chance(40) {
                Origin::AnsweredHere // already prepared on this backend
            } else {
                Origin::Client
            };
            let fails = origin == Origin::Client && r.chance(10);
            out.push(Op {
                kind: Kind::Parse,
                origin,
                fails,
            });
        }
        if r.chance(30) {
            out.push(injected(Kind::Parse)); // re-prepare on this backend
        }
        if r.chance(30) {
            // The timeouts statement: Bind/Execute/Close of a prepared SET LOCAL.
            out.extend([
                injected(Kind::Bind),
                injected(Kind::Execute),
                injected(Kind::Close),
            ]);
        }
        if r.chance(20) {
            out.push(client(Kind::DescribeStmt, false));
        }
        out.push(client(Kind::Bind, r.chance(10)));
        if r.chance(50) {
            out.push(client(Kind::DescribePortal, false));
        }
        out.push(client(Kind::Execute, r.chance(10)));
        if r.chance(20) {
            let origin = if r.chance(50) {
                Origin::AnsweredHere // the statement stays cached for others
            } else {
                Origin::Client
            };
            out.push(Op {
                kind: Kind::Close,
                origin,
                fails: false,
            });
        }
    }
    out.push(client(Kind::Sync, false));
}

/// Rounds of requests, and for each the size of the reads its replies arrive in.
fn scenario(data: &[u8]) -> (Vec<Vec<Op>>, Vec<usize>) {
    let r = &mut Choices(data);
    let mut rounds = Vec::new();
    let mut cuts = Vec::new();
    for _ in 0..1 + r.next() % 4 {
        let mut round = Vec::new();
        for _ in 0..1 + r.next() % 5 {
            unit(r, &mut round);
        }
        rounds.push(round);
        // Whole, or cut anywhere (inside headers too).
        cuts.push(match r.next() % 4 {
            0 => usize::MAX,
            _ => 1 + r.next() as usize % 40,
        });
    }
    (rounds, cuts)
}

/// Runs the scenario `data` describes through the proxy and directly; panics when the client
/// would see anything else through the proxy.
pub fn check(data: &[u8]) {
    let (rounds, cuts) = scenario(data);
    let want = direct(&rounds);
    let got = through_proxy(&rounds, &cuts);
    assert_eq!(
        String::from_utf8_lossy(&got),
        String::from_utf8_lossy(&want),
        "reads of {cuts:?} bytes: {rounds:#?}"
    );
}

/// A seeded stream of choices (xorshift), so a failing test names its seed.
#[cfg(test)]
fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn the_client_sees_what_postgres_would_have_told_it_and_nothing_of_the_proxys_own() {
    for seed in 0..5_000u64 {
        let data = random_bytes(seed, 400);
        if let Err(e) = std::panic::catch_unwind(|| check(&data)) {
            panic!("seed {seed}: {e:?}");
        }
    }
}

#[test]
fn the_oracle_notices_a_reply_that_leaks() {
    // An injected query sent as if it were the client's: its replies reach the client.
    let leak = vec![vec![
        Op {
            kind: Kind::Query,
            origin: Origin::Injected(Mode::Forward),
            fails: false,
        },
        Op {
            kind: Kind::Query,
            origin: Origin::Client,
            fails: false,
        },
    ]];
    assert_ne!(through_proxy(&leak, &[7]), direct(&leak));
}
