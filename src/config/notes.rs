//! Notes on a valid configuration: what `check-config`, the startup log and every reload say
//! about settings that work but may not do what the operator meant — how a caller without
//! `match` is identified, a high-priority caller a client can select by itself, and settings
//! that are accepted but inert in this combination (each names the key and why).
//!
//! Pure: reads the [`Config`] only. Errors (settings that cannot work at all) are
//! `validate.rs`'s.

use super::{ClientTlsMode, Config, PoolMode, Priority, SessionStateMode};

impl Config {
    /// What is valid but worth saying, for `check-config`, the startup log and reload: how a
    /// caller without `match` is identified, a high-priority caller that the client can select
    /// by itself, and settings that are accepted but inert in this combination. Tags (and
    /// `application_name`) are written by the client, so any client that can log in can claim
    /// them; only `match.user` or `match.client_cidr` bind a caller to an identity.
    pub fn notes(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (i, c) in self.callers.iter().enumerate() {
            let priority = match c.priority {
                Priority::Critical => Some("critical"),
                Priority::High => Some("high"),
                _ => None,
            };
            let m = &c.matcher;
            let by_name = m.tag.is_empty()
                && m.application_name.is_none()
                && m.user.is_none()
                && m.client_cidr.is_none();
            if by_name {
                let mut note = format!(
                    "callers[{i}] ({name}) has no match: it is matched by its name, i.e. a \
                     client whose comment tag /*service:{name}*/, application_name or login \
                     user is `{name}`",
                    name = c.name
                );
                if let Some(p) = priority {
                    note.push_str(&format!(
                        "; as priority {p}, note that the tag and application_name are \
                         chosen by the client: bind it to an identity with match.user or \
                         match.client_cidr"
                    ));
                }
                out.push(note);
            } else if let Some(p) = priority
                && !m.tag.is_empty()
                && m.user.is_none()
                && m.client_cidr.is_none()
            {
                let tags: Vec<String> = m.tag.iter().map(|(k, v)| format!("{k}:{v}")).collect();
                out.push(format!(
                    "callers[{i}] ({}, priority {p}) is selected by the comment tag \
                     /*{}*/ alone: any client that can log in can write that tag and run as \
                     it; bind it to an identity with match.user or match.client_cidr",
                    c.name,
                    tags.join(",")
                ));
            }
        }
        self.inert(&mut out);
        self.no_idle_transaction_timeout(&mut out);
        self.console_users_without_login(&mut out);
        out
    }

    /// A console user the proxy cannot authenticate — not in `auth.users`, not the backend
    /// URL's user, and no `auth_query` to look it up — can never reach the console.
    fn console_users_without_login(&self, out: &mut Vec<String>) {
        if self.auth.auth_query.is_some() || self.auth.method == super::AuthMethod::Trust {
            return;
        }
        let backend_user = self.backend_url().map(|u| u.user);
        let console = &self.admin.console;
        for (field, users) in [
            ("admin_users", &console.admin_users),
            ("stats_users", &console.stats_users),
        ] {
            for u in users {
                let known = self.auth.users.iter().any(|a| &a.name == u)
                    || backend_user.as_deref() == Some(u.as_str());
                if !known {
                    out.push(format!(
                        "admin.console.{field} names {u:?}, who cannot log in: add it to \
                         auth.users (or set auth.auth_query)"
                    ));
                }
            }
        }
    }

    /// Callers (the `default` caller among them) with no idle-in-transaction timeout: a client
    /// that opens a transaction and stops sending holds its backend, and the locks it took,
    /// until its connection dies (TCP keepalive finds a vanished host; a live one that hangs
    /// is never found).
    fn no_idle_transaction_timeout(&self, out: &mut Vec<String>) {
        let global = self
            .global_defaults
            .idle_transaction_timeout_ms
            .is_some_and(|ms| ms > 0);
        let mut without: Vec<&str> = self
            .callers
            .iter()
            .filter(|c| match c.idle_transaction_timeout_ms {
                Some(ms) => ms == 0,
                None => !global,
            })
            .map(|c| c.name.as_str())
            .collect();
        if !global {
            without.push("default");
        }
        if !without.is_empty() {
            out.push(format!(
                "no idle-in-transaction timeout for caller(s) {}: a client that opens a \
                 transaction and stops sending holds its backend and its locks until its \
                 connection dies; set global_defaults.idle_transaction_timeout_ms (or the \
                 caller's idle_transaction_timeout_ms)",
                without.join(", ")
            ));
        }
    }

    /// Settings that are accepted but do nothing in this combination.
    fn inert(&self, out: &mut Vec<String>) {
        let mut say = |key: &str, why: &str| out.push(format!("{key} has no effect: {why}"));
        let b = &self.global_defaults.circuit_breaker;
        if b.probe_sql.is_some() && b.db_cpu_threshold_percent.is_none() && !self.adaptive_wanted()
        {
            say(
                "global_defaults.circuit_breaker.probe_sql",
                "without db_cpu_threshold_percent its value trips nothing (only its failures \
                 count as backend errors), and no pool runs the adaptive limit",
            );
        }
        if b.consecutive_errors == 0 && b.db_cpu_threshold_percent.is_none() {
            say(
                "global_defaults.circuit_breaker.open_ms (and half_open_trials)",
                "with consecutive_errors: 0 and no db_cpu_threshold_percent the breaker never \
                 opens",
            );
        }
        // (`track` is the default, so only a value set on purpose is worth a note.)
        if self.pool.mode == PoolMode::Session && self.pool.session_state != SessionStateMode::Track
        {
            say(
                "pool.session_state",
                "session mode keeps each client on its own backend, so there is no session \
                 state to track, pin or reject",
            );
        }
        for (i, o) in self.pools.iter().enumerate() {
            let mode = o.mode.unwrap_or(self.pool.mode);
            if mode == PoolMode::Session && o.session_state.is_some() {
                say(
                    &format!("pools[{i}].session_state"),
                    "that pool is in session mode",
                );
            }
        }
        if self.pool.critical_reserve.is_some_and(|r| r > 0)
            && !self
                .callers
                .iter()
                .any(|c| c.priority == Priority::Critical)
        {
            say(
                "pool.critical_reserve",
                "no caller is critical, so no one may use the reserved backends (they stay idle)",
            );
        }
        if self.pool.adaptive == Some(true) && self.backend.url.is_none() {
            say(
                "pool.adaptive",
                "its load probe logs in as backend.url's user and there is none in this file \
                 (give --backend at start): without it the limit stays at the pool size",
            );
        }
        if self.tls.mode == ClientTlsMode::Disable
            && (self.tls.cert_file.is_some() || self.tls.key_file.is_some())
        {
            say("tls.cert_file / tls.key_file", "tls.mode is disable");
        }
        if self.backend.root_cert_file.is_some() && !self.backend.tls_verified() {
            say(
                "backend.root_cert_file",
                "backend.tls is not verify-ca or verify-full, so no certificate is checked",
            );
        }
        if self.admin.open_reads && self.admin.read_token.is_some() {
            say(
                "admin.read_token",
                "admin.open_reads serves the read endpoints without a token",
            );
        }
        if self.limits.max_handshakes_per_address >= self.limits.max_handshakes {
            say(
                "limits.max_handshakes_per_address",
                "it is not below limits.max_handshakes, so one address can take every slot",
            );
        }
        if !self.classify.enabled {
            say(
                "callers[].match.tag and fingerprint rules",
                "classify.enabled is false: no statement is tagged or fingerprinted",
            );
        }
        for (i, c) in self.callers.iter().enumerate() {
            if c.burst.is_some() && c.max_qps.is_none() {
                say(&format!("callers[{i}].burst"), "it needs max_qps");
            }
            if c.weight.is_some() && !self.pool.fair_shares {
                say(
                    &format!("callers[{i}].weight"),
                    "the pools serve waiters first come, first served without pool.fair_shares",
                );
            }
            if c.scope == super::Scope::Fleet && c.max_qps.is_none() && c.max_concurrency.is_none()
            {
                say(
                    &format!("callers[{i}].scope"),
                    "fleet scope shares max_qps and max_concurrency, and it sets neither",
                );
            }
        }
        for (i, c) in self.callers.iter().enumerate() {
            if c.queue_depth == Some(0) && c.queue_timeout_ms.is_some_and(|t| t > 0) {
                // The timeout still caps the pool checkout wait: not inert, but say so.
                out.push(format!(
                    "callers[{i}] ({}) has queue_depth 0: it never waits for a caller slot; \
                     queue_timeout_ms caps only its wait for a backend connection",
                    c.name
                ));
            }
        }
    }
}

#[cfg(test)]
mod notes_tests {
    use super::super::Config;

    #[test]
    fn a_critical_caller_selected_by_a_tag_alone_gets_a_note() {
        let yaml = "callers:\n\
            - { name: pay, priority: critical, match: { tag: { service: billing } } }\n\
            - { name: bound, priority: critical, match: { tag: { service: x }, user: app } }\n\
            - { name: net, priority: high, match: { tag: { service: y }, client_cidr: 10.0.0.0/8 } }\n\
            - { name: batch, priority: low, match: { tag: { service: z } } }\n";
        let c = Config::from_yaml(yaml).expect("valid");
        let notes: Vec<String> = c
            .notes()
            .into_iter()
            .filter(|n| !n.starts_with("no idle-in-transaction timeout"))
            .collect();
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(
            notes[0].contains("callers[0] (pay, priority critical)")
                && notes[0].contains("/*service:billing*/")
                && notes[0].contains("match.user"),
            "{}",
            notes[0]
        );
    }

    #[test]
    fn a_console_user_who_cannot_log_in_gets_a_note() {
        let console = |yaml: &str| -> Vec<String> {
            Config::from_yaml(yaml)
                .expect("valid")
                .notes()
                .into_iter()
                .filter(|n| n.starts_with("admin.console."))
                .collect()
        };
        let yaml = "admin:\n  console: { admin_users: [ops], stats_users: [mon] }\n\
                    auth:\n  users:\n    - { name: ops, password: secret }\n";
        let notes = console(yaml);
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(
            notes[0].contains("stats_users names \"mon\""),
            "{}",
            notes[0]
        );
        let with_query = format!(
            "{yaml}  auth_query: {{ user: lookup, query: \"SELECT usename, passwd FROM pg_shadow WHERE usename = $1\" }}\n"
        );
        assert!(console(&with_query).is_empty(), "auth_query may know them");
    }

    #[test]
    fn a_weight_without_fair_shares_gets_a_note() {
        let weight = |yaml: &str| -> Vec<String> {
            let c = Config::from_yaml(yaml).expect("valid");
            let notes = c.notes().into_iter();
            notes.filter(|n| n.contains(".weight")).collect()
        };
        let notes = weight("callers:\n  - { name: web, weight: 3 }\n");
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(notes[0].starts_with("callers[0].weight has no effect"));
        let fair = "pool: { fair_shares: true }\ncallers:\n  - { name: web, weight: 3 }\n";
        assert!(weight(fair).is_empty());
    }

    #[test]
    fn callers_without_an_idle_transaction_timeout_get_a_note() {
        let idle = |yaml: &str| -> Option<String> {
            Config::from_yaml(yaml)
                .expect("valid")
                .notes()
                .into_iter()
                .find(|n| n.starts_with("no idle-in-transaction timeout"))
        };
        let note = idle("callers:\n  - { name: web }\n").expect("a note");
        assert!(note.contains("caller(s) web, default:"), "{note}");
        assert_eq!(
            idle(
                "global_defaults: { idle_transaction_timeout_ms: 60000 }\ncallers:\n  - { name: web }\n"
            ),
            None
        );
        let note = idle(
            "global_defaults: { idle_transaction_timeout_ms: 60000 }\ncallers:\n  - { name: batch, idle_transaction_timeout_ms: 0 }\n",
        )
        .expect("a note");
        assert!(note.contains("caller(s) batch:"), "{note}");
    }
}
