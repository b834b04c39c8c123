//! Hot-path benchmarks for header-only framing (`protocol::framing`): walking a backend reply
//! of many DataRows, and a pipelined Parse/Bind/Describe/Execute/Sync client stream, with
//! [`header`] and [`complete`]; plus "frame and copy into one write buffer", which is what
//! forwarding a batch costs before the syscall. The relay's tracker is private, so only the
//! public pieces are measured here. Not timed assertions; compare runs against a baseline.

use std::hint::black_box;

use bytes::BytesMut;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use pgsluice::protocol::framing::{Direction, complete, header};
use pgsluice::protocol::messages::raw;

/// Rows in the backend reply (a `SELECT` of 1 000 narrow rows).
const ROWS: usize = 1_000;
/// Pipelined statements in the client stream.
const PIPELINE: usize = 100;

/// RowDescription, `ROWS` DataRows of three columns, CommandComplete, ReadyForQuery.
fn backend_reply() -> BytesMut {
    let mut out = BytesMut::new();
    raw(&mut out, b'T', &[&[0, 3], &[0u8; 3 * 19]]);
    for i in 0..ROWS {
        let id = i.to_string();
        let name = format!("customer-{i:06}");
        let mut body = Vec::with_capacity(64);
        body.extend_from_slice(&3i16.to_be_bytes());
        for col in [id.as_bytes(), name.as_bytes(), b"2026-11-29 12:00:00+00"] {
            body.extend_from_slice(&(col.len() as i32).to_be_bytes());
            body.extend_from_slice(col);
        }
        raw(&mut out, b'D', &[&body]);
    }
    raw(&mut out, b'C', &[b"SELECT 1000\0"]);
    raw(&mut out, b'Z', &[b"I"]);
    out
}

/// `PIPELINE` × (Parse, Bind, Describe portal, Execute, Sync), unnamed statement and portal.
fn frontend_pipeline() -> BytesMut {
    let mut out = BytesMut::new();
    let sql = b"SELECT abalance FROM pgbench_accounts WHERE aid = $1\0";
    for i in 0..PIPELINE {
        let param = (i as i32 * 7919).to_string();
        raw(&mut out, b'P', &[b"\0", sql, &0i16.to_be_bytes()]);
        raw(
            &mut out,
            b'B',
            &[
                b"\0\0",
                &0i16.to_be_bytes(),
                &1i16.to_be_bytes(),
                &(param.len() as i32).to_be_bytes(),
                param.as_bytes(),
                &0i16.to_be_bytes(),
            ],
        );
        raw(&mut out, b'D', &[b"P\0"]);
        raw(&mut out, b'E', &[b"\0", &0i32.to_be_bytes()]);
        raw(&mut out, b'S', &[]);
    }
    out
}

/// Walks every message with `complete`; returns the count so nothing is optimised away.
fn walk_complete(buf: &[u8], dir: Direction) -> usize {
    let (mut at, mut n) = (0, 0);
    while let Ok(Some(h)) = complete(&buf[at..], dir) {
        at += h.total;
        n += 1;
    }
    n
}

/// Walks every message with `header` only (the caller knows the body is there).
fn walk_header(buf: &[u8], dir: Direction) -> usize {
    let (mut at, mut n) = (0, 0);
    while let Ok(Some(h)) = header(&buf[at..], dir) {
        at += h.total;
        n += 1;
    }
    n
}

/// Frames each message and copies it into one output buffer, as a relay batching its
/// writes does; the buffer is reused like a session's write buffer.
fn frame_and_copy(buf: &[u8], dir: Direction, out: &mut BytesMut) -> usize {
    out.clear();
    let mut at = 0;
    while let Ok(Some(h)) = complete(&buf[at..], dir) {
        out.extend_from_slice(&buf[at..at + h.total]);
        at += h.total;
    }
    out.len()
}

fn framing(c: &mut Criterion) {
    let reply = backend_reply();
    let pipeline = frontend_pipeline();
    assert_eq!(walk_complete(&reply, Direction::Backend), ROWS + 3);
    assert_eq!(walk_complete(&pipeline, Direction::Frontend), PIPELINE * 5);

    let mut g = c.benchmark_group("framing_backend_datarows");
    g.throughput(Throughput::Bytes(reply.len() as u64));
    g.bench_function(format!("complete_{}_msgs", ROWS + 3), |b| {
        b.iter(|| walk_complete(black_box(&reply), Direction::Backend))
    });
    g.bench_function(format!("header_{}_msgs", ROWS + 3), |b| {
        b.iter(|| walk_header(black_box(&reply), Direction::Backend))
    });
    let mut out = BytesMut::with_capacity(reply.len());
    g.bench_function("frame_and_copy_per_message", |b| {
        b.iter(|| frame_and_copy(black_box(&reply), Direction::Backend, &mut out))
    });
    g.finish();

    let mut g = c.benchmark_group("framing_frontend_pipeline");
    g.throughput(Throughput::Bytes(pipeline.len() as u64));
    g.bench_function(format!("complete_{}x_PBDES", PIPELINE), |b| {
        b.iter(|| walk_complete(black_box(&pipeline), Direction::Frontend))
    });
    g.bench_function(format!("header_{}x_PBDES", PIPELINE), |b| {
        b.iter(|| walk_header(black_box(&pipeline), Direction::Frontend))
    });
    let mut out = BytesMut::with_capacity(pipeline.len());
    g.bench_function("frame_and_copy_per_message", |b| {
        b.iter(|| frame_and_copy(black_box(&pipeline), Direction::Frontend, &mut out))
    });
    g.finish();

    // One message: the fixed cost per header, and a rejected hostile claim.
    let mut g = c.benchmark_group("framing_single");
    let sync = [b'S', 0, 0, 0, 4];
    g.bench_function("header_sync", |b| {
        b.iter(|| header(black_box(&sync), Direction::Frontend))
    });
    let huge = [b'S', 0x7f, 0xff, 0xff, 0xff];
    g.bench_function("header_reject_huge_claim", |b| {
        b.iter(|| header(black_box(&huge), Direction::Frontend).is_err())
    });
    g.finish();
}

criterion_group!(benches, framing);
criterion_main!(benches);
