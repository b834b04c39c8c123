//! The process's background services, started from one list.
//!
//! What runs beside the client sessions for the life of the process — pool upkeep, the
//! breaker's probe, the fleet sync, the peer cancel listener, the admin API's rule purge and
//! anomaly detector, the signal handler — is a [`Service`]: `main` gathers them
//! ([`of_app`], `admin::Admin::services`, its own) into one list and [`start`]s it, so what
//! runs and what the exit waits for is read in one place. Each service ends on its own when
//! `App::life` stops (the signal handler, which is what stops it, excepted). The one thing
//! started elsewhere: a replica pool's health probe, made with the pool at the first read
//! routed to it (`App::replica_pool`), and ending with it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use crate::app::App;

type Task = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

enum Run {
    /// A task on the proxy's runtime.
    Task(Task),
    /// A thread of its own (its own runtime, not to wait behind the sessions).
    Thread(Box<dyn FnOnce() -> std::io::Result<()> + Send>),
}

pub struct Service {
    name: &'static str,
    run: Run,
    /// The exit waits this long for the service to end (it has last words, e.g. the fleet
    /// leaving the member set); others are dropped with the runtime. Tasks only.
    awaited: Option<Duration>,
}

impl Service {
    pub fn task(name: &'static str, f: impl Future<Output = ()> + Send + 'static) -> Service {
        Service {
            name,
            run: Run::Task(Box::pin(f)),
            awaited: None,
        }
    }

    /// A service that starts a thread of its own (`start` returns once it runs).
    pub fn thread(
        name: &'static str,
        start: impl FnOnce() -> std::io::Result<()> + Send + 'static,
    ) -> Service {
        Service {
            name,
            run: Run::Thread(Box::new(start)),
            awaited: None,
        }
    }

    /// The exit waits up to `limit` for this service to end.
    pub fn awaited(mut self, limit: Duration) -> Service {
        self.awaited = Some(limit);
        self
    }
}

/// The services every proxy process runs, whatever its listeners: pool upkeep (idle
/// timeouts, `min_idle`), the breaker's probe, and the fleet sync (idle without a fleet).
pub fn of_app(app: &Arc<App>) -> Vec<Service> {
    let upkeep = Service::task("pool upkeep", Arc::clone(app).maintain());
    let probe = {
        let app = Arc::clone(app);
        Service::thread("breaker probe", move || crate::probe::spawn(app))
    };
    let fleet = {
        let app = Arc::clone(app);
        Service::task("fleet sync", async move {
            if let Some(f) = app.fleet.clone() {
                let peer_id = app.config().peer_id;
                crate::fleet::run(f, &app.policy, peer_id, app.life.stop_token()).await;
            }
        })
        // It leaves the member set on the way out (one Redis call, bounded).
        .awaited(Duration::from_secs(2))
    };
    vec![upkeep, probe, fleet]
}

/// The services of one list, running.
pub struct Running {
    names: Vec<&'static str>,
    awaited: Vec<(&'static str, Duration, JoinHandle<()>)>,
}

/// Starts every service of `list` (inside a tokio runtime). A thread that cannot be started
/// is an error: the process should not run without, say, its breaker probe.
pub fn start(list: Vec<Service>) -> std::io::Result<Running> {
    let mut running = Running {
        names: Vec::with_capacity(list.len()),
        awaited: Vec::new(),
    };
    for s in list {
        let handle = match s.run {
            Run::Task(f) => Some(tokio::spawn(f)),
            Run::Thread(start) => {
                start()?;
                None
            }
        };
        tracing::debug!(service = s.name, "started");
        running.names.push(s.name);
        if let (Some(limit), Some(handle)) = (s.awaited, handle) {
            running.awaited.push((s.name, limit, handle));
        }
    }
    Ok(running)
}

impl Running {
    /// What runs, in the order it started.
    pub fn names(&self) -> &[&'static str] {
        &self.names
    }

    /// After the stop signal: waits for the services with last words, each within its limit.
    pub async fn finish(self) {
        for (name, limit, handle) in self.awaited {
            if tokio::time::timeout(limit, handle).await.is_err() {
                tracing::warn!(service = name, "did not end in time at exit");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn every_service_of_the_list_runs_and_the_exit_waits_only_for_the_awaited() {
        let ran = Arc::new(AtomicUsize::new(0));
        let stop = tokio_util::sync::CancellationToken::new();
        let (r1, r2, r3) = (Arc::clone(&ran), Arc::clone(&ran), Arc::clone(&ran));
        let s2 = stop.clone();
        let list = vec![
            Service::task("forever", async move {
                r1.fetch_add(1, Ordering::SeqCst);
                std::future::pending::<()>().await;
            }),
            Service::thread("own thread", move || {
                std::thread::spawn(move || {
                    r2.fetch_add(1, Ordering::SeqCst);
                });
                Ok(())
            }),
            Service::task("last words", async move {
                s2.cancelled().await;
                tokio::time::sleep(Duration::from_millis(50)).await;
                r3.fetch_add(10, Ordering::SeqCst);
            })
            .awaited(Duration::from_secs(5)),
        ];
        let running = start(list).unwrap();
        assert_eq!(running.names(), ["forever", "own thread", "last words"]);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(ran.load(Ordering::SeqCst), 2);
        stop.cancel();
        // Returns although "forever" never ends, and only after "last words" did.
        tokio::time::timeout(Duration::from_secs(2), running.finish())
            .await
            .expect("finish waits only for the awaited services");
        assert_eq!(ran.load(Ordering::SeqCst), 12);
    }

    #[tokio::test]
    async fn a_thread_that_cannot_start_fails_the_start() {
        let list = vec![Service::thread("broken", || {
            Err(std::io::Error::other("no threads left"))
        })];
        assert!(start(list).is_err());
    }
}
