//! What a real parse proves about a statement text: whether the session effects the token
//! walk reports (`kind.rs`, `effects.rs`) are all it can do, and which names it must trust
//! the database about.
//!
//! Owns [`Proof`] and the AST walk behind it (sqlparser, PostgreSQL dialect). The token walk
//! stays the source of the effects and kind; this module only *adds* doubt: when the parse
//! cannot show that a text runs nothing but built-ins, the classifier reports
//! `SessionEffect::Unknown`, and the session layer verifies or resets the backend.
//!
//! A text is proven only when every rule below holds; anything else is unproven, never "no
//! effect":
//! - It parses, it is valid UTF-8 (a lossy copy may hide a quote) and it does not mention a
//!   setting that changes how Postgres reads the rest of it (`standard_conforming_strings`,
//!   `backslash_quote`, `search_path`, which decides what an unqualified name means) or that
//!   seeds `random()` (`seed`).
//! - Every statement is a query (`SELECT`, `VALUES`, set operations), an `INSERT`, `UPDATE`
//!   or `DELETE` of a named table (data-modifying CTEs included), transaction control,
//!   `SET`/`RESET`/`SHOW`, `LISTEN`/`UNLISTEN`/`NOTIFY`, a cursor statement, SQL `PREPARE` /
//!   `DEALLOCATE`, `DISCARD` or `EXPLAIN` of one of these. `MERGE`, `COPY`, DDL, `EXECUTE`,
//!   `CALL`, `DO` and anything else are not.
//! - Every function call is a built-in known to leave the session alone (unqualified or
//!   `pg_catalog.`), or `set_config` with a plain literal name (read as Postgres reads it:
//!   no escape string, no concatenation) and a literal `is_local`, or a session advisory lock
//!   function (which the token walk reports).
//! - Every expression and table form is one the walk knows; an unfamiliar one is unproven.
//!
//! A proven text still reads relations, applies operators and casts, and may name a function
//! in attribute notation (`t.f`): a view, a row-security policy, a rule, a user-defined
//! operator, a domain's check or a user function reached that way runs code the text does
//! not show; and a write runs the target table's triggers, rules, defaults, checks and index
//! expressions (its name comes with [`WRITE_PREFIX`]). Those names are returned in [`Proof::names`]; the pool checks them against the
//! database's own catalog (`pool::catalog`) and treats the text as unproven when one of them
//! is user code there.

use std::ops::ControlFlow;

use sqlparser::ast::{
    AccessExpr, ArrayElemTypeDef, DataType, Expr, FunctionArg, FunctionArgExpr, FunctionArguments,
    ObjectName, ObjectNamePart, Statement, TableFactor, Value, Visit, Visitor,
};
use sqlparser::dialect::PostgreSqlDialect;
use sqlparser::parser::Parser;

use super::calls::{Call, builtin};

/// Names a proven text depends on, at most this many (beyond it: unproven).
const MAX_NAMES: usize = 64;

/// Setting names that change how the rest of a text (or session) is read, or that seed
/// `random()` for the session (which no reset undoes).
pub const READING_SETTINGS: &[&str] = &[
    "standard_conforming_strings",
    "backslash_quote",
    "search_path",
    "client_encoding",
    "seed",
];

/// The prefix of a write target's name in [`Proof::names`] (`write pgbench_history`): a
/// space, which no unquoted name has.
pub const WRITE_PREFIX: &str = "write ";

/// [`Proof::unproven`]'s reason for a text sqlparser cannot parse.
pub const DOES_NOT_PARSE: &str = "does not parse";

/// The parse's verdict on one statement text.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Proof {
    /// Why the text is not proven; `None` when it is.
    pub unproven: Option<&'static str>,
    /// A proven text runs nothing but built-ins unless one of these names (lowercased
    /// relation names, attribute-notation fields, function names, operator symbols, cast type
    /// names) is user code in the database. Sorted, deduplicated; empty when unproven.
    pub names: Box<[Box<str>]>,
    /// The text calls `set_config` with a literal name: the session reads the name from the
    /// text itself ([`set_config_names`]), since texts of one shape share this value.
    pub set_config: bool,
    /// The text may change the catalog (DDL, `DO`, `CALL`, or it does not parse): what the
    /// pool knows of the database's user code is out of date after it.
    pub catalog_change: bool,
}

impl Proof {
    pub fn unproven(why: &'static str) -> Proof {
        Proof {
            unproven: Some(why),
            catalog_change: true,
            ..Proof::default()
        }
    }

    pub fn is_proven(&self) -> bool {
        self.unproven.is_none()
    }
}

/// Proves `sql` (see the module doc). `utf8`: the text arrived as valid UTF-8.
///
/// The verdict depends on the text's structure only, never on the contents of its plain
/// literals: texts of one shape (`shape.rs`) share it. The one literal that matters, a
/// `set_config` name, is read per text by the session ([`set_config_names`]).
pub fn prove(sql: &str, utf8: bool) -> Proof {
    let Ok(stmts) = Parser::parse_sql(&PostgreSqlDialect {}, sql) else {
        return Proof::unproven(DOES_NOT_PARSE);
    };
    let catalog_change = !stmts.iter().all(|s| {
        reads_or_writes(s)
            || session_or_control(s)
            || matches!(s, Statement::Set(_) | Statement::Execute { .. })
    });
    if !utf8 {
        return Proof {
            catalog_change,
            ..Proof::unproven("not UTF-8")
        };
    }
    let mut w = Walk::default();
    match stmts.visit(&mut w) {
        ControlFlow::Break(why) => Proof {
            catalog_change,
            ..Proof::unproven(why)
        },
        ControlFlow::Continue(()) => {
            let mut names = w.names;
            names.sort_unstable();
            names.dedup();
            Proof {
                unproven: None,
                names: names.into_boxed_slice(),
                set_config: w.set_config,
                catalog_change,
            }
        }
    }
}

/// The setting names of every `set_config` call in `sql`, lowercased, as Postgres reads
/// them (a plain literal; adjacent literals joined as the parser joins them); `None` when
/// the text does not parse or any name is not a plain literal.
pub fn set_config_names(sql: &str) -> Option<Vec<String>> {
    let stmts = Parser::parse_sql(&PostgreSqlDialect {}, sql).ok()?;
    let mut out = Vec::new();
    let found = stmts.visit(&mut SetConfigNames(&mut out));
    found.is_continue().then_some(out)
}

struct SetConfigNames<'a>(&'a mut Vec<String>);

impl SetConfigNames<'_> {
    fn call(&mut self, name: &ObjectName, args: &[FunctionArg]) -> ControlFlow<()> {
        let Some(base) = name.0.last().and_then(ObjectNamePart::as_ident) else {
            return ControlFlow::Continue(());
        };
        let folded = if base.quote_style.is_some() {
            base.value.clone()
        } else {
            base.value.to_ascii_lowercase()
        };
        if folded != "set_config" {
            return ControlFlow::Continue(());
        }
        match args.first() {
            Some(FunctionArg::Unnamed(FunctionArgExpr::Expr(Expr::Value(v)))) => match &v.value {
                Value::SingleQuotedString(s) => {
                    self.0.push(s.to_ascii_lowercase());
                    ControlFlow::Continue(())
                }
                _ => ControlFlow::Break(()),
            },
            _ => ControlFlow::Break(()),
        }
    }
}

impl Visitor for SetConfigNames<'_> {
    type Break = ();

    fn pre_visit_expr(&mut self, e: &Expr) -> ControlFlow<()> {
        match e {
            Expr::Function(f) => match &f.args {
                FunctionArguments::List(l) => self.call(&f.name, &l.args),
                _ => self.call(&f.name, &[]),
            },
            _ => ControlFlow::Continue(()),
        }
    }

    fn pre_visit_table_factor(&mut self, t: &TableFactor) -> ControlFlow<()> {
        match t {
            TableFactor::Table {
                name,
                args: Some(a),
                ..
            } => self.call(name, &a.args),
            TableFactor::Function { name, args, .. } => self.call(name, args),
            _ => ControlFlow::Continue(()),
        }
    }
}

#[derive(Default)]
struct Walk {
    names: Vec<Box<str>>,
    /// A `set_config` call with a literal name was proven: its name is read per text.
    set_config: bool,
}

/// Queries and writes: statements that change no catalog.
fn reads_or_writes(s: &Statement) -> bool {
    matches!(
        s,
        Statement::Query(_)
            | Statement::Insert(_)
            | Statement::Update(_)
            | Statement::Delete(_)
            | Statement::Merge(_)
            | Statement::Copy { .. }
    )
}

/// Transaction control, `RESET`, `SHOW`, `LISTEN`/`UNLISTEN`/`NOTIFY`, cursor statements,
/// SQL `PREPARE`/`DEALLOCATE`, `DISCARD` and `EXPLAIN` (of a statement walked on its own):
/// statements whose session effects the token walk reports.
fn session_or_control(s: &Statement) -> bool {
    matches!(
        s,
        Statement::StartTransaction { .. }
            | Statement::Commit { .. }
            | Statement::Rollback { .. }
            | Statement::Savepoint { .. }
            | Statement::ReleaseSavepoint { .. }
            | Statement::Reset(_)
            | Statement::ShowVariable { .. }
            | Statement::LISTEN { .. }
            | Statement::UNLISTEN { .. }
            | Statement::NOTIFY { .. }
            | Statement::Declare { .. }
            | Statement::Fetch { .. }
            | Statement::Close { .. }
            | Statement::Prepare { .. }
            | Statement::Deallocate { .. }
            | Statement::Discard { .. }
            | Statement::Explain { .. }
    )
}

/// Unproven when `o` names a setting of [`READING_SETTINGS`].
fn reading_setting(o: &ObjectName) -> ControlFlow<&'static str> {
    let named =
        o.0.last()
            .and_then(ObjectNamePart::as_ident)
            .is_some_and(|i| {
                READING_SETTINGS
                    .iter()
                    .any(|s| s.eq_ignore_ascii_case(&i.value))
            });
    if named {
        ControlFlow::Break("sets a setting that changes how statements are read")
    } else {
        ControlFlow::Continue(())
    }
}

impl Walk {
    fn name(&mut self, n: &str) -> ControlFlow<&'static str> {
        if self.names.len() >= MAX_NAMES {
            return ControlFlow::Break("too many names");
        }
        self.names.push(n.to_lowercase().into_boxed_str());
        ControlFlow::Continue(())
    }

    /// The table a write goes to: its write name (`write <name>`), which the pool's snapshot
    /// lists when a write to it runs user code (a trigger, a rule, a default, a check, an
    /// index expression, a cascade into such a table).
    fn write_target(&mut self, o: &ObjectName) -> ControlFlow<&'static str> {
        match o.0.last() {
            // The system's writable views (`pg_settings`: its rule calls `set_config`).
            Some(ObjectNamePart::Identifier(i))
                if i.value
                    .get(..3)
                    .is_some_and(|p| p.eq_ignore_ascii_case("pg_")) =>
            {
                ControlFlow::Break("writes to a system relation")
            }
            Some(ObjectNamePart::Identifier(i)) => self.name(&format!("{WRITE_PREFIX}{}", i.value)),
            _ => ControlFlow::Break("unfamiliar name"),
        }
    }

    /// The target of an UPDATE or DELETE (its read name comes from the table walk).
    fn write_factor(&mut self, t: &TableFactor) -> ControlFlow<&'static str> {
        match t {
            TableFactor::Table {
                name, args: None, ..
            } => self.write_target(name),
            _ => ControlFlow::Break("writes to an unfamiliar target"),
        }
    }

    /// An operator symbol (user operators are symbols; `AND`, `OR`, `NOT` are syntax).
    fn operator(&mut self, op: &str) -> ControlFlow<&'static str> {
        if op.bytes().any(|b| b.is_ascii_alphabetic()) {
            return ControlFlow::Continue(());
        }
        self.name(op)
    }

    fn ident(&mut self, i: &sqlparser::ast::Ident) -> ControlFlow<&'static str> {
        self.name(&i.value)
    }

    fn last_part(&mut self, o: &ObjectName) -> ControlFlow<&'static str> {
        match o.0.last() {
            Some(ObjectNamePart::Identifier(i)) => self.ident(i),
            _ => ControlFlow::Break("unfamiliar name"),
        }
    }

    fn data_type(&mut self, t: &DataType) -> ControlFlow<&'static str> {
        match t {
            DataType::Custom(o, _) => self.last_part(o),
            DataType::Array(
                ArrayElemTypeDef::SquareBracket(inner, _) | ArrayElemTypeDef::AngleBracket(inner),
            ) => self.data_type(inner),
            DataType::Array(_) => ControlFlow::Continue(()),
            // Every other variant is a built-in type sqlparser knows by name.
            _ => ControlFlow::Continue(()),
        }
    }

    /// A function call by name with its arguments.
    fn call(&mut self, name: &ObjectName, args: &[FunctionArg]) -> ControlFlow<&'static str> {
        let base = match name.0.as_slice() {
            [ObjectNamePart::Identifier(f)] => f,
            [ObjectNamePart::Identifier(s), ObjectNamePart::Identifier(f)]
                if s.value == "pg_catalog"
                    || (s.quote_style.is_none() && s.value.eq_ignore_ascii_case("pg_catalog")) =>
            {
                f
            }
            _ => return ControlFlow::Break("calls a function that is not a built-in"),
        };
        let folded;
        let fname = if base.quote_style.is_some() {
            base.value.as_str()
        } else {
            folded = base.value.to_ascii_lowercase();
            folded.as_str()
        };
        match builtin(fname) {
            Call::Harmless | Call::AdvisoryLock | Call::AdvisoryUnlock => {}
            Call::SetConfig => {
                set_config(args)?;
                self.set_config = true;
            }
            Call::Not | Call::Unknown => {
                return ControlFlow::Break("calls a function that is not a built-in");
            }
        }
        // A user function of the same name and other argument types may be the one chosen.
        self.name(fname)
    }
}

/// `set_config(name, value, is_local)`: proven only with a plain literal name and a literal
/// `is_local` (the name itself is checked per text by the session: [`set_config_names`]).
fn set_config(args: &[FunctionArg]) -> ControlFlow<&'static str> {
    let unnamed = |a: &FunctionArg| match a {
        FunctionArg::Unnamed(FunctionArgExpr::Expr(e)) => Some(e.clone()),
        _ => None,
    };
    let [name, _, local] = args else {
        return ControlFlow::Break("set_config with other arguments");
    };
    let literal_name = match unnamed(name) {
        Some(Expr::Value(v)) => match v.value {
            Value::SingleQuotedString(s) => Some(s),
            _ => None,
        },
        _ => None,
    };
    if literal_name.is_none() {
        return ControlFlow::Break("set_config of a name that is not a plain literal");
    }
    match unnamed(local) {
        Some(Expr::Value(v)) if matches!(v.value, Value::Boolean(_)) => ControlFlow::Continue(()),
        _ => ControlFlow::Break("set_config with an is_local that is not a literal"),
    }
}

impl Visitor for Walk {
    type Break = &'static str;

    fn pre_visit_statement(&mut self, s: &Statement) -> ControlFlow<Self::Break> {
        match s {
            Statement::Query(q) => {
                if let sqlparser::ast::SetExpr::Select(sel) = q.body.as_ref()
                    && sel.into.is_some()
                {
                    return ControlFlow::Break("SELECT INTO creates a table");
                }
                ControlFlow::Continue(())
            }
            Statement::Set(set) => match set {
                sqlparser::ast::Set::SingleAssignment { variable, .. } => reading_setting(variable),
                sqlparser::ast::Set::ParenthesizedAssignments { variables, .. } => {
                    variables.iter().try_for_each(reading_setting)
                }
                sqlparser::ast::Set::MultipleAssignments { assignments } => assignments
                    .iter()
                    .try_for_each(|a| reading_setting(&a.name)),
                sqlparser::ast::Set::SetNames { .. } | sqlparser::ast::Set::SetNamesDefault {} => {
                    ControlFlow::Break("sets the client encoding")
                }
                _ => ControlFlow::Continue(()),
            },
            s if session_or_control(s) => ControlFlow::Continue(()),
            Statement::Insert(i) => match &i.table {
                sqlparser::ast::TableObject::TableName(o) => {
                    // Row security applies to the target too (a read name), and its
                    // triggers, defaults, rules and checks to the write (a write name).
                    self.last_part(o)?;
                    self.write_target(o)
                }
                _ => ControlFlow::Break("writes through a table function"),
            },
            Statement::Update(u) => self.write_factor(&u.table.relation),
            Statement::Delete(d) => {
                if !d.tables.is_empty() {
                    return ControlFlow::Break("a multi-table DELETE");
                }
                let (sqlparser::ast::FromTable::WithFromKeyword(from)
                | sqlparser::ast::FromTable::WithoutKeyword(from)) = &d.from;
                from.iter().try_for_each(|t| self.write_factor(&t.relation))
            }
            s if reads_or_writes(s) => ControlFlow::Break("MERGE and COPY are not proven"),
            _ => ControlFlow::Break("a statement the parse does not prove"),
        }
    }

    fn pre_visit_query(&mut self, q: &sqlparser::ast::Query) -> ControlFlow<Self::Break> {
        // `FOR UPDATE OF t`: the names are relations, checked like any other.
        for l in &q.locks {
            if let Some(o) = &l.of {
                self.last_part(o)?;
            }
        }
        ControlFlow::Continue(())
    }

    fn pre_visit_table_factor(&mut self, t: &TableFactor) -> ControlFlow<Self::Break> {
        match t {
            TableFactor::Table {
                name, args: None, ..
            } => self.last_part(name),
            TableFactor::Table {
                name,
                args: Some(a),
                ..
            } => self.call(name, &a.args),
            TableFactor::Function { name, args, .. } => self.call(name, args),
            TableFactor::Derived { .. }
            | TableFactor::NestedJoin { .. }
            | TableFactor::UNNEST { .. }
            | TableFactor::TableFunction { .. } => ControlFlow::Continue(()),
            _ => ControlFlow::Break("an unfamiliar table form"),
        }
    }

    fn pre_visit_expr(&mut self, e: &Expr) -> ControlFlow<Self::Break> {
        match e {
            Expr::Function(f) => {
                let args: &[FunctionArg] = match &f.args {
                    FunctionArguments::None => &[],
                    FunctionArguments::List(l) => &l.args,
                    FunctionArguments::Subquery(_) => {
                        return ControlFlow::Break("a function over a subquery");
                    }
                };
                if !matches!(f.parameters, FunctionArguments::None) {
                    return ControlFlow::Break("an unfamiliar call form");
                }
                self.call(&f.name, args)
            }
            // Attribute notation: `t.f` may be `f(t)`.
            Expr::CompoundIdentifier(parts) => {
                for p in parts.iter().skip(1) {
                    self.ident(p)?;
                }
                ControlFlow::Continue(())
            }
            Expr::CompoundFieldAccess { access_chain, .. } => {
                for a in access_chain {
                    match a {
                        AccessExpr::Dot(Expr::Identifier(i)) => self.ident(i)?,
                        AccessExpr::Dot(_) => {
                            return ControlFlow::Break("an unfamiliar field access");
                        }
                        AccessExpr::Subscript(_) => {}
                    }
                }
                ControlFlow::Continue(())
            }
            Expr::Cast { data_type, .. } => self.data_type(data_type),
            Expr::TypedString(t) => self.data_type(&t.data_type),
            Expr::BinaryOp { op, .. } => match op {
                sqlparser::ast::BinaryOperator::PGCustomBinaryOperator(_) => {
                    ControlFlow::Break("an OPERATOR(...) call")
                }
                op => self.operator(&op.to_string()),
            },
            Expr::AnyOp { compare_op, .. } | Expr::AllOp { compare_op, .. } => {
                self.operator(&compare_op.to_string())
            }
            Expr::UnaryOp { op, .. } => self.operator(&op.to_string()),
            Expr::Identifier(_)
            | Expr::Value(_)
            | Expr::Nested(_)
            | Expr::IsFalse(_)
            | Expr::IsNotFalse(_)
            | Expr::IsTrue(_)
            | Expr::IsNotTrue(_)
            | Expr::IsNull(_)
            | Expr::IsNotNull(_)
            | Expr::IsUnknown(_)
            | Expr::IsNotUnknown(_)
            | Expr::IsDistinctFrom(..)
            | Expr::IsNotDistinctFrom(..)
            | Expr::In { .. }
            | Expr::Between { .. }
            | Expr::Like { .. }
            | Expr::ILike { .. }
            | Expr::SimilarTo { .. }
            | Expr::AtTimeZone { .. }
            | Expr::Extract { .. }
            | Expr::Ceil { .. }
            | Expr::Floor { .. }
            | Expr::Position { .. }
            | Expr::Substring { .. }
            | Expr::Trim { .. }
            | Expr::Overlay { .. }
            | Expr::Collate { .. }
            | Expr::Case { .. }
            | Expr::Exists { .. }
            | Expr::Subquery(_)
            | Expr::GroupingSets(_)
            | Expr::Cube(_)
            | Expr::Rollup(_)
            | Expr::Tuple(_)
            | Expr::Array(_)
            | Expr::Interval(_)
            | Expr::Wildcard(_)
            | Expr::QualifiedWildcard(..) => ControlFlow::Continue(()),
            _ => ControlFlow::Break("an unfamiliar expression"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(sql: &str) -> Vec<String> {
        let p = prove(sql, true);
        assert!(p.is_proven(), "{sql}: unproven ({:?})", p.unproven);
        p.names.iter().map(|s| s.to_string()).collect()
    }

    fn unproven(sql: &str) {
        assert!(!prove(sql, true).is_proven(), "proven: {sql}");
    }

    #[test]
    fn plain_reads_are_proven_with_the_names_they_depend_on() {
        assert_eq!(
            names("SELECT abalance FROM pgbench_accounts WHERE aid = $1"),
            ["=", "pgbench_accounts"]
        );
        assert_eq!(names("select 1"), Vec::<String>::new());
        assert_eq!(
            names("SELECT count(*), lower(u.name) FROM users u WHERE u.id IN (1, 2)"),
            ["count", "id", "lower", "name", "users"]
        );
        assert_eq!(names("BEGIN; SELECT now(); COMMIT"), ["now"]);
        // The SQL-standard value functions (no parentheses) are built-ins too.
        assert_eq!(
            names("INSERT INTO h (a, t, u) VALUES (1, CURRENT_TIMESTAMP, current_user)"),
            ["current_timestamp", "current_user", "h", "write h"]
        );
        assert_eq!(names("SELECT x::my_domain FROM t"), ["my_domain", "t"]);
        for ok in [
            "SET statement_timeout = 5",
            "SET LOCAL lock_timeout = '1s'",
            "RESET ALL",
            "SHOW work_mem",
            "LISTEN jobs",
            "DISCARD ALL",
            "SELECT set_config('app.tenant', '5', false)",
            "SELECT pg_catalog.set_config('app.tenant', $1, true)",
            "SELECT pg_advisory_lock(1)",
            "SELECT * FROM generate_series(1, 3) g",
            "WITH x AS (SELECT 1 AS a) SELECT a FROM x",
        ] {
            assert!(prove(ok, true).is_proven(), "{ok}: {:?}", prove(ok, true));
        }
    }

    /// The spellings a token scan was talked around by: each is unproven here.
    #[test]
    fn hostile_spellings_are_unproven() {
        for sql in [
            // A quoted, qualified call with an alias or a column-definition list.
            r#"SELECT * FROM "public"."set_tenant"(5) AS t"#,
            r#"SELECT * FROM "public"."f"() AS t(a int)"#,
            r#"WITH x AS (SELECT 1) SELECT "public"."set_tenant"(5) AS x"#,
            "SELECT public.set_tenant(5)",
            r#"SELECT "Lower"('x')"#,
            // Built names.
            "SELECT set_config('app.' || 'tenant', '5', false)",
            "SELECT set_config('app.'\n'tenant', '5', false)",
            r"SELECT set_config(E'app.\x74enant', '5', false)",
            "SELECT set_config($1, '5', false)",
            "SELECT set_config('app.tenant', '5', $1)",
            "SET search_path = evil, pg_catalog",
            "SET LOCAL standard_conforming_strings = off",
            "SELECT setseed(0.5)",
            // Catalog views that write, and writes in general.
            "MERGE INTO t USING u ON t.a = u.a WHEN MATCHED THEN DELETE",
            "UPDATE pg_settings SET setting = 'x' WHERE name = 'search_path'",
            "SELECT * INTO newt FROM t",
            "COPY t FROM STDIN",
            // Everything else.
            "DO $$ BEGIN PERFORM set_config('a.b', 'c', false); END $$",
            "CALL p()",
            "EXECUTE s1",
            "CREATE VIEW v AS SELECT 1",
            "SELECT 1 OPERATOR(public.===) 2",
            "SELECT f(t) FROM t",
            "SELECT * FROM t WHERE",
        ] {
            unproven(sql);
        }
        assert!(!prove("SELECT 1", false).is_proven());
    }

    #[test]
    fn what_may_change_the_catalog_is_marked() {
        for (sql, change) in [
            ("SELECT 1", false),
            (
                "MERGE INTO t USING u ON t.a = u.a WHEN MATCHED THEN DELETE",
                false,
            ),
            ("INSERT INTO t VALUES (1)", false),
            ("BEGIN; UPDATE t SET a = 1; COMMIT", false),
            ("CREATE VIEW v AS SELECT 1", true),
            (
                "INSERT INTO t VALUES (1); CREATE FUNCTION f() RETURNS int AS 'select 1' LANGUAGE sql",
                true,
            ),
            ("DO $$ BEGIN END $$", true),
            ("ALTER TABLE t ENABLE ROW LEVEL SECURITY", true),
            ("SELEKT", true),
        ] {
            assert_eq!(prove(sql, true).catalog_change, change, "{sql}");
        }
    }

    /// A write is proven with its target's write name (what the pool checks for triggers,
    /// rules, defaults).
    #[test]
    fn writes_name_their_target() {
        assert_eq!(
            names("INSERT INTO t (a) VALUES ($1) ON CONFLICT (a) DO UPDATE SET a = excluded.a"),
            ["a", "t", "write t"]
        );
        assert_eq!(
            names("UPDATE pgbench_accounts SET abalance = abalance + $1 WHERE aid = $2"),
            ["+", "=", "pgbench_accounts", "write pgbench_accounts"]
        );
        assert_eq!(
            names("WITH d AS (DELETE FROM s.t WHERE a = 1 RETURNING *) SELECT * FROM d"),
            ["=", "d", "t", "write t"]
        );
        // A system view's rule calls set_config: never proven.
        unproven("UPDATE pg_settings SET setting = 'x' WHERE name = 'search_path'");
        unproven("UPDATE pg_catalog.pg_settings SET setting = 'x' WHERE name = 'search_path'");
    }

    #[test]
    fn attribute_notation_names_the_field() {
        assert_eq!(names("SELECT t.f FROM t"), ["f", "t"]);
        assert_eq!(names("SELECT s.t.c FROM s.t"), ["c", "t"]);
        assert!(names("SELECT (t).f FROM t").contains(&"f".to_string()));
    }

    /// A set_config name is read per text, as Postgres reads it.
    #[test]
    fn set_config_names_are_read_as_postgres_reads_them() {
        let n = |s: &str| set_config_names(s);
        assert_eq!(
            n(
                "SELECT set_config('App.Tenant', $1, false), pg_catalog.set_config('x.y', 'v', true)"
            ),
            Some(vec!["app.tenant".into(), "x.y".into()])
        );
        assert_eq!(
            n("SELECT set_config('it''s', 'v', false)"),
            Some(vec!["it's".into()])
        );
        assert_eq!(n("SELECT set_config('a.' || 'b', 'v', false)"), None);
        assert_eq!(n(r"SELECT set_config(E'a\x2eb', 'v', false)"), None);
        assert_eq!(n("SELECT set_config($1, 'v', false)"), None);
        assert_eq!(n("SELECT 'set_config(x)'"), Some(vec![]));
        let p = prove("SELECT set_config('search_path', 'evil', true)", true);
        assert!(
            p.is_proven() && p.set_config,
            "the name is the session's to read"
        );
    }
}
