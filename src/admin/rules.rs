//! `/v1/rules`: runtime fingerprint rules over HTTP, persisted to `admin.rules_file`.
//!
//! A rule is stored under a fingerprint given as 16 hex digits (`PUT
//! /v1/rules/fingerprint/{hash}`) or computed from SQL text (`POST /v1/rules/fingerprint`
//! with `sql` beside the rule fields: the server names the resource, as a POST to a
//! collection does, through the proxy's own classifier, so the hash is exactly the one its
//! statements get). Either way the answer carries a `warning` when this instance has no
//! statistics row for the fingerprint (never seen since start, or evicted from the top-K):
//! the rule is kept, since the pattern may come later, but a mistyped hash shows at once.
//!
//! Nothing is applied on a partial failure. A mutation is staged first: the current rules
//! are copied into a scratch `RuleSet` (through the persisted form), the change is applied
//! there, the result is written to the rules file (temp file in the same directory, fsync,
//! rename, fsync of the directory; the temp file has a random name and is created
//! exclusively, mode 0600, so nothing planted there is followed), and only then is the same change applied to the live
//! set. If validation or the write fails, the live set was never touched (500 for a failed
//! write). Mutations and purges are serialised by one async mutex that also remembers the
//! bytes last written, so the file always holds a state the live set went through.
//!
//! [`purge_loop`] runs every [`PURGE_INTERVAL`]: it removes expired rules from memory and
//! rewrites the file whenever the live set's persisted form differs from what was last
//! written. That drops expired rules from the file, retries a write that failed, and
//! replaces the staged creation/expiry stamps with the live ones (they differ by the
//! microseconds between the staged and the live `put`). Expired rules are invisible to the
//! API and the hot path at once. Without a `rules_file`, rules live in memory only and
//! responses say `"persisted": false`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use tokio::time::Instant;

use super::AdminState;
use super::error::{ApiError, Fingerprint, JsonBody, NoQuery};
use crate::policy::rules::{
    MAX_RULE_JSON_BYTES, RuleError, RuleInfo, RuleSet, RuleSpec, fingerprint_hex,
};

/// How often expired rules are removed and the file rewritten.
pub const PURGE_INTERVAL: Duration = Duration::from_secs(2);

#[derive(Serialize)]
struct RuleList {
    rules: Vec<RuleInfo>,
}

#[derive(Serialize)]
pub(super) struct StoredRule {
    #[serde(flatten)]
    rule: RuleInfo,
    /// False when no `admin.rules_file` is configured (the rule is lost on restart).
    persisted: bool,
    /// For a rule made from SQL: the statement's normal form (what `GET /v1/fingerprints`
    /// shows for it).
    #[serde(skip_serializing_if = "Option::is_none")]
    normalized: Option<String>,
    /// Why the rule may not match anything yet ([`unseen_warning`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    warning: Option<String>,
}

#[derive(Serialize)]
struct Deleted {
    deleted: String,
    persisted: bool,
}

/// `GET /v1/rules`: live rules with counters and expiry, ordered by fingerprint.
pub async fn list(State(st): State<Arc<AdminState>>, _: NoQuery) -> Json<impl Serialize> {
    Json(RuleList {
        rules: st.app.policy.rules().list(Instant::now()),
    })
}

/// `GET /v1/rules/fingerprint/{hash}`.
pub async fn get(
    State(st): State<Arc<AdminState>>,
    Fingerprint(fp): Fingerprint,
    _: NoQuery,
) -> Result<Json<RuleInfo>, ApiError> {
    st.app
        .policy
        .rules()
        .get(fp)
        .map(|r| Json(r.info(Instant::now())))
        .ok_or_else(|| no_rule(fp))
}

/// `PUT /v1/rules/fingerprint/{hash}`: 201 when created, 200 when replaced.
pub async fn put(
    State(st): State<Arc<AdminState>>,
    Fingerprint(fp): Fingerprint,
    _: NoQuery,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let spec = RuleSpec::from_json(&body).map_err(|e| {
        if e.field == SQL_FIELD {
            RuleError::new(
                SQL_FIELD,
                "not taken with a hash: POST the rule with its sql to /v1/rules/fingerprint \
                 (the fingerprint is computed from the text)",
            )
        } else {
            e
        }
    })?;
    let (status, body) = store(&st, fp, spec, None).await?;
    Ok((status, Json(body)).into_response())
}

/// The body field that carries SQL text in `POST /v1/rules/fingerprint`.
pub(super) const SQL_FIELD: &str = "sql";

/// The classification of a rule's `sql`: refused when it holds no statement.
pub fn classify_rule_sql(
    st: &AdminState,
    sql: &str,
) -> Result<Arc<crate::classify::Classified>, RuleError> {
    let class = st.app.classifier.classify(sql);
    if class.normalized.trim().is_empty() {
        return Err(RuleError::new(
            SQL_FIELD,
            "holds no statement (only whitespace, comments or semicolons)",
        ));
    }
    Ok(class)
}

/// `POST /v1/rules/fingerprint`: the rule fields plus `sql`, a statement whose fingerprint
/// the rule is for. 201 when created, 200 when replaced; `Location` names the rule.
pub async fn post_sql(
    State(st): State<Arc<AdminState>>,
    _: NoQuery,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let (sql, spec) = split_sql(&body)?;
    let class = classify_rule_sql(&st, &sql)?;
    let fp = class.fingerprint;
    let (status, body) = store(&st, fp, spec, Some(class.normalized.to_string())).await?;
    let location = format!("/v1/rules/fingerprint/{}", fingerprint_hex(fp));
    Ok((status, [(header::LOCATION, location)], Json(body)).into_response())
}

/// The `sql` string of a rule body and the rule made of the other fields.
fn split_sql(bytes: &[u8]) -> Result<(String, RuleSpec), RuleError> {
    if bytes.len() > MAX_RULE_JSON_BYTES {
        // Same limit and wording as a PUT body.
        return RuleSpec::from_json(bytes).map(|s| (String::new(), s));
    }
    let mut value: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| RuleError::new("body", format!("invalid JSON: {e}")))?;
    let Some(map) = value.as_object_mut() else {
        return Err(RuleError::new("body", "must be a JSON object"));
    };
    let sql = match map.remove(SQL_FIELD) {
        Some(serde_json::Value::String(s)) => s,
        Some(_) => return Err(RuleError::new(SQL_FIELD, "must be a string")),
        None => {
            return Err(RuleError::new(
                SQL_FIELD,
                "required: the statement whose fingerprint the rule is for (or PUT the rule \
                 to /v1/rules/fingerprint/{hash})",
            ));
        }
    };
    if sql.trim().is_empty() {
        return Err(RuleError::new(SQL_FIELD, "must not be empty"));
    }
    if sql.contains('\0') {
        return Err(RuleError::new(SQL_FIELD, "must not contain NUL characters"));
    }
    Ok((sql, RuleSpec::from_value(value)?))
}

/// Why a rule for `fp` may match nothing yet, if it may: statements get no fingerprint at
/// all, or this instance has no statistics row for it.
pub(super) fn unseen_warning(st: &AdminState, fp: u64) -> Option<String> {
    if !st.app.config().classify.enabled {
        return Some(
            "classify.enabled is false: statements get no fingerprint, so no rule matches \
             until it is turned on"
                .to_owned(),
        );
    }
    if st.app.fp_stats.contains(fp) {
        return None;
    }
    Some(format!(
        "no statement with fingerprint {} has been seen by this instance since it started \
         (or it is no longer among the tracked fingerprints); the rule is kept and applies \
         as soon as the pattern arrives. Check the hash against GET /v1/fingerprints, or let \
         `pgsluice fingerprint \"SQL\"` or POST /v1/rules/fingerprint with {{\"sql\": ...}} \
         compute it",
        fingerprint_hex(fp)
    ))
}

/// Validates `spec` and stores it as the rule of `fp` (fleet first, when there is one; else
/// the rules file, then the live set). The status is 201 when no rule existed, else 200.
pub(super) async fn store(
    st: &AdminState,
    fp: u64,
    spec: RuleSpec,
    normalized: Option<String>,
) -> Result<(StatusCode, StoredRule), ApiError> {
    spec.validate()?;
    let live = st.app.policy.rules();
    let mut written = st.rules_file.lock().await;
    let existed = live.get(fp).is_some();
    let (rule, persisted) = if let Some(fleet) = &st.app.fleet {
        // Redis first; the writer's own sync makes the rule live here.
        let stored = RuleSet::stage(fp, &spec)?;
        fleet
            .write_rule(live, &stored.fingerprint, Some(&stored))
            .await
            .map_err(fleet_error)?;
        let persisted = st.persist_live(&mut written).await;
        let rule = live.get(fp).ok_or_else(|| {
            ApiError::Internal("the rule was written to the fleet but is not live here".into())
        })?;
        (rule, persisted)
    } else {
        let persisted = st
            .persist_staged(&mut written, |staged| {
                staged.put(fp, spec.clone()).map(drop)
            })
            .await?;
        (live.put(fp, spec)?, persisted)
    };
    let warning = unseen_warning(st, fp);
    tracing::info!(
        fingerprint = %fingerprint_hex(fp),
        action = rule.def().action.name(),
        fleet = st.app.fleet.is_some(),
        "admin API: rule stored"
    );
    if let Some(w) = &warning {
        tracing::warn!(fingerprint = %fingerprint_hex(fp), "admin API: {w}");
    }
    let status = if existed {
        StatusCode::OK
    } else {
        StatusCode::CREATED
    };
    let body = StoredRule {
        rule: rule.info(Instant::now()),
        persisted,
        normalized,
        warning,
    };
    Ok((status, body))
}

/// `DELETE /v1/rules/fingerprint/{hash}`: 404 when there is no live rule.
pub async fn delete(
    State(st): State<Arc<AdminState>>,
    Fingerprint(fp): Fingerprint,
    _: NoQuery,
) -> Result<Json<impl Serialize>, ApiError> {
    let live = st.app.policy.rules();
    let mut written = st.rules_file.lock().await;
    let persisted = if let Some(fleet) = &st.app.fleet {
        let changed = fleet
            .write_rule(live, &fingerprint_hex(fp), None)
            .await
            .map_err(fleet_error)?;
        // `write_rule` synced: a rule Redis did not have is gone here too.
        if !changed && live.get(fp).is_none() {
            return Err(no_rule(fp));
        }
        st.persist_live(&mut written).await
    } else {
        if live.get(fp).is_none() {
            return Err(no_rule(fp));
        }
        let persisted = st
            .persist_staged(&mut written, |staged| {
                staged.delete(fp);
                Ok(())
            })
            .await?;
        live.delete(fp);
        persisted
    };
    tracing::info!(
        fingerprint = %fingerprint_hex(fp),
        fleet = st.app.fleet.is_some(),
        "admin API: rule deleted"
    );
    Ok(Json(Deleted {
        deleted: fingerprint_hex(fp),
        persisted,
    }))
}

fn fleet_error(e: crate::fleet::FleetError) -> ApiError {
    tracing::warn!(error = %e, "admin API: fleet rule write refused");
    ApiError::Unavailable(e.to_string())
}

fn no_rule(fp: u64) -> ApiError {
    ApiError::NotFound(format!("no rule for fingerprint {}", fingerprint_hex(fp)))
}

impl AdminState {
    /// Applies `change` to a copy of the live rules and writes the copy to the rules file.
    /// Returns whether a file was written. `written` is the guard of `rules_file`.
    async fn persist_staged(
        &self,
        written: &mut Option<Vec<u8>>,
        change: impl FnOnce(&RuleSet) -> Result<(), crate::policy::rules::RuleError>,
    ) -> Result<bool, ApiError> {
        let Some(path) = self.rules_path() else {
            return Ok(false);
        };
        let live = self.app.policy.rules();
        let current = live.to_json_bytes().map_err(internal)?;
        let staged = RuleSet::from_json_bytes(&current).map_err(internal)?;
        change(&staged)?;
        let bytes = staged.to_json_bytes().map_err(internal)?;
        write_file(path, bytes.clone()).await?;
        *written = Some(bytes);
        Ok(true)
    }

    /// Writes the live rules to the rules file (fleet mode: the change is already live and
    /// in Redis, so a failed write is only logged and retried by the purge loop). Returns
    /// whether the file now holds them.
    async fn persist_live(&self, written: &mut Option<Vec<u8>>) -> bool {
        let Some(path) = self.rules_path() else {
            return false;
        };
        let Ok(bytes) = self.app.policy.rules().to_json_bytes() else {
            return false;
        };
        if written.as_ref() == Some(&bytes) {
            return true;
        }
        let shown = path.display().to_string();
        let data = bytes.clone();
        let result = tokio::task::spawn_blocking(move || write_atomic(&path, &data)).await;
        match result {
            Ok(Ok(())) => {
                *written = Some(bytes);
                true
            }
            Ok(Err(e)) => {
                tracing::error!(file = %shown, error = %e, "admin API: rules file not written (the change is live; retried by the purge loop)");
                false
            }
            Err(e) => {
                tracing::error!(file = %shown, error = %e, "admin API: rules file not written");
                false
            }
        }
    }

    fn rules_path(&self) -> Option<PathBuf> {
        self.app
            .config()
            .admin
            .rules_file
            .as_ref()
            .map(PathBuf::from)
    }
}

fn internal(e: impl std::fmt::Display) -> ApiError {
    tracing::error!(error = %e, "admin API: rules");
    ApiError::Internal(format!("rules could not be prepared: {e}"))
}

async fn write_file(path: PathBuf, bytes: Vec<u8>) -> Result<(), ApiError> {
    let shown = path.display().to_string();
    let result = tokio::task::spawn_blocking(move || write_atomic(&path, &bytes))
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))
        .and_then(|r| r);
    result.map_err(|e| {
        tracing::error!(file = %shown, error = %e, "admin API: cannot persist rules; change not applied");
        ApiError::Internal(format!(
            "cannot write the rules file ({e}); the change was not applied"
        ))
    })
}

/// Write `bytes` to `path` so that readers see the old or the new file, never a mix: a temp
/// file in the same directory, fsync, rename over `path`, fsync of the directory.
///
/// The temp file has a random name and is created with `O_EXCL` (`create_new`), mode 0600: a
/// file or symlink someone planted at that name is never opened, followed or truncated; the
/// write fails instead (after a few fresh names).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_atomic_named(path, bytes, || format!("{:016x}", rand::random::<u64>()))
}

/// Fresh temp names tried before giving up (a clash of random names means someone is
/// planting files there).
const TEMP_ATTEMPTS: usize = 4;

/// [`write_atomic`] with the temp names' suffixes from `suffix` (tests plant files there).
fn write_atomic_named(
    path: &Path,
    bytes: &[u8],
    mut suffix: impl FnMut() -> String,
) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::other("rules_file has no file name"))?;
    let mut attempt = 0;
    let (mut f, tmp) = loop {
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(name);
        tmp_name.push(format!(".tmp.{}", suffix()));
        let tmp = dir.join(tmp_name);
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
        {
            Ok(f) => break (f, tmp),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                attempt += 1;
                if attempt == TEMP_ATTEMPTS {
                    return Err(e);
                }
            }
            Err(e) => return Err(e),
        }
    };
    let result = (|| {
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        std::fs::File::open(&dir)?.sync_all()
    })();
    if result.is_err() {
        // Best effort; this is the file created above (O_EXCL), nobody else's.
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Every [`PURGE_INTERVAL`] until shutdown: drops expired rules and brings the rules file in
/// line with the live set (see the module doc). A failed write is logged and retried.
pub async fn purge_loop(st: Arc<AdminState>) {
    let mut tick = tokio::time::interval(PURGE_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = st.app.life.stopping() => return,
        }
        let live = st.app.policy.rules();
        let mut written = st.rules_file.lock().await;
        let gone = live.purge_expired(Instant::now());
        if gone > 0 {
            tracing::info!(count = gone, "expired rules removed");
        }
        let Some(path) = st.rules_path() else {
            continue;
        };
        let bytes = match live.to_json_bytes() {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(error = %e, "cannot serialise rules");
                continue;
            }
        };
        if written.as_ref() != Some(&bytes) && write_file(path, bytes.clone()).await.is_ok() {
            *written = Some(bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn a_symlink_at_the_temp_name_is_never_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rules.json");
        std::fs::write(&path, b"old").unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let planted = dir.path().join(".rules.json.tmp.fixed");
        std::os::unix::fs::symlink(&victim, &planted).unwrap();

        let err = write_atomic_named(&path, b"new", || "fixed".to_owned()).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert_eq!(
            std::fs::read(&path).unwrap(),
            b"old",
            "the file is untouched"
        );
        assert!(
            planted.symlink_metadata().is_ok(),
            "a file the writer did not create is not removed"
        );

        // A taken name is skipped for a fresh one.
        let mut names = ["fixed", "fresh"].into_iter();
        write_atomic_named(&path, b"new", || names.next().unwrap_or("x").to_owned()).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    }

    #[test]
    fn a_body_with_sql_splits_into_the_text_and_the_rule() {
        let (sql, spec) =
            split_sql(br#"{"sql":"SELECT * FROM t WHERE id = 1","action":"REJECT"}"#).unwrap();
        assert_eq!(sql, "SELECT * FROM t WHERE id = 1");
        assert_eq!(spec.action.as_deref(), Some("REJECT"));
        assert!(spec.validate().is_ok());
        for (body, field) in [
            (r#"{"action":"REJECT"}"#, "sql"),
            (r#"{"sql":1,"action":"REJECT"}"#, "sql"),
            (r#"{"sql":" \n ","action":"REJECT"}"#, "sql"),
            (r#"{"sql":"SELECT 1\u0000","action":"REJECT"}"#, "sql"),
            (r#"{"sql":"SELECT 1","action":"REJECT","hash":"x"}"#, "hash"),
            (r#"{"sql":"SELECT 1","max_qps":"two"}"#, "max_qps"),
            ("[]", "body"),
            ("{", "body"),
        ] {
            let err = split_sql(body.as_bytes()).unwrap_err();
            assert_eq!(err.field, field, "{body}: {err}");
        }
        let huge = format!(r#"{{"sql":"{}"}}"#, "x".repeat(MAX_RULE_JSON_BYTES));
        assert_eq!(split_sql(huge.as_bytes()).unwrap_err().field, "body");
    }

    #[test]
    fn writes_replace_the_file_with_a_private_one_and_leave_no_temp() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rules.json");
        write_atomic(&path, b"one").unwrap();
        write_atomic(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["rules.json"]);
    }
}
