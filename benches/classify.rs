//! Hot-path benchmarks for `classify` (and the per-fingerprint stats it feeds): statement
//! classification cached and uncached, for a typical OLTP query and a ~2 KB query, and caller
//! extraction (comment tags + resolution against 50 rules). Not timed assertions; compare
//! runs against a baseline.

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use pgsluice::classify::{
    CallerMatcher, CallerRule, Classifier, DEFAULT_MAX_TEXT_BYTES, analyze, extract_tags,
};
use pgsluice::observe::stats::{FingerprintStats, Outcome};

const OLTP: &str = "SELECT * FROM users WHERE id = 1204 AND status = 'active'";

fn big_query() -> String {
    let ids: Vec<String> = (0..120).map(|i| (1000 + i * 7).to_string()).collect();
    let names: Vec<String> = (0..40).map(|i| format!("'name_{i}'")).collect();
    let sql = format!(
        "/*application='checkout',route='%2Fapi%2Fv1%2Forders',traceparent='00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'*/ \
         SELECT o.id, o.created_at, o.total, c.name, c.email, a.street, a.city, a.country, \
         sum(li.quantity * li.price) AS subtotal, count(DISTINCT li.sku) AS skus \
         FROM orders o JOIN customers c ON c.id = o.customer_id \
         LEFT JOIN addresses a ON a.id = o.shipping_address_id \
         JOIN line_items li ON li.order_id = o.id \
         WHERE o.id IN ({}) AND c.name IN ({}) AND o.status <> 'cancelled' \
         AND o.created_at >= now() - interval '30 days' AND (o.flags & 4) = 0 \
         AND o.metadata->>'channel' = 'web' \
         GROUP BY o.id, o.created_at, o.total, c.name, c.email, a.street, a.city, a.country \
         HAVING sum(li.quantity * li.price) > 100.50 \
         ORDER BY o.created_at DESC, o.id LIMIT 50 OFFSET 0",
        ids.join(", "),
        names.join(", ")
    );
    sql
}

fn classify(c: &mut Criterion) {
    let big = big_query();
    let mut g = c.benchmark_group("classify");
    g.bench_function("uncached_oltp", |b| {
        b.iter(|| analyze(black_box(OLTP), DEFAULT_MAX_TEXT_BYTES))
    });
    g.bench_function(format!("uncached_{}B", big.len()), |b| {
        b.iter(|| analyze(black_box(&big), DEFAULT_MAX_TEXT_BYTES))
    });
    // A cap just under the length sends the whole text through the byte scanner (the
    // oversized path), for comparison with the tokenizer path.
    g.bench_function("scanner_path_oltp", |b| {
        b.iter(|| analyze(black_box(OLTP), OLTP.len() - 1))
    });
    g.bench_function(format!("scanner_path_{}B", big.len()), |b| {
        b.iter(|| analyze(black_box(&big), big.len() - 1))
    });
    let cl = Classifier::new(10_000, DEFAULT_MAX_TEXT_BYTES);
    cl.classify(OLTP);
    cl.classify(&big);
    g.bench_function("cached_oltp", |b| b.iter(|| cl.classify(black_box(OLTP))));
    g.bench_function(format!("cached_{}B", big.len()), |b| {
        b.iter(|| cl.classify(black_box(&big)))
    });
    // The simple protocol's case: a new literal on every call (pgbench -S), answered from
    // the shape cache.
    let texts: Vec<String> = (0..4096)
        .map(|i| {
            format!(
                "SELECT abalance FROM pgbench_accounts WHERE aid = {};",
                i * 7919 % 100_000
            )
        })
        .collect();
    let mut i = 0;
    g.bench_function("shape_hit_new_literal_oltp", |b| {
        b.iter(|| {
            i = (i + 1) % texts.len();
            cl.classify(black_box(&texts[i]))
        })
    });
    g.finish();
}

fn callers(c: &mut Criterion) {
    let rules: Vec<CallerRule> = (0..50)
        .map(|i| CallerRule {
            name: format!("caller_{i}"),
            tags: if i % 2 == 0 {
                vec![("application".to_owned(), format!("app_{i}"))]
            } else {
                Vec::new()
            },
            application_name: (i % 3 == 0).then(|| format!("pgapp_{i}")),
            user: (i % 5 == 0).then(|| format!("user_{i}")),
            client_cidr: None,
        })
        .collect();
    let m = CallerMatcher::new(rules);
    let sql = "/*application='app_48',route='%2Fcheckout'*/ SELECT * FROM users WHERE id = $1";
    let addr = Some(IpAddr::V4(Ipv4Addr::new(10, 1, 2, 3)));
    let mut g = c.benchmark_group("caller");
    g.bench_function("extract_tags_and_resolve_50_rules", |b| {
        b.iter(|| {
            let tags = extract_tags(black_box(sql));
            m.resolve(&tags, Some("psql"), "nobody", addr)
        })
    });
    let tags = extract_tags(sql);
    g.bench_function("resolve_50_rules_tag_match", |b| {
        b.iter(|| m.resolve(black_box(&tags), Some("psql"), "nobody", addr))
    });
    g.bench_function("resolve_50_rules_default", |b| {
        b.iter(|| m.resolve(black_box(&[]), Some("other"), "nobody", addr))
    });
    g.finish();
}

fn stats(c: &mut Criterion) {
    let st = FingerprintStats::new(1000);
    let text: Arc<str> = Arc::from("SELECT * FROM users WHERE id = ?");
    let mut g = c.benchmark_group("stats");
    g.bench_function("record_existing", |b| {
        b.iter(|| {
            st.record(
                black_box(42),
                &text,
                "read",
                &"billing".into(),
                Duration::from_micros(350),
                Outcome::Ok { rows: 1 },
            )
        })
    });
    let mut i = 0u64;
    g.bench_function("record_new_fingerprint_full_table", |b| {
        b.iter(|| {
            i = i.wrapping_add(0x9E37_79B9_7F4A_7C15);
            st.record(
                black_box(i),
                &text,
                "read",
                &"billing".into(),
                Duration::from_micros(350),
                Outcome::Ok { rows: 1 },
            )
        })
    });
    g.finish();
}

criterion_group!(benches, classify, callers, stats);
criterion_main!(benches);
