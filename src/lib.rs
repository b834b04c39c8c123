//! pgsluice: a PostgreSQL wire-protocol proxy that pools backend connections and decides, per
//! caller and per query pattern, what may reach the database.
//!
//! Modules in the order a query meets them:
//!
//! ```text
//! server    accept loop (TCP and the Unix socket), client slots, graceful stop
//! addr      client and server addresses: TCP, or a Unix-domain socket
//! per_address  each source address's share of handshakes and cancels in flight
//! session   handshake (SSL/GSS answer, startup, auth) → relay loop (framing, statement
//!           renaming, replies matched to requests) → release at ReadyForQuery('I')
//! protocol  header-only framing, message bodies, SQLSTATE errors
//! pool      per-(database, user) pools, priority checkout, backend connect/auth/reset
//! notify    transaction mode's LISTEN without a backend: channel registry, one listener
//!           connection per pool, per-client bounded mailboxes
//! cancel    proxy-issued cancel keys → the backend currently running the client's query
//! auth      SCRAM/md5 secrets for both sides, SCRAM channel binding toward clients
//! tls       rustls acceptor (clients) and connector (Postgres), reloadable; TLS streams
//! config    YAML config, validation with field and line
//! observe   per-fingerprint statistics, the anomaly detector over them, Prometheus metrics
//! admin     HTTP API on its own port (rules, stats, anomalies and automatic rules,
//!           /metrics); cli: its terminal client
//! fleet     optional: instances as one through Redis (membership, rules, leased rates)
//! systemd   READY/RELOADING/STOPPING notifications for a `Type=notify` unit
//! ```

pub mod addr;
pub mod admin;
pub mod app;
pub mod auth;
pub mod cancel;
pub mod check;
pub mod classify;
pub mod cli;
pub mod clients;
pub mod coalesce;
pub mod config;
pub mod door;
pub mod fleet;
pub mod lifecycle;
pub mod notify;
pub mod observe;
pub mod per_address;
pub mod policy;
pub mod pool;
pub mod probe;
pub mod protocol;
pub mod rehome;
pub mod runtime;
pub mod server;
pub mod services;
pub mod session;
pub mod systemd;
pub mod tls;
