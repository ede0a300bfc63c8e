//! Whether the limits' Redis keeps spend across its own restart. Budgets and
//! spend live in Redis's memory: without AOF or RDB snapshots a restarted
//! Redis starts every budget again at zero, silently. Asked once at start
//! (`INFO persistence`, and `CONFIG GET save` for RDB save points, which
//! `INFO` does not show) and said in a log line; see docs/operations.md,
//! "Spend persistence".

use redis::aio::ConnectionManager;

/// What a Redis restart keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Durability {
    /// Append-only file: at most the last `appendfsync` interval is lost.
    Aof,
    /// RDB snapshots only: everything since the last snapshot is lost.
    Snapshots,
    /// Neither: every budget starts again at zero.
    Nothing,
    /// AOF off, and the save points could not be read (`CONFIG` refused).
    AofOffSnapshotsUnknown,
}

/// From `INFO persistence`'s text and `CONFIG GET save`'s value (`None`:
/// refused). `None` overall: the INFO text says nothing about AOF.
pub(super) fn classify(info: &str, save: Option<&str>) -> Option<Durability> {
    let aof = info
        .lines()
        .find_map(|l| l.trim().strip_prefix("aof_enabled:"))?;
    Some(match (aof.trim() == "1", save.map(str::trim)) {
        (true, _) => Durability::Aof,
        (false, None) => Durability::AofOffSnapshotsUnknown,
        (false, Some("")) => Durability::Nothing,
        (false, Some(_)) => Durability::Snapshots,
    })
}

/// Ask Redis once, in the background, and log what a restart of it loses.
pub(super) fn check_in_background(conn: ConnectionManager) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    rt.spawn(async move {
        let mut conn = conn;
        let info: redis::RedisResult<String> =
            redis::cmd("INFO").arg("persistence").query_async(&mut conn).await;
        let info = match info {
            Ok(i) => i,
            Err(e) => {
                tracing::warn!(error = %e, "limits store (Redis): could not ask whether it persists spend (INFO persistence)");
                return;
            }
        };
        let save: redis::RedisResult<Vec<String>> =
            redis::cmd("CONFIG").arg("GET").arg("save").query_async(&mut conn).await;
        let save = save.ok().and_then(|v| v.get(1).cloned());
        report(classify(&info, save.as_deref()));
    });
}

fn report(d: Option<Durability>) {
    const SEE: &str = "set `appendonly yes` (docs/operations.md, Spend persistence)";
    match d {
        Some(Durability::Aof) => {
            tracing::info!("limits store (Redis) persists spend: append-only file on");
        }
        Some(Durability::Snapshots) => tracing::warn!(
            "limits store (Redis) persists spend only in RDB snapshots: spend since the last snapshot is lost on a Redis restart (tenants may spend it again); {SEE}"
        ),
        Some(Durability::Nothing) => tracing::warn!(
            "limits store (Redis) has neither AOF nor RDB snapshots: budgets and spend are lost on a Redis restart (every tenant may spend its budgets again); {SEE}"
        ),
        Some(Durability::AofOffSnapshotsUnknown) => tracing::warn!(
            "limits store (Redis) has AOF off and refused `CONFIG GET save`: budgets and spend may be lost on a Redis restart; {SEE}"
        ),
        None => tracing::warn!(
            "limits store (Redis): INFO persistence did not say whether AOF is on; budgets and spend may be lost on a Redis restart"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OFF: &str = "# Persistence\r\nloading:0\r\naof_enabled:0\r\nrdb_saves:0\r\n";
    const ON: &str = "# Persistence\r\naof_enabled:1\r\n";

    #[test]
    fn aof_then_save_points_decide() {
        assert_eq!(classify(ON, Some("")), Some(Durability::Aof));
        assert_eq!(classify(OFF, Some("")), Some(Durability::Nothing));
        assert_eq!(
            classify(OFF, Some("3600 1 300 100")),
            Some(Durability::Snapshots)
        );
        assert_eq!(
            classify(OFF, None),
            Some(Durability::AofOffSnapshotsUnknown)
        );
        assert_eq!(classify("# Persistence\r\n", Some("")), None);
    }
}
