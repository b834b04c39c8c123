//! PgBouncer's admin console over the Postgres protocol: `psql -p 6432 pgbouncer -c 'SHOW
//! POOLS'` and the exporters that speak it, answered from the same data and with the same
//! actions as the HTTP API.
//!
//! A client reaches it through the proxy's normal listener and client authentication, by
//! asking for one of `admin.console.databases`; `session::console` then owns the socket and
//! the protocol (simple Query only) and hands each query text here through
//! [`crate::app::Console`]. This module parses it ([`command`]), checks the user's role
//! (`admin.console.admin_users` run everything, `stats_users` only `SHOW`), and answers:
//! PgBouncer's `SHOW` tables in [`show`] and pgsluice's own in [`own`] (encoded by
//! [`table`]), the controls here, each calling what the matching endpoint calls
//! (`control::pause_pools`, `control::disable_database`, `read::run_reload`, …), so the
//! console and the API cannot drift apart.
//!
//! Commands by database (`PAUSE db`, `RESUME db`, `RECONNECT db`, `KILL db`) act on every
//! pool of that database; without a database, `PAUSE`, `RESUME` and `RECONNECT` act on every
//! pool. `SHUTDOWN` is the graceful drain SIGTERM starts.
//!
//! What it must not do: reach PostgreSQL (a query that is not a console command is an
//! error), or let a stats user change anything.

pub mod command;
pub mod own;
pub mod show;
pub mod table;

use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::BytesMut;
use tokio::time::Instant;

use self::command::{Command, Show};
use self::table::{Table, command_complete};
use super::AdminState;
use super::control::{self, DEFAULT_PAUSE_HOLD_MS, DEFAULT_PAUSE_WAIT_MS};
use super::error::ApiError;
use crate::app::ConsoleClient;
use crate::config::ConsoleRole;
use crate::pool::Pool;
use crate::protocol::PgError;

/// The console's answers, over the admin API's state.
pub struct Console {
    /// Weak: the app holds the console, and the admin state holds the app.
    st: Weak<AdminState>,
    /// When the proxy started: `SHOW STATS`' averages are over the time since.
    started: Instant,
}

impl Console {
    pub(super) fn new(st: &Arc<AdminState>) -> Console {
        Console {
            st: Arc::downgrade(st),
            started: Instant::now(),
        }
    }

    async fn run(
        &self,
        who: &ConsoleClient,
        sql: &str,
    ) -> Result<Option<(Table, &'static str)>, PgError> {
        let Some(cmd) = command::parse(sql)? else {
            return Ok(None);
        };
        if who.role == ConsoleRole::Stats && !cmd.reads_only() {
            return Err(PgError::error(
                "42501",
                format!(
                    "pgsluice console: permission denied for {}: user \"{}\" is a stats user \
                     (admin.console.stats_users) and may only run SHOW",
                    cmd.tag(),
                    who.user
                ),
            )
            .with_hint("commands that change anything need a user of admin.console.admin_users"));
        }
        let st = self.st.upgrade().ok_or_else(|| {
            PgError::error("57P01", "pgsluice console: the admin API is shutting down")
        })?;
        let tag = cmd.tag();
        let table = match cmd {
            Command::Show(s) => self.show(&st, s),
            Command::Pause(db) => {
                let pools = pools_of(&st, db.as_deref())?;
                let waited = control::pause_pools(
                    &pools,
                    Duration::from_millis(DEFAULT_PAUSE_HOLD_MS),
                    Duration::from_millis(DEFAULT_PAUSE_WAIT_MS),
                )
                .await;
                let in_use: usize = pools.iter().map(|p| p.in_use()).sum();
                tracing::warn!(database = ?db, user = %who.user, in_use, "pools paused from the admin console");
                if in_use > 0 {
                    return Err(PgError::error(
                        "55006",
                        format!(
                            "pgsluice console: paused, but {in_use} backend connections are \
                             still in use after {} ms",
                            waited.as_millis()
                        ),
                    )
                    .with_detail("the pause stays; new checkouts wait for RESUME")
                    .with_hint("RESUME lifts it; SHOW POOLS shows what is still active"));
                }
                return Ok(Some((Table::default(), tag)));
            }
            Command::Resume(db) => {
                for p in pools_of(&st, db.as_deref())? {
                    p.resume();
                }
                tracing::warn!(database = ?db, user = %who.user, "pools resumed from the admin console");
                return Ok(Some((Table::default(), tag)));
            }
            Command::Reconnect(db) => {
                for p in pools_of(&st, db.as_deref())? {
                    p.reconnect();
                }
                tracing::warn!(database = ?db, user = %who.user, "pools reconnecting from the admin console");
                return Ok(Some((Table::default(), tag)));
            }
            Command::Kill(db) => {
                self.kill(&st, &db, who)?;
                return Ok(Some((Table::default(), tag)));
            }
            Command::Disable(db) => {
                not_console(&st, &db, "DISABLE")?;
                control::disable_database(&st, &db).map_err(api_error)?;
                return Ok(Some((Table::default(), tag)));
            }
            Command::Enable(db) => {
                control::enable_database(&st, &db);
                return Ok(Some((Table::default(), tag)));
            }
            Command::Reload => {
                super::read::run_reload(&st, "admin console")
                    .await
                    .map_err(api_error)?;
                return Ok(Some((Table::default(), tag)));
            }
            Command::Shutdown => {
                tracing::warn!(user = %who.user, "shutting down: asked from the admin console");
                st.app.begin_shutdown();
                return Ok(Some((Table::default(), tag)));
            }
        };
        Ok(Some((table, tag)))
    }

    fn show(&self, st: &AdminState, s: Show) -> Table {
        match s {
            Show::Help => Table::default(),
            Show::Pools => show::pools(st),
            Show::Stats => show::stats(st, self.started),
            Show::StatsTotals => show::stats_totals(st),
            Show::StatsAverages => show::stats_averages(st, self.started),
            Show::Clients => show::clients(st),
            Show::Servers => show::servers(st),
            Show::Databases => show::databases(st),
            Show::Config => show::config(st),
            Show::Lists => show::lists(st),
            Show::Version => show::version_table(),
            Show::Users => show::users(st),
            Show::State => show::state(st),
            Show::Callers => own::callers(st),
            Show::Fingerprints => own::fingerprints(st),
            Show::Rules => own::rules(st),
            Show::Anomalies => own::anomalies(st),
        }
    }

    /// `KILL db`: as PgBouncer, the database's pools are paused (new checkouts wait for
    /// `RESUME`), every client of it is ended (57P01, as `DELETE /v1/clients/{id}` does) and
    /// its backends are replaced (`RECONNECT`).
    fn kill(&self, st: &AdminState, db: &str, who: &ConsoleClient) -> Result<(), PgError> {
        not_console(st, db, "KILL")?;
        let pools = pools_of(st, Some(db))?;
        for p in &pools {
            p.pause(Duration::from_millis(DEFAULT_PAUSE_HOLD_MS));
        }
        let mut ended = 0;
        for e in st.app.cancels.entries() {
            if e.client.meta.as_ref().is_some_and(|m| m.database == db) {
                e.terminate();
                ended += 1;
            }
        }
        for p in &pools {
            p.reconnect();
        }
        tracing::warn!(database = %db, user = %who.user, clients = ended, "database killed from the admin console");
        Ok(())
    }
}

impl crate::app::Console for Console {
    fn answer<'a>(
        &'a self,
        who: &'a ConsoleClient,
        sql: &'a str,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = BytesMut> + Send + 'a>> {
        Box::pin(async move {
            let mut out = BytesMut::new();
            match self.run(who, sql).await {
                Ok(None) => crate::protocol::messages::raw(&mut out, b'I', &[]),
                Ok(Some((table, tag))) => {
                    if table.columns.is_empty() {
                        if tag == "SHOW" {
                            help(&mut out);
                        }
                        command_complete(&mut out, tag);
                    } else {
                        table.encode(&mut out, tag);
                    }
                }
                Err(e) => e.encode(&mut out),
            }
            out
        })
    }
}

/// `SHOW HELP`: a NOTICE listing the commands, as PgBouncer answers it.
fn help(out: &mut BytesMut) {
    let shows: Vec<String> = command::SHOWS
        .iter()
        .map(|(n, _)| n.to_ascii_uppercase())
        .collect();
    PgError::error("00000", "Console usage")
        .with_detail(format!(
            "SHOW [{}]\nPAUSE [<db>]\nRESUME [<db>]\nRECONNECT [<db>]\nKILL <db>\n\
             DISABLE <db>\nENABLE <db>\nRELOAD\nSHUTDOWN",
            shows.join("|")
        ))
        .encode_notice(out);
}

/// The pools of `db`, or every pool; an error naming the database when it has none.
fn pools_of(st: &AdminState, db: Option<&str>) -> Result<Vec<Arc<Pool>>, PgError> {
    let mut pools: Vec<Arc<Pool>> = st
        .app
        .pools
        .all()
        .into_iter()
        .filter(|p| db.is_none_or(|d| p.database == d))
        .collect();
    pools.sort_by(|a, b| a.name.cmp(&b.name));
    match db {
        Some(d) if pools.is_empty() => Err(PgError::error(
            "42704",
            format!(
                "pgsluice console: no pool of database \"{d}\" (a pool exists once a client \
                 of that database logged in; SHOW POOLS lists them)"
            ),
        )),
        _ => Ok(pools),
    }
}

/// Refuses a command aimed at the console's own database (it has no pools and no backend).
fn not_console(st: &AdminState, db: &str, what: &str) -> Result<(), PgError> {
    if st.app.config().admin.console.serves(db) {
        return Err(PgError::error(
            "42809",
            format!(
                "pgsluice console: {what} cannot be used on the admin console database \"{db}\""
            ),
        ));
    }
    Ok(())
}

/// An HTTP API error as the console reports it.
fn api_error(e: ApiError) -> PgError {
    let (code, message) = match e {
        ApiError::Invalid { field, message, .. } => ("22023", format!("{field}: {message}")),
        ApiError::NotFound(m) => ("42704", m),
        ApiError::Conflict(m) => ("55000", m),
        ApiError::Unavailable(m) => ("55000", m),
        ApiError::InvalidConfig(errs) => (
            "F0000",
            format!(
                "the configuration was not reloaded (the running one stays): {}",
                errs.join("; ")
            ),
        ),
        ApiError::Forbidden(m) => ("42501", m),
        ApiError::Internal(m) => ("XX000", m),
        other => ("XX000", format!("{other:?}")),
    };
    PgError::error(code, format!("pgsluice console: {message}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::app::App;
    use crate::config::Config;
    use crate::policy::rules::RuleSet;

    /// A console over an app with no pools yet (its backend is nowhere: nothing connects).
    fn console() -> (Arc<App>, super::super::Admin) {
        let cfg = Config::from_yaml("backend:\n  url: postgres://app:pw@127.0.0.1:1/appdb\n")
            .expect("config");
        let app = App::new(cfg, Arc::new(RuleSet::new())).expect("app");
        let admin = super::super::Admin::new(app.clone(), Default::default());
        (app, admin)
    }

    fn who(role: ConsoleRole) -> ConsoleClient {
        ConsoleClient {
            user: "u".into(),
            database: "pgsluice".into(),
            role,
        }
    }

    /// The messages' type bytes, and the SQLSTATE of an ErrorResponse if there is one.
    fn kinds(out: &[u8]) -> (Vec<u8>, Option<String>) {
        let (mut tags, mut code, mut at) = (Vec::new(), None, 0);
        while at + 5 <= out.len() {
            let len = u32::from_be_bytes([out[at + 1], out[at + 2], out[at + 3], out[at + 4]]);
            let body = &out[at + 5..at + 1 + len as usize];
            if out[at] == b'E' {
                code = crate::protocol::error::sqlstate_of(body).map(str::to_owned);
            }
            tags.push(out[at]);
            at += 1 + len as usize;
        }
        (tags, code)
    }

    #[tokio::test]
    async fn roles_decide_what_runs() {
        let (app, _admin) = console();
        let c = app
            .console
            .get()
            .expect("the admin API set the console")
            .clone();
        let stats = who(ConsoleRole::Stats);
        let (tags, code) = kinds(&c.answer(&stats, "SHOW POOLS;").await);
        assert_eq!(
            (tags, code),
            (b"TC".to_vec(), None),
            "no pools: a header only"
        );
        for cmd in [
            "PAUSE",
            "RESUME x",
            "RECONNECT",
            "KILL x",
            "DISABLE x",
            "ENABLE x",
            "RELOAD",
            "SHUTDOWN",
        ] {
            let (_, code) = kinds(&c.answer(&stats, cmd).await);
            assert_eq!(code.as_deref(), Some("42501"), "{cmd}");
        }
        assert!(!app.life.is_stopping());
        let admin = who(ConsoleRole::Admin);
        let (tags, code) = kinds(&c.answer(&admin, "DISABLE appdb").await);
        assert_eq!((tags, code), (b"C".to_vec(), None));
        assert!(app.disabled.read().contains("appdb"));
        let (_, code) = kinds(&c.answer(&admin, "enable appdb").await);
        assert_eq!(code, None);
        assert!(app.disabled.read().is_empty());
        let (_, code) = kinds(&c.answer(&admin, "PAUSE nosuchdb").await);
        assert_eq!(code.as_deref(), Some("42704"));
        let (_, code) = kinds(&c.answer(&admin, "RELOAD").await);
        assert_eq!(
            code.as_deref(),
            Some("55000"),
            "no configuration source in a test"
        );
        let (tags, _) = kinds(&c.answer(&admin, "").await);
        assert_eq!(tags, b"I", "an empty query");
        let (tags, code) = kinds(&c.answer(&stats, "SHOW HELP").await);
        assert_eq!((tags, code), (b"NC".to_vec(), None));
        let (_, code) = kinds(&c.answer(&admin, "SELECT 1").await);
        assert_eq!(code.as_deref(), Some("42601"));
    }

    #[tokio::test]
    async fn every_show_answers_rows_as_wide_as_its_header() {
        let (app, _admin) = console();
        // A pool (it connects on its first checkout, which never comes), so SHOW POOLS,
        // STATS, DATABASES, USERS have a row; `Table::push` asserts each row's width.
        app.pool_for("appdb", "app").expect("pool");
        let st = app.console.get().expect("console").clone();
        for (name, _) in command::SHOWS {
            let out = st
                .answer(&who(ConsoleRole::Stats), &format!("SHOW {name}"))
                .await;
            let (tags, code) = kinds(&out);
            assert_eq!(code, None, "SHOW {name}");
            assert_eq!(tags.last(), Some(&b'C'), "SHOW {name}");
            let rows = tags.iter().filter(|t| **t == b'D').count();
            if [
                "pools",
                "stats",
                "stats_totals",
                "databases",
                "users",
                "lists",
                "version",
            ]
            .contains(&name)
            {
                assert!(rows >= 1, "SHOW {name}: {tags:?}");
            }
        }
    }
}
