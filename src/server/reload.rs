//! Reload triggers: SIGHUP, and (when `server.watch_config` is on) a change of the
//! config file's modification time. The admin API calls `Gateway::reload` directly.

use super::Gateway;
use crate::config::{Config, ConfigError};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Produces the config to switch to.
pub type Reloader = Box<dyn Fn() -> Result<Config, ConfigError> + Send + Sync>;

/// How often the config file's modification time is checked when watching.
const WATCH_EVERY: Duration = Duration::from_secs(1);

pub fn spawn_reload_triggers(gw: Arc<Gateway>, file: Option<PathBuf>) {
    #[cfg(unix)]
    {
        let gw = gw.clone();
        tokio::spawn(async move {
            use tokio::signal::unix::{signal, SignalKind};
            let Ok(mut hup) = signal(SignalKind::hangup()) else {
                return;
            };
            while hup.recv().await.is_some() {
                tracing::info!("SIGHUP: reloading configuration");
                let _ = gw.reload();
            }
        });
    }
    if let Some(path) = file {
        tokio::spawn(async move {
            let mtime = |p: &PathBuf| std::fs::metadata(p).and_then(|m| m.modified()).ok();
            let mut last = mtime(&path);
            loop {
                tokio::time::sleep(WATCH_EVERY).await;
                if !gw.registry.config().server.watch_config {
                    continue;
                }
                let now = mtime(&path);
                if now != last {
                    last = now;
                    tracing::info!(file = %path.display(), "config file changed: reloading");
                    let _ = gw.reload();
                }
            }
        });
    }
}
