//! Shared state of a running proxy: the config snapshot, credentials, pools, cancel keys and
//! counters. Sessions and the admin API read it; reload swaps the snapshot atomically.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio_util::sync::CancellationToken;

use crate::auth::Credentials;
use crate::cancel;
use crate::config::Config;
use crate::pool::{ConnectParams, Pool, Pools};
use crate::protocol::PgError;

pub struct App {
    pub config: ArcSwap<Config>,
    pub creds: ArcSwap<Credentials>,
    pub pools: Pools,
    pub cancels: Arc<cancel::Registry>,
    pub stats: AppStats,
    /// Fired on shutdown: stop accepting, finish in-flight work.
    pub shutdown: CancellationToken,
}

#[derive(Default)]
pub struct AppStats {
    pub clients: AtomicUsize,
    pub clients_total: AtomicU64,
    pub handshakes: AtomicUsize,
    pub client_errors: AtomicU64,
}

impl App {
    pub fn new(config: Config) -> Arc<App> {
        let creds = Credentials::from_config(&config);
        Arc::new(App {
            config: ArcSwap::from_pointee(config),
            creds: ArcSwap::from_pointee(creds),
            pools: Pools::default(),
            cancels: Arc::new(cancel::Registry::default()),
            stats: AppStats::default(),
            shutdown: CancellationToken::new(),
        })
    }

    /// The pool for a logged-in (database, user), created on first use.
    pub fn pool_for(&self, database: &str, user: &str) -> Result<Arc<Pool>, PgError> {
        let cfg = self.config.load();
        let creds = self.creds.load();
        let password = creds.user(user).and_then(|u| u.backend_password.clone());
        let (host, port) = match cfg.backend_url() {
            Some(u) => (u.host, u.port),
            None => (cfg.backend.host.clone(), cfg.backend.port),
        };
        Ok(self.pools.get_or_create(database, user, || {
            Pool::new(
                database,
                user,
                cfg.pool_for(database, user),
                ConnectParams {
                    host,
                    port,
                    user: user.to_string(),
                    password,
                    database: database.to_string(),
                    connect_timeout: Duration::from_millis(cfg.backend.connect_timeout_ms),
                },
            )
        }))
    }

    /// Periodic pool upkeep (idle timeout, min idle) until shutdown.
    pub async fn maintain(self: Arc<Self>) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = self.shutdown.cancelled() => return,
            }
            for p in self.pools.all() {
                p.maintain().await;
            }
        }
    }
}
