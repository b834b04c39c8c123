//! A cluster and a transaction-mode proxy started with a YAML config file written to a temp
//! dir — what most policy-level tests need. Field order is drop order: proxy, cluster, dir.

use super::pg::Cluster;
use super::proxy::{Proxy, ProxyOptions};

pub struct Env {
    pub proxy: Proxy,
    pub cluster: Cluster,
    _dir: tempfile::TempDir,
}

impl Env {
    /// A cluster (after `prepare` ran on it) and a proxy with `pool` backends and `yaml`.
    pub fn start(pool: usize, yaml: &str, prepare: impl FnOnce(&Cluster)) -> Env {
        let dir = tempfile::Builder::new()
            .prefix("pgsluice-env-")
            .tempdir()
            .expect("temp dir for the config");
        let config = dir.path().join("pgsluice.yaml");
        std::fs::write(&config, yaml).expect("write the config");
        let cluster = Cluster::start();
        prepare(&cluster);
        let proxy = Proxy::start(&cluster, ProxyOptions::pool(pool).config_file(&config));
        Env {
            proxy,
            cluster,
            _dir: dir,
        }
    }
}
