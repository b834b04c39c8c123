//! `pgsluice` command line: run the proxy, check a config file, fingerprint a statement
//! offline, print shell completions, or talk to a running proxy's admin API (`rules`, `top`,
//! `pools`, `callers`, `breaker`, `reload`).
//!
//! The proxy's flags may also come from `PGSLUICE_*` environment variables (clap's `env`),
//! which is how containers and units configure it: a flag wins over its variable, and both
//! win over the file. Under systemd (`Type=notify`) it reports READY, RELOADING and STOPPING.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Weak};

use clap::{Parser, Subcommand};
use tokio::signal::unix::{SignalKind, signal};

use pgsluice::app::App;
use pgsluice::cli::AdminCmd;
use pgsluice::config::{Config, ConfigError, LogFormat, Overrides, PoolMode, Secret};
use pgsluice::policy::rules::RuleSet;
use pgsluice::services::Service;

#[derive(Parser, Debug)]
#[command(name = "pgsluice", version, about = "PostgreSQL traffic-control proxy")]
#[command(args_conflicts_with_subcommands = true)]
struct Cli {
    /// YAML configuration file (every section optional).
    #[arg(long, short = 'c', env = "PGSLUICE_CONFIG")]
    config: Option<PathBuf>,
    /// Address clients connect to [default: 127.0.0.1:6432].
    #[arg(long, env = "PGSLUICE_LISTEN")]
    listen: Option<SocketAddr>,
    /// Also listen on the Unix-domain socket DIR/.s.PGSQL.PORT (PORT: --listen's port).
    #[arg(long, value_name = "DIR", env = "PGSLUICE_UNIX_SOCKET_DIR")]
    unix_socket_dir: Option<PathBuf>,
    /// postgres://USER[:PASSWORD]@HOST:PORT/DB — that user may log in with that password.
    #[arg(long, env = "PGSLUICE_BACKEND_URL", hide_env_values = true)]
    backend: Option<String>,
    /// File holding the backend user's password (one trailing newline ignored), in place of
    /// the URL's; keeps it off the command line. PGSLUICE_BACKEND_PASSWORD (the password
    /// itself) and backend.password_file do the same, with lower precedence. Re-read on reload.
    #[arg(long, value_name = "PATH", env = "PGSLUICE_BACKEND_PASSWORD_FILE")]
    backend_password_file: Option<PathBuf>,
    /// Backend connections per (database, user) pool.
    #[arg(long, env = "PGSLUICE_POOL_SIZE")]
    pool_size: Option<usize>,
    /// transaction or session.
    #[arg(long, env = "PGSLUICE_POOL_MODE")]
    pool_mode: Option<PoolMode>,
    /// Runtime threads: 1 = one thread, N = a pool of N, 0 = automatic (1 on ≤ 2 CPUs).
    #[arg(long, env = "PGSLUICE_WORKER_THREADS")]
    worker_threads: Option<usize>,
    /// Admin HTTP API address [default: 127.0.0.1:9930].
    #[arg(long, env = "PGSLUICE_ADMIN_LISTEN")]
    admin_listen: Option<SocketAddr>,
    /// Log as JSON lines (PGSLUICE_LOG_JSON: any value but 0, false, no, off or empty).
    #[arg(long, env = "PGSLUICE_LOG_JSON", value_parser = clap::builder::FalseyValueParser::new())]
    log_json: bool,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Validate a configuration file and print precise errors, without starting. With a
    /// backend URL (the file's or --backend) it also logs in once: pool sizes are compared
    /// with max_connections and the breaker probe is run.
    CheckConfig {
        file: PathBuf,
        /// postgres://USER[:PASSWORD]@HOST:PORT/DB to check against, in place of the file's.
        #[arg(long, env = "PGSLUICE_BACKEND_URL", hide_env_values = true)]
        backend: Option<String>,
        /// File holding the backend password, as for the proxy (a unit's ExecStartPre checks
        /// with the credentials the service will use).
        #[arg(long, value_name = "PATH", env = "PGSLUICE_BACKEND_PASSWORD_FILE")]
        backend_password_file: Option<PathBuf>,
    },
    /// Print the normal form and fingerprint the proxy gives a statement (no proxy needed).
    Fingerprint(pgsluice::cli::FingerprintArgs),
    #[command(flatten)]
    Admin(AdminCmd),
    /// Print a shell completion script (e.g. `pgsluice completions bash >
    /// /etc/bash_completion.d/pgsluice`).
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

fn print_errors(errs: &[ConfigError], file: Option<&PathBuf>) {
    for e in errs {
        match file {
            Some(f) => eprintln!("{}: {e}", f.display()),
            None => eprintln!("config: {e}"),
        }
    }
}

fn load(cli: &Cli) -> Result<Config, Vec<ConfigError>> {
    let base = match &cli.config {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    };
    base.apply(&Overrides {
        listen: cli.listen,
        unix_socket_dir: cli.unix_socket_dir.clone(),
        admin_listen: cli.admin_listen,
        backend: cli.backend.clone(),
        backend_password_file: cli.backend_password_file.clone(),
        backend_password: env_password(),
        pool_size: cli.pool_size,
        pool_mode: cli.pool_mode,
        worker_threads: cli.worker_threads,
    })
}

/// `PGSLUICE_BACKEND_PASSWORD`, if set (read at start and on every reload).
fn env_password() -> Option<Secret> {
    std::env::var_os("PGSLUICE_BACKEND_PASSWORD")
        .map(|v| Secret::new(v.to_string_lossy().into_owned()))
}

/// `check-config`: the file (plus `--backend`), then what the database says about it. The
/// environment's password and password files apply as at start.
fn check_config(
    file: &PathBuf,
    backend: Option<String>,
    backend_password_file: Option<PathBuf>,
) -> ExitCode {
    let overrides = Overrides {
        backend,
        backend_password_file,
        backend_password: env_password(),
        ..Overrides::default()
    };
    let config = match Config::load(file).and_then(|c| {
        // Without a URL there is no login to check against (and the start-up check that a
        // probe has one would fail here, where the URL may still come from the command line).
        if overrides.backend.is_some() || c.backend.url.is_some() {
            c.apply(&overrides)
        } else {
            Ok(c)
        }
    }) {
        Ok(c) => c,
        Err(errs) => {
            print_errors(&errs, Some(file));
            return ExitCode::from(1);
        }
    };
    let findings = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt.block_on(pgsluice::check::online(&config)),
        Err(e) => {
            eprintln!("cannot start a runtime: {e}");
            return ExitCode::from(1);
        }
    };
    for e in &findings.errors {
        eprintln!("{}: {e}", file.display());
    }
    if !findings.errors.is_empty() {
        return ExitCode::from(1);
    }
    println!("{}: OK", file.display());
    for note in config.notes().iter().chain(&findings.notes) {
        println!("note: {note}");
    }
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    let mut cli = Cli::parse();
    if let Some(Cmd::CheckConfig {
        file,
        backend,
        backend_password_file,
    }) = &cli.cmd
    {
        return check_config(file, backend.clone(), backend_password_file.clone());
    }
    if let Some(Cmd::Fingerprint(args)) = &cli.cmd {
        return match pgsluice::cli::fingerprint(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("pgsluice: {e:#}");
                ExitCode::from(1)
            }
        };
    }
    if let Some(Cmd::Completions { shell }) = &cli.cmd {
        let mut cmd = <Cli as clap::CommandFactory>::command();
        clap_complete::generate(*shell, &mut cmd, "pgsluice", &mut std::io::stdout());
        return ExitCode::SUCCESS;
    }
    // Only `Admin` or nothing is left, so taking it loses nothing.
    if let Some(Cmd::Admin(cmd)) = cli.cmd.take() {
        return run_client(cmd);
    }
    let config = match load(&cli) {
        Ok(c) => c,
        Err(errs) => {
            print_errors(&errs, cli.config.as_ref());
            return ExitCode::from(1);
        }
    };
    init_tracing(&config, cli.log_json);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = config.runtime_threads(cpus);
    let mut builder = match threads {
        1 => tokio::runtime::Builder::new_current_thread(),
        n => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n);
            b
        }
    };
    let rt = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    // With one session thread, a burst of new connections (and every one while client TLS is
    // on) authenticates on a second thread of its own, at a lower CPU priority (the few
    // logging in at once stay on the session thread): a connection storm then neither queues
    // ahead of the clients already served nor takes the CPU from them.
    let login = match threads {
        1 => match tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("pgsluice-login")
            .on_thread_start(lower_thread_priority)
            .enable_all()
            .build()
        {
            Ok(rt) => Some(rt),
            Err(e) => {
                eprintln!("cannot start the login runtime: {e}");
                return ExitCode::from(1);
            }
        },
        _ => None,
    };
    let login_handle = login.as_ref().map(|rt| rt.handle().clone());
    let result = rt.block_on(run(cli, config, login_handle));
    if let Some(login) = login {
        login.shutdown_timeout(std::time::Duration::from_secs(1));
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pgsluice: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// Nice value of the login thread: below the session thread (0) in the kernel's scheduling,
/// so when both want a core the sessions win.
const LOGIN_NICE: i32 = 10;

/// Lowers the calling thread's CPU priority (Linux nice values are per thread). Failure is
/// harmless: the thread keeps the process' priority.
fn lower_thread_priority() {
    // SAFETY: plain system calls on the calling thread's own id; no memory is shared.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, LOGIN_NICE);
    }
}

/// `pgsluice rules …` / `pgsluice top`: one request to the admin API, on a small runtime.
fn run_client(cmd: AdminCmd) -> ExitCode {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(pgsluice::cli::run(cmd)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pgsluice: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// Re-read the config source (file + command-line overrides) and apply it: SIGHUP and
/// `POST /v1/reload`. On error the running configuration stays.
fn reload(app: &App, cli: &Cli) -> Result<(), Vec<String>> {
    let config =
        load(cli).map_err(|errs| errs.iter().map(|e| e.to_string()).collect::<Vec<_>>())?;
    app.reload(config).map_err(|e| vec![e])
}

fn init_tracing(config: &Config, json: bool) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&config.log.level));
    // Colours only for a person at a terminal: journald, `docker logs` and files get plain
    // text (https://no-color.org: NO_COLOR turns them off at a terminal too).
    let ansi = std::io::stderr().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    if json || config.log.format == LogFormat::Json {
        b.json().init();
    } else {
        b.init();
    }
}

async fn run(
    cli: Cli,
    mut config: Config,
    login: Option<tokio::runtime::Handle>,
) -> anyhow::Result<()> {
    let listener = pgsluice::server::bind(config.listen, config.listen_reuseport)?;
    let peer = match config.peer_listen {
        Some(addr) => Some(tokio::net::TcpListener::bind(addr).await?),
        None => None,
    };
    // Port 0 becomes the port the OS chose: a fleet member announces where it listens.
    config.listen = listener.local_addr()?;
    let unix = match &config.unix_socket_dir {
        Some(dir) => {
            let mode = config.unix_socket_mode_bits().unwrap_or(0o777);
            Some(pgsluice::server::bind_unix(
                dir,
                config.listen.port(),
                mode,
            )?)
        }
        None => None,
    };
    if let Some(peer) = &peer {
        config.peer_listen = Some(peer.local_addr()?);
    }
    let admin = tokio::net::TcpListener::bind(config.admin.listen).await?;
    let rules = load_rules(&config)?;
    // A fleet member without a configured peer_id claims one before handing out cancel keys.
    let claimed = pgsluice::fleet::claim_peer_id(&config, std::time::Duration::from_secs(3)).await;
    if let Some(id) = claimed {
        config.peer_id = id;
    }
    let app =
        App::with_fleet_peer_id(config, rules, claimed.is_some()).map_err(anyhow::Error::msg)?;
    // The harness and scripts read these two lines to learn the chosen ports.
    // The admin line comes first: readers may stop at the client listening line.
    if let Some(peer) = &peer {
        println!("pgsluice peer cancels listening on {}", peer.local_addr()?);
    }
    println!("pgsluice admin listening on {}", admin.local_addr()?);
    if let Some(u) = &unix {
        println!("pgsluice unix socket listening on {}", u.path().display());
    }
    println!("pgsluice listening on {}", listener.local_addr()?);
    tracing::info!(addr = %listener.local_addr()?, "pgsluice listening");
    for note in app.config().notes() {
        tracing::warn!("{note}");
    }

    let cli = Arc::new(cli);
    let weak: Weak<App> = Arc::downgrade(&app);
    let source = Arc::clone(&cli);
    let reloader: pgsluice::app::Reloader = Arc::new(move || match weak.upgrade() {
        Some(app) => reload(&app, &source),
        None => Err(vec!["shutting down".to_owned()]),
    });
    // Set once, right after App::new, so this cannot fail.
    let _ = app.reloader.set(reloader);
    let admin_api =
        pgsluice::admin::Admin::new(app.clone(), pgsluice::admin::auth::EnvTokens::from_env());
    let router = admin_api.router();
    // The admin API outlives the drain: /readyz answers 503 ("shutting down") and /metrics
    // stays scrapable until the last session has left, then it stops with the proxy.
    let admin_stop = tokio_util::sync::CancellationToken::new();
    let token = admin_stop.clone();
    let admin_task = tokio::spawn(async move {
        let r = axum::serve(admin, router)
            .with_graceful_shutdown(token.cancelled_owned())
            .await;
        if let Err(e) = r {
            tracing::error!(error = %e, "admin server failed");
        }
    });
    let notifier = Arc::new(pgsluice::systemd::Notifier::from_env());
    // Everything that runs beside the sessions, in one list.
    let mut services = pgsluice::services::of_app(&app);
    services.extend(admin_api.services());
    if let Some(peer) = peer {
        let serve = pgsluice::server::serve_peer_cancels(app.clone(), peer);
        services.push(Service::task("peer cancels", serve));
    }
    services.push(Service::task(
        "signals",
        signals(app.clone(), cli, notifier.clone()),
    ));
    let services = pgsluice::services::start(services)?;
    notifier.ready(&format!("serving on {}", app.config().listen));
    let keepalive_ms = app.config().limits.client_tcp_keepalive_ms;
    let listeners = pgsluice::server::Listeners {
        tcp: listener,
        unix,
        keepalive: (keepalive_ms > 0).then(|| std::time::Duration::from_millis(keepalive_ms)),
    };
    let served = pgsluice::server::serve(app, listeners, login).await;
    admin_stop.cancel();
    let _ = tokio::time::timeout(std::time::Duration::from_secs(2), admin_task).await;
    services.finish().await;
    served.map_err(|e| anyhow::anyhow!("cannot move the listeners between threads: {e}"))
}

/// Runtime rules persisted by the admin API, if a rules file is configured and exists.
fn load_rules(config: &Config) -> anyhow::Result<Arc<RuleSet>> {
    let Some(path) = &config.admin.rules_file else {
        return Ok(Arc::new(RuleSet::new()));
    };
    match std::fs::read(path) {
        Ok(bytes) => RuleSet::from_json_bytes(&bytes)
            .map(Arc::new)
            .map_err(|e| anyhow::anyhow!("rules file {path}: {e}")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Arc::new(RuleSet::new())),
        Err(e) => Err(anyhow::anyhow!("rules file {path}: {e}")),
    }
}

/// SIGTERM/SIGINT: graceful stop (a second one exits at once). SIGHUP: reload.
async fn signals(app: Arc<App>, cli: Arc<Cli>, notifier: Arc<pgsluice::systemd::Notifier>) {
    let (Ok(mut term), Ok(mut int), Ok(mut hup)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
    ) else {
        tracing::error!("cannot install signal handlers");
        return;
    };
    loop {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
            _ = hup.recv() => {
                notifier.reloading();
                let status = match reload(&app, &cli) {
                    Ok(()) => {
                        tracing::info!("configuration reloaded");
                        "configuration reloaded"
                    }
                    Err(errs) => {
                        for e in errs {
                            tracing::error!(error = %e, "reload rejected; keeping the running configuration");
                        }
                        "reload rejected; the running configuration stays"
                    }
                };
                notifier.ready(status);
                continue;
            }
        }
        if app.life.is_stopping() {
            tracing::warn!("second shutdown signal: exiting now");
            std::process::exit(0);
        }
        tracing::info!("shutting down: no new connections");
        notifier.stopping();
        app.begin_shutdown();
    }
}
