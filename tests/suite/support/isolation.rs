//! Shared pieces of the isolation tests of issue 15 (`session_state`, `limits`, `admission`,
//! `timeouts`): a cluster and a transaction-mode proxy with a config file, a wire client
//! through it, and the session-state probe. Some tests name these `common::…`; their modules
//! import this one as `common`.

use super::env::Env;
use super::pg::{APP_DB, APP_PASSWORD, APP_USER, Cluster};
use super::proxy::Proxy;
use super::sql::scalar;
use super::wire::WireClient;

/// Starts a cluster and a transaction-mode proxy with `pool` backends and config `yaml`,
/// running `prepare` on the cluster first.
pub fn start(pool: usize, yaml: &str, prepare: impl FnOnce(&Cluster)) -> Env {
    Env::start(pool, yaml, prepare)
}

/// Everything a previous client could have left on a session, as one line: search_path,
/// current_user, a custom setting, advisory locks held, channels listened to, statement and
/// lock timeout, standard_conforming_strings, SQL-prepared statements (the proxy's own
/// protocol-level ones are not counted), WITH HOLD cursors, temporary relations,
/// session_user, default_transaction_read_only.
pub const STATE_SQL: &str = "SELECT current_setting('search_path') || '|' || current_user \
     || '|' || coalesce(current_setting('app.tenant_id', true), '') \
     || '|' || (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
                AND pid = pg_backend_pid()) \
     || '|' || (SELECT count(*) FROM pg_listening_channels()) \
     || '|' || current_setting('statement_timeout') || '|' || current_setting('lock_timeout') \
     || '|' || current_setting('standard_conforming_strings') \
     || '|' || (SELECT count(*) FROM pg_prepared_statements WHERE from_sql) \
     || '|' || (SELECT count(*) FROM pg_cursors WHERE is_holdable) \
     || '|' || (SELECT count(*) FROM pg_class WHERE relnamespace = pg_my_temp_schema()) \
     || '|' || session_user || '|' || current_setting('default_transaction_read_only')";

/// What [`STATE_SQL`] shows on a fresh `app` session.
pub const CLEAN: &str = "\"$user\", public|app||0|0|0|0|on|0|0|0|app|off";

/// User code that leaves session state behind (`public.dirty(t)`: `app.tenant_id = t`,
/// `search_path = evil`, advisory lock 4242, `LISTEN leak`), reached in every way a
/// statement's text may not show: a function returning a record, a view, attribute notation
/// (`things.dirt`), a column default (`withdefault.t`), a trigger (`trig`); and a table under
/// row-level security keyed on `app.tenant_id` (`accounts`: one row each for `a` and `b`).
/// Created by the superuser, granted to `app`.
pub fn user_code(c: &Cluster) {
    c.psql_on(
        APP_DB,
        &format!(
            "CREATE TABLE public.accounts (tenant text, secret text); \
             INSERT INTO public.accounts VALUES ('a', 'a-secret'), ('b', 'b-secret'); \
             ALTER TABLE public.accounts ENABLE ROW LEVEL SECURITY; \
             CREATE POLICY tenant_rows ON public.accounts \
               USING (tenant = current_setting('app.tenant_id', true)); \
             CREATE FUNCTION public.dirty(t text) RETURNS text LANGUAGE plpgsql AS $$ \
               BEGIN PERFORM set_config('app.tenant_id', t, false); \
               PERFORM set_config('search_path', 'evil', false); \
               PERFORM pg_advisory_lock(4242); EXECUTE 'LISTEN leak'; RETURN t; END $$; \
             CREATE FUNCTION public.rec(t text) RETURNS record LANGUAGE plpgsql AS $$ \
               BEGIN PERFORM public.dirty(t); RETURN ROW(t); END $$; \
             CREATE VIEW public.v_tenant AS SELECT public.dirty('a') AS t; \
             CREATE TABLE public.things (id int); INSERT INTO public.things VALUES (1); \
             CREATE FUNCTION public.dirt(public.things) RETURNS text LANGUAGE sql \
               AS $$ SELECT public.dirty('a') $$; \
             CREATE TABLE public.withdefault (id int, t text DEFAULT public.dirty('a')); \
             CREATE TABLE public.trig (id int); \
             CREATE FUNCTION public.trig_fn() RETURNS trigger LANGUAGE plpgsql AS $$ \
               BEGIN PERFORM public.dirty('a'); RETURN NEW; END $$; \
             CREATE TRIGGER trig_dirty BEFORE INSERT ON public.trig \
               FOR EACH ROW EXECUTE FUNCTION public.trig_fn(); \
             GRANT SELECT ON public.accounts, public.v_tenant, public.things TO {APP_USER}; \
             GRANT INSERT ON public.withdefault, public.trig TO {APP_USER}; \
             GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA public TO {APP_USER};"
        ),
    );
}

/// A fresh client's view of its session.
pub async fn fresh_state(proxy: &Proxy) -> String {
    let c = proxy.client().await;
    scalar(&c, STATE_SQL).await
}

/// A raw wire client of the app user through `proxy`.
pub async fn wire(proxy: &Proxy) -> WireClient {
    WireClient::connect(proxy.addr(), APP_USER, APP_PASSWORD, APP_DB)
        .await
        .expect("wire client")
}
