//! The differential isolation oracle: random client sessions — sequences of whole client
//! messages (simple and extended protocol, FunctionCall, transaction control, session-state
//! changes in many spellings: quoted, qualified, aliased, concatenated, escaped, multi-line,
//! inside CTEs and multi-statement strings, through DO, PREPARE/EXECUTE, user functions,
//! views, column defaults, triggers and attribute notation, catalog views that write settings;
//! truncated frames, hang-ups at any point) — go through a pool of one backend, from clients
//! some of which log in with settings of their own (a role, a search_path, timeouts). After
//! each session a fresh client, necessarily on that backend, must see what a fresh backend
//! reports of itself, asked directly of Postgres at the start.
//!
//! Reproducible: each seed is printed, and `PGSLUICE_SEQUENCE_SEED=<n>` replays one run.
//! The seeds of [`FIXED_SEEDS`] run every time; `PGSLUICE_SEQUENCE_SESSIONS=<n>` runs more
//! sessions per seed (the suite's default is bounded; `scripts/isolation-soak` runs long).
//! A seed that ever finds a difference joins [`FIXED_SEEDS`].

use std::time::Duration;

use crate::support::isolation::{CLEAN, STATE_SQL, fresh_state, user_code};
use crate::support::pg::{APP_DB, APP_PASSWORD, APP_USER, OTHER_ROLE};
use crate::support::proxy::Proxy;
use crate::support::sql::scalar;
use crate::support::wire::{WireClient, function_call};
use crate::support::{note_skipped, random_u64, within};

/// xorshift64*: small, deterministic, good enough to pick from lists.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[self.below(xs.len())]
    }
}

/// Statements that touch the session, in the spellings a lexical scan could miss.
fn statements() -> Vec<String> {
    let mut v: Vec<String> = [
        "SET search_path = evil",
        "SET app.tenant_id = 42",
        "SET statement_timeout = '1s'",
        "SET lock_timeout = 77",
        "SET standard_conforming_strings = off",
        "SELECT set_config('search_path', 'evil', false)",
        "SELECT \"set_config\"('app.tenant_id', '9', false)",
        "SELECT pg_catalog.set_config('search_path', 'evil', true AND false)",
        "SELECT set_config('lock_timeout', '5s', (SELECT false))",
        "SELECT pg_advisory_lock(11)",
        "SELECT \"pg_advisory_lock\"(12)",
        "SELECT pg_try_advisory_lock_shared(13)",
        "LISTEN chan",
        "DO $$BEGIN PERFORM set_config('app.tenant_id', '5', false); END$$",
        "DO $$BEGIN PERFORM pg_advisory_lock(14); END$$",
        "SELECT leak()",
        "RESET ALL",
        "DISCARD ALL",
        "SELECT 1",
        "SELECT pg_sleep(0.01)",
        "BEGIN",
        "COMMIT",
        "ROLLBACK",
        "SELECT 1/0",
        "SELEC broken",
        "RESET ROLE",
        "SET LOCAL search_path = evil",
        "CREATE TEMP TABLE IF NOT EXISTS tmp_leak (a int)",
        "DECLARE held CURSOR WITH HOLD FOR SELECT 1",
        "PREPARE sqlp AS SELECT 1",
        // What a token scan was talked around by (issue 56); `dirty` and its ways in come
        // from `user_code`.
        r#"SELECT * FROM "public"."dirty"('a') AS t"#,
        r#"SELECT * FROM "public"."rec"('a') AS t(x text)"#,
        r#"WITH x AS (SELECT 1) SELECT "public"."dirty"('b') AS x"#,
        "SELECT x.y FROM (SELECT public . \"dirty\" ( 'a' ) AS y) x",
        "SELECT set_config('app.' || 'tenant_id', 'a', false)",
        "SELECT set_config('app.'\n'tenant_id', 'a', false)",
        "SELECT set_config(E'app.\\x74enant_id', 'a', false)",
        "SELECT set_config('search_path', 'evil', true)",
        "UPDATE pg_settings SET setting = 'evil' WHERE name = 'search_path'",
        "UPDATE pg_settings SET setting = 'on' WHERE name = 'default_transaction_read_only'",
        "UPDATE pg_catalog.pg_settings SET setting = '1h' WHERE name = 'lock_timeout'",
        "SELECT * FROM v_tenant",
        "SELECT t.dirt FROM things t",
        "SELECT (t).dirt FROM things t",
        "INSERT INTO withdefault (id) VALUES (1)",
        "INSERT INTO trig VALUES (1)",
        "BEGIN; INSERT INTO trig VALUES (2); COMMIT",
        "PREPARE dirtyp AS SELECT public.dirty('a')",
        "EXECUTE dirtyp",
        "DO $$BEGIN PERFORM public.dirty('b'); END$$",
        "SELECT setseed(0.5)",
        "SET seed = 0.25",
        "SELECT count(*) FROM accounts",
        "SET LOCAL app.tenant_id = 'a'",
    ]
    .iter()
    .map(|s| (*s).to_string())
    .collect();
    v.push(format!("SET ROLE {OTHER_ROLE}"));
    v.push(format!("SET SESSION ROLE {OTHER_ROLE}"));
    v.push(format!("SET LOCAL ROLE {OTHER_ROLE}"));
    v
}

/// One random session; returns what it sent, for the failure message.
async fn session(proxy: &Proxy, rng: &mut Rng, stmts: &[String], set_config_oid: u32) -> String {
    // Most log in plain; some bring settings the proxy re-applies on every backend.
    let role = format!("-c role={OTHER_ROLE}");
    let startup: Vec<(&str, &str)> = match rng.below(8) {
        0 => vec![("options", role.as_str())],
        1 => vec![("search_path", "evil"), ("application_name", "seq")],
        2 => vec![("options", "-c statement_timeout=3s -c lock_timeout=4s")],
        _ => vec![],
    };
    let mut log = format!("login {startup:?}: ");
    let Ok(mut c) =
        WireClient::connect_with(proxy.addr(), APP_USER, APP_PASSWORD, APP_DB, &startup).await
    else {
        return log + "login failed";
    };
    let steps = 1 + rng.below(8);
    for _ in 0..steps {
        let sql = stmts[rng.below(stmts.len())].clone();
        match rng.below(7) {
            0 | 1 => {
                c.query(&sql);
                log.push_str(&format!("Q {sql:?}; "));
            }
            2 => {
                let two = stmts[rng.below(stmts.len())].clone();
                c.query(&format!("{sql}; {two}"));
                log.push_str(&format!("Q {sql:?}+{two:?}; "));
            }
            3 => {
                let name = rng.pick(&["", "s1", "s2"]);
                c.parse(name, &sql).bind("", name, &[]).execute("", 0);
                if rng.below(3) > 0 {
                    c.sync();
                }
                log.push_str(&format!("PBE({name}) {sql:?}; "));
            }
            4 => {
                c.message(
                    b'F',
                    &function_call(set_config_oid, &["search_path", "evil", "false"]),
                );
                log.push_str("F set_config; ");
            }
            5 => {
                // A Bind of a name nobody prepared here, or one prepared with SQL.
                c.query("PREPARE p AS SELECT set_config('app.tenant_id', '3', false)");
                c.bind("", rng.pick(&["p", "nope"]), &[])
                    .execute("", 0)
                    .sync();
                log.push_str("PREPARE+Bind; ");
            }
            _ => {
                c.sync();
                log.push_str("S; ");
            }
        }
        let _ = c.send().await;
        match rng.below(4) {
            // Read what came back (the server had time to act).
            0 | 1 => {
                let _ = tokio::time::timeout(Duration::from_millis(300), c.until_ready()).await;
            }
            2 => tokio::time::sleep(Duration::from_millis(rng.below(20) as u64)).await,
            _ => {}
        }
    }
    match rng.below(4) {
        0 => {
            c.terminate();
            let _ = c.send().await;
            log.push('X');
        }
        1 => {
            // Half a message, then gone.
            c.message(b'Q', b"SELECT 1\0");
            log.push_str("truncated Q");
            let _ = c.send_partial(3).await;
        }
        _ => log.push_str("hang-up"),
    }
    drop(c);
    log
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_sessions_never_leave_state_for_the_next_client() {
    // One backend, and a session that hangs up mid-statement leaves it to a cleanup (cancel,
    // drain, roll back, DISCARD ALL) that can outlast the default 2 s wait on a busy box.
    let yaml =
        "pool: { checkout_timeout_ms: 15000 }\nglobal_defaults: { queue_timeout_ms: 15000 }\n";
    let env = super::common::start(1, yaml, |cluster| {
        cluster.psql_on(
            APP_DB,
            &format!(
                "CREATE FUNCTION public.leak() RETURNS int LANGUAGE plpgsql AS $$ BEGIN \
                 PERFORM set_config('search_path', 'evil', false); PERFORM pg_advisory_lock(99); \
                 RETURN 1; END $$; GRANT EXECUTE ON FUNCTION public.leak() TO {APP_USER};"
            ),
        );
        user_code(cluster);
    });
    let proxy = &env.proxy;
    if proxy.is_direct() {
        note_skipped("backend sharing (direct mode has none)");
        return;
    }
    // A fresh backend's own report, asked of Postgres directly (not through the proxy).
    let direct = tokio_postgres::connect(
        &env.cluster.connect_str(APP_USER, APP_PASSWORD, APP_DB),
        tokio_postgres::NoTls,
    )
    .await
    .expect("a direct connection");
    tokio::spawn(direct.1);
    let fresh = scalar(&direct.0, STATE_SQL).await;
    assert_eq!(fresh, CLEAN, "a fresh backend's state");
    let oid: u32 = scalar(
        &proxy.client().await,
        "SELECT 'pg_catalog.set_config(text,text,boolean)'::regprocedure::oid",
    )
    .await
    .parse()
    .expect("oid");
    let stmts = statements();
    let sessions: usize = std::env::var("PGSLUICE_SEQUENCE_SESSIONS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(120);
    let seeds: Vec<(u64, usize)> = match std::env::var("PGSLUICE_SEQUENCE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        Some(seed) => vec![(seed, sessions)],
        None => FIXED_SEEDS
            .iter()
            .map(|s| (*s, FIXED_SESSIONS))
            .chain([(random_u64(), sessions)])
            .collect(),
    };
    for (seed, n) in seeds {
        let seed = seed | 1;
        eprintln!("random session seed: {seed} (PGSLUICE_SEQUENCE_SEED={seed} replays it)");
        let mut rng = Rng(seed);
        for i in 0..n {
            let sent = session(proxy, &mut rng, &stmts, oid).await;
            let state = within(
                Duration::from_secs(30),
                "the next client",
                fresh_state(proxy),
            )
            .await;
            assert_eq!(
                state, fresh,
                "session {i} (seed {seed}) left its state for the next client: {sent}"
            );
        }
    }
    proxy.assert_healthy().await;
}

/// Seeds that run every time, each for [`FIXED_SESSIONS`] sessions (a seed that ever found a
/// difference is added here):
/// - 1592590423: session 27, a client pinned (SQL PREPARE, LISTEN) after an unproven unit
///   whose check had put its settings back; the pinned client's reset then forgot that the
///   check had re-applied them (role and search_path reached the next client).
const FIXED_SEEDS: &[u64] = &[1_592_590_423, 56];
const FIXED_SESSIONS: usize = 40;
