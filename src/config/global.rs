//! Global routing configuration: the gateway's own region (`server.region`),
//! declared regions with their spill order and round-trip times (`[regions.NAME]`),
//! the locality hysteresis (`[locality]`), residency zones (`[residency]`) and
//! weighted splits of one model name over several pools (`[[splits]]`).
//!
//! Regions are turned into small integer ids (in name order) so that routing tests
//! a worker's region against a request's allowed set with one bit operation.

use super::key::Key;
use super::Problems;
use serde::Deserialize;
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

/// Most regions a configuration may declare (a [`RegionSet`] is a 64-bit mask).
pub const MAX_REGIONS: usize = 64;
/// Default locality high watermark: the local tier's mean load (as a share of
/// each worker's capacity) at which new requests start spilling to other regions.
pub const DEFAULT_HIGH_WATERMARK: f64 = 0.8;
/// Default low watermark: spilling ends once the local load stays below this.
pub const DEFAULT_LOW_WATERMARK: f64 = 0.5;
/// Default time the local tier must stay healthy and under the low watermark
/// before traffic returns to it (ms).
pub const DEFAULT_MIN_DWELL_MS: u64 = 2_000;
/// Worker label naming its region.
pub const REGION_LABEL: &str = "region";

// ---- Raw (serde) shapes ----

/// `[locality]`: when traffic leaves the gateway's region and when it returns.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLocality {
    /// Spill when the local tier's mean load reaches this share of capacity.
    pub high_watermark: Option<f64>,
    /// Return when the local load has stayed below this share for `min_dwell_ms`.
    pub low_watermark: Option<f64>,
    /// How long the local tier must stay calm (healthy, under the low watermark)
    /// before traffic returns (ms).
    pub min_dwell_ms: Option<u64>,
}

/// `[regions.NAME]`: one declared region.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRegion {
    /// Regions a gateway in this region spills to, in order.
    #[serde(default)]
    pub spill_order: Vec<String>,
    /// Round-trip time from this region to others (ms); the matrix is symmetric
    /// (a pair given on either side counts for both directions).
    #[serde(default)]
    pub rtt_ms: BTreeMap<String, u32>,
}

/// `[[splits]]`: one model name served by several pools by weight.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSplit {
    pub model: String,
    #[serde(default)]
    pub targets: Vec<RawSplitTarget>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSplitTarget {
    pub pool: String,
    pub weight: f64,
}

// ---- Typed ----

/// Index of a declared region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionId(pub u8);

/// A set of declared regions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RegionSet(pub u64);

impl RegionSet {
    pub const EMPTY: RegionSet = RegionSet(0);

    pub fn of(ids: impl IntoIterator<Item = RegionId>) -> RegionSet {
        RegionSet(ids.into_iter().fold(0, |m, r| m | (1u64 << r.0)))
    }

    /// Whether `region` is in the set; a worker without a (declared) region never is.
    #[inline]
    pub fn contains(self, region: Option<RegionId>) -> bool {
        region.is_some_and(|r| self.0 & (1u64 << r.0) != 0)
    }

    pub fn intersect(self, other: RegionSet) -> RegionSet {
        RegionSet(self.0 & other.0)
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    pub fn iter(self) -> impl Iterator<Item = RegionId> {
        (0..64u8)
            .filter(move |i| self.0 & (1u64 << i) != 0)
            .map(RegionId)
    }
}

/// A residency constraint: the regions a request may be served in, and the name
/// it was given (a zone from `[residency]`, a region, or a list of regions).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Residency {
    pub name: Arc<str>,
    pub regions: RegionSet,
}

impl Residency {
    /// Whether a worker in `region` may serve a request under this residency; a
    /// worker without a (declared) region never may. The one residency check.
    #[inline]
    pub fn admits(&self, region: Option<RegionId>) -> bool {
        self.regions.contains(region)
    }
}

/// One declared region.
#[derive(Clone, Debug, PartialEq)]
pub struct RegionConfig {
    pub name: Arc<str>,
    /// Where a gateway in this region spills, in order.
    pub spill_order: Vec<RegionId>,
    /// Round-trip time to each region by id (symmetric; `None` when not configured;
    /// `Some(0)` to itself).
    pub rtt_ms: Vec<Option<u32>>,
}

/// `[locality]`, validated.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LocalityConfig {
    pub high_watermark: f64,
    pub low_watermark: f64,
    pub min_dwell: Duration,
}

impl Default for LocalityConfig {
    fn default() -> Self {
        LocalityConfig {
            high_watermark: DEFAULT_HIGH_WATERMARK,
            low_watermark: DEFAULT_LOW_WATERMARK,
            min_dwell: Duration::from_millis(DEFAULT_MIN_DWELL_MS),
        }
    }
}

/// One weighted split: requests for `model` go to one of the target pools.
#[derive(Clone, Debug, PartialEq)]
pub struct SplitConfig {
    pub model: String,
    /// (pool name, weight ≥ 0); the weights sum to more than 0.
    pub targets: Vec<(String, f64)>,
}

/// Everything about regions, residency and splits.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GlobalConfig {
    /// This gateway's region (`server.region`, `--region`).
    pub region: Option<RegionId>,
    /// Declared regions, indexed by [`RegionId`].
    pub regions: Vec<RegionConfig>,
    /// Named residency zones.
    pub zones: Vec<Residency>,
    pub locality: LocalityConfig,
    pub splits: Vec<SplitConfig>,
}

impl GlobalConfig {
    pub fn region_id(&self, name: &str) -> Option<RegionId> {
        self.regions
            .iter()
            .position(|r| &*r.name == name)
            .map(|i| RegionId(i as u8))
    }

    pub fn region_name(&self, id: RegionId) -> &Arc<str> {
        &self.regions[id.0 as usize].name
    }

    /// The round-trip time between two regions, when configured.
    pub fn rtt_ms(&self, from: RegionId, to: RegionId) -> Option<u32> {
        self.regions.get(from.0 as usize)?.rtt_ms[to.0 as usize]
    }

    /// Every declared region.
    pub fn all_regions(&self) -> RegionSet {
        RegionSet::of((0..self.regions.len()).map(|i| RegionId(i as u8)))
    }

    /// The residency a value names: a zone from `[residency]`, else one region or a
    /// comma-separated list of regions. `None` when any part is unknown.
    pub fn residency(&self, value: &str) -> Option<Residency> {
        let value = value.trim();
        if let Some(z) = self.zones.iter().find(|z| &*z.name == value) {
            return Some(z.clone());
        }
        let mut set = RegionSet::EMPTY;
        for part in value.split(',') {
            set = RegionSet(set.0 | RegionSet::of([self.region_id(part.trim())?]).0);
        }
        Some(Residency {
            name: Arc::from(value),
            regions: set,
        })
    }

    /// `a, b, c`: the names of the regions in `set`, for messages.
    pub fn names(&self, set: RegionSet) -> String {
        set.iter()
            .filter_map(|r| self.regions.get(r.0 as usize))
            .map(|r| &*r.name)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The raw sections validated here.
pub struct GlobalRaw<'a> {
    pub server_region: Option<String>,
    pub regions: BTreeMap<String, RawRegion>,
    pub residency: BTreeMap<String, Vec<String>>,
    pub locality: RawLocality,
    pub splits: Vec<RawSplit>,
    /// Pool names, for split targets.
    pub pools: &'a [&'a str],
    /// Model names, aliases and adapters served by pools (a split may not reuse one).
    pub models: &'a HashSet<String>,
}

fn region_name_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("must not be empty")
    } else if name.contains(',') || name.chars().any(char::is_whitespace) {
        Some("must not contain commas or whitespace")
    } else {
        None
    }
}

/// The declared region names (at most [`MAX_REGIONS`], in name order): a
/// region's id is its position.
struct Declared<'a>(Vec<&'a String>);

impl Declared<'_> {
    fn id(&self, name: &str) -> Option<RegionId> {
        self.0
            .iter()
            .position(|x| x.as_str() == name)
            .map(|i| RegionId(i as u8))
    }

    /// `a, b, c`, for messages about an unknown region.
    fn list(&self) -> String {
        if self.0.is_empty() {
            "none; declare regions as [regions.NAME] tables".to_string()
        } else {
            let names: Vec<&str> = self.0.iter().map(|s| s.as_str()).collect();
            names.join(", ")
        }
    }
}

/// Validate the global sections, pushing problems that name their keys.
pub(crate) fn validate(raw: GlobalRaw<'_>, p: &mut Problems) -> GlobalConfig {
    if raw.regions.len() > MAX_REGIONS {
        p.push(format!(
            "regions: at most {MAX_REGIONS} regions may be declared (got {})",
            raw.regions.len()
        ));
    }
    let declared = Declared(raw.regions.keys().take(MAX_REGIONS).collect());
    let regions = validate_regions(&raw.regions, &declared, p);
    // `regions` rejected while reading: no region is declared, and references
    // to one are not reported again.
    let regions_lost = p.rejected_at("regions");
    let region = raw
        .server_region
        .as_deref()
        .and_then(|r| match declared.id(r) {
            Some(id) => Some(id),
            None if regions_lost => None,
            None => {
                let known = declared.list();
                p.push(format!(
                    "server.region: unknown region `{r}` (declared: {known})"
                ));
                None
            }
        });
    let zones = validate_zones(&raw.residency, &declared, regions_lost, p);
    GlobalConfig {
        region,
        regions,
        zones,
        locality: validate_locality(raw.locality, p),
        splits: validate_splits(raw.splits, raw.models, raw.pools, p),
    }
}

/// `[regions.NAME]`: names, spill orders and the (symmetric) round-trip matrix.
fn validate_regions(
    raw: &BTreeMap<String, RawRegion>,
    declared: &Declared<'_>,
    p: &mut Problems,
) -> Vec<RegionConfig> {
    let n = declared.0.len();
    let mut regions: Vec<RegionConfig> = declared
        .0
        .iter()
        .map(|name| RegionConfig {
            name: Arc::from(name.as_str()),
            spill_order: Vec::new(),
            rtt_ms: vec![None; n],
        })
        .collect();
    for (i, (name, r)) in raw.iter().take(MAX_REGIONS).enumerate() {
        let key = Key::new("regions").field(name);
        if let Some(why) = region_name_problem(name) {
            p.push(format!("{key}: a region name {why}"));
        }
        let order = spill_order(&key.field("spill_order"), i, &r.spill_order, declared, p);
        regions[i].spill_order = order;
        for (to, &ms) in &r.rtt_ms {
            let at = key.field("rtt_ms").field(to);
            match declared.id(to) {
                None => p.push(format!(
                    "{at}: unknown region `{to}` (declared: {})",
                    declared.list()
                )),
                Some(t) if t.0 as usize == i => {
                    p.push(format!("{at}: the round trip to itself is 0"))
                }
                Some(t) => {
                    let j = t.0 as usize;
                    let other = raw[to.as_str()].rtt_ms.get(name.as_str());
                    if other.is_some_and(|&o| o != ms) && name.as_str() < to.as_str() {
                        p.push(format!(
                            "{at}: {ms} ms here but {} ms in regions.{to}.rtt_ms.{name}",
                            other.copied().unwrap_or(0)
                        ));
                    }
                    regions[i].rtt_ms[j] = Some(ms);
                    regions[j].rtt_ms[i] = Some(ms);
                }
            }
        }
    }
    for (i, r) in regions.iter_mut().enumerate() {
        r.rtt_ms[i] = Some(0);
    }
    regions
}

/// The spill order (`key`) of region `i`: declared regions, not itself, each once.
fn spill_order(
    key: &Key,
    i: usize,
    raw: &[String],
    declared: &Declared<'_>,
    p: &mut Problems,
) -> Vec<RegionId> {
    let mut order = Vec::new();
    for (j, s) in raw.iter().enumerate() {
        let at = key.index(j);
        match declared.id(s) {
            None => p.push(format!(
                "{at}: unknown region `{s}` (declared: {})",
                declared.list()
            )),
            Some(t) if t.0 as usize == i => {
                p.push(format!("{at}: a region cannot spill to itself"))
            }
            Some(t) if order.contains(&t) => p.push(format!("{at}: `{s}` listed twice")),
            Some(t) => order.push(t),
        }
    }
    order
}

/// `[residency]`: zone name → declared regions.
fn validate_zones(
    raw: &BTreeMap<String, Vec<String>>,
    declared: &Declared<'_>,
    regions_lost: bool,
    p: &mut Problems,
) -> Vec<Residency> {
    let mut zones = Vec::new();
    for (zone, list) in raw {
        let key = Key::new("residency").field(zone);
        if let Some(why) = region_name_problem(zone) {
            p.push(format!("{key}: a zone name {why}"));
        }
        if declared.id(zone).is_some() {
            p.push(format!(
                "{key}: a zone may not be named like a region (a region name already means that region)"
            ));
        }
        if list.is_empty() {
            p.push(format!("{key}: a zone needs at least one region"));
        }
        let mut set = RegionSet::EMPTY;
        for (j, r) in list.iter().enumerate() {
            match declared.id(r) {
                Some(r) => set = RegionSet(set.0 | RegionSet::of([r]).0),
                None if regions_lost => {}
                None => p.push(format!(
                    "{}: unknown region `{r}` (declared: {})",
                    key.index(j),
                    declared.list()
                )),
            }
        }
        zones.push(Residency {
            name: Arc::from(zone.as_str()),
            regions: set,
        });
    }
    zones
}

/// `[locality]`; the defaults when a watermark is rejected.
fn validate_locality(l: RawLocality, p: &mut Problems) -> LocalityConfig {
    let high = l.high_watermark.unwrap_or(DEFAULT_HIGH_WATERMARK);
    let low = l.low_watermark.unwrap_or(DEFAULT_LOW_WATERMARK);
    let mut ok = true;
    for (name, v) in [("high_watermark", high), ("low_watermark", low)] {
        if !(v.is_finite() && v > 0.0) {
            p.push(format!(
                "locality.{name}: must be a finite number > 0 (got {v})"
            ));
            ok = false;
        }
    }
    if ok && low > high {
        p.push(format!(
            "locality.low_watermark: must not exceed high_watermark ({high}), got {low}"
        ));
        ok = false;
    }
    if !ok {
        return LocalityConfig::default();
    }
    LocalityConfig {
        high_watermark: high,
        low_watermark: low,
        min_dwell: Duration::from_millis(l.min_dwell_ms.unwrap_or(DEFAULT_MIN_DWELL_MS)),
    }
}

/// `[[splits]]`: a model name of its own, spread over existing pools by weight.
fn validate_splits(
    raw: Vec<RawSplit>,
    models: &HashSet<String>,
    pools: &[&str],
    p: &mut Problems,
) -> Vec<SplitConfig> {
    let mut splits: Vec<SplitConfig> = Vec::new();
    for (i, s) in raw.into_iter().enumerate() {
        let key = Key::new("splits").index(i);
        let model = key.field("model");
        if s.model.is_empty() {
            p.push(format!("{model}: must not be empty"));
        } else if models.contains(&s.model) {
            p.push(format!(
                "{model}: `{}` is already served by a pool; a split needs a name of its own",
                s.model
            ));
        } else if splits.iter().any(|o| o.model == s.model) {
            p.push(format!("{model}: duplicate split `{}`", s.model));
        }
        let targets = split_targets(&key.field("targets"), s.targets, pools, p);
        splits.push(SplitConfig {
            model: s.model,
            targets,
        });
    }
    splits
}

/// A split's targets (`key`): known pools, each once, weights ≥ 0 not all 0.
fn split_targets(
    key: &Key,
    raw: Vec<RawSplitTarget>,
    pools: &[&str],
    p: &mut Problems,
) -> Vec<(String, f64)> {
    if raw.is_empty() {
        p.push(format!("{key}: a split needs at least one target"));
    }
    let mut targets: Vec<(String, f64)> = Vec::new();
    for (j, t) in raw.into_iter().enumerate() {
        let at = key.index(j);
        if !pools.contains(&t.pool.as_str()) {
            if !p.rejected_at("pools") {
                let why = super::no_pool(&t.pool, pools);
                p.push(format!("{}: {why}", at.field("pool")));
            }
        } else if targets.iter().any(|(n, _)| *n == t.pool) {
            p.push(format!("{}: `{}` listed twice", at.field("pool"), t.pool));
        }
        if !(t.weight.is_finite() && t.weight >= 0.0) {
            p.push(format!(
                "{}: must be a finite number >= 0 (got {})",
                at.field("weight"),
                t.weight
            ));
            continue;
        }
        targets.push((t.pool, t.weight));
    }
    if !targets.is_empty() && targets.iter().map(|t| t.1).sum::<f64>() <= 0.0 {
        p.push(format!("{key}: the weights must not all be 0"));
    }
    targets
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{parse, Config, ConfigError};

    fn check(text: &str) -> Result<Config, ConfigError> {
        parse(text)?.validate()
    }

    const POOLS: &str = r#"
[[pools]]
name = "stable"
models = ["llama"]
workers = [{ url = "http://h:1", labels = { region = "eu-west" } }]
[[pools]]
name = "canary"
models = ["llama-next"]
workers = [{ url = "http://h:2", labels = { region = "us-east" } }]
"#;

    #[test]
    fn regions_residency_locality_and_splits_parse() {
        let c = check(&format!(
            r#"
[server]
region = "eu-west"
[locality]
high_watermark = 0.9
low_watermark = 0.4
min_dwell_ms = 500
[regions.eu-west]
spill_order = ["eu-central", "us-east"]
rtt_ms = {{ eu-central = 12, us-east = 85 }}
[regions.eu-central]
[regions.us-east]
rtt_ms = {{ eu-central = 90 }}
[residency]
eu = ["eu-west", "eu-central"]
[[splits]]
model = "chat"
targets = [{{ pool = "stable", weight = 95 }}, {{ pool = "canary", weight = 5 }}]
{POOLS}"#
        ))
        .unwrap();
        let g = &c.global;
        let id = |n| g.region_id(n).unwrap();
        assert_eq!(g.region, Some(id("eu-west")));
        assert_eq!(
            g.regions[id("eu-west").0 as usize].spill_order,
            vec![id("eu-central"), id("us-east")]
        );
        // Symmetric round trips, 0 to itself, None when not configured.
        assert_eq!(g.rtt_ms(id("us-east"), id("eu-west")), Some(85));
        assert_eq!(g.rtt_ms(id("eu-central"), id("us-east")), Some(90));
        assert_eq!(g.rtt_ms(id("eu-central"), id("eu-central")), Some(0));
        let eu = g.residency("eu").unwrap();
        assert!(eu.regions.contains(Some(id("eu-central"))));
        assert!(!eu.regions.contains(Some(id("us-east"))));
        assert!(!eu.regions.contains(None));
        assert!(eu.admits(Some(id("eu-west"))));
        assert!(!eu.admits(Some(id("us-east"))));
        assert!(!eu.admits(None), "a worker without a region is outside");
        assert_eq!(g.names(eu.regions), "eu-central, eu-west");
        let list = g.residency("us-east, eu-west").unwrap();
        assert_eq!(list.regions.iter().count(), 2);
        assert!(g.residency("mars").is_none());
        assert!(g.residency("eu-west,mars").is_none());
        assert_eq!(g.locality.min_dwell, Duration::from_millis(500));
        assert_eq!(
            g.splits[0].targets,
            vec![("stable".into(), 95.0), ("canary".into(), 5.0)]
        );
    }

    #[test]
    fn rejections_name_their_keys() {
        std::env::set_var("SWITCHYARD_TEST_GLOBAL_KEY", "sk-global-test");
        let e = check(&format!(
            r#"
[server]
region = "eu-north"
[locality]
high_watermark = 0.4
low_watermark = 0.6
[regions.eu-west]
spill_order = ["eu-west", "mars"]
rtt_ms = {{ us-east = 80, venus = 3 }}
[regions.us-east]
rtt_ms = {{ eu-west = 70 }}
[residency]
eu = ["eu-west", "eu-central"]
us-east = ["us-east"]
[[tenants]]
name = "acme"
api_key_env = "SWITCHYARD_TEST_GLOBAL_KEY"
residency = "atlantis"
[[splits]]
model = "llama"
targets = [{{ pool = "nope", weight = 1 }}, {{ pool = "stable", weight = -1 }}]
[[splits]]
model = "empty"
[[splits]]
model = "zero"
targets = [{{ pool = "stable", weight = 0 }}]
{POOLS}
[[pools]]
name = "x"
models = ["x"]
workers = [{{ url = "http://h:3", labels = {{ region = "eu-wset" }} }}]
"#
        ))
        .unwrap_err()
        .to_string();
        for needle in [
            "server.region: unknown region `eu-north`",
            "locality.low_watermark: must not exceed high_watermark",
            "regions.eu-west.spill_order[0]: a region cannot spill to itself",
            "regions.eu-west.spill_order[1]: unknown region `mars`",
            "regions.eu-west.rtt_ms.venus: unknown region",
            "regions.eu-west.rtt_ms.us-east: 80 ms here but 70 ms",
            "residency.eu[1]: unknown region `eu-central`",
            "residency.us-east: a zone may not be named like a region",
            "tenants[0].residency: `atlantis`",
            "splits[0].model: `llama` is already served by a pool",
            "splits[0].targets[0].pool: no pool named `nope`",
            "splits[0].targets[1].weight",
            "splits[1].targets: a split needs at least one target",
            "splits[2].targets: the weights must not all be 0",
            "pools[2].workers[0].labels.region: unknown region `eu-wset`",
        ] {
            assert!(e.contains(needle), "missing `{needle}` in:\n{e}");
        }
    }

    #[test]
    fn unknown_keys_in_the_new_sections_are_named() {
        for (text, key) in [
            ("[locality]\nhigh_watermrk = 0.5\n", "high_watermrk"),
            ("[regions.a]\nspill_ordr = []\n", "spill_ordr"),
            ("[[splits]]\nmodel = \"m\"\ntargets = [{ pool = \"p\", wieght = 1 }]\n", "wieght"),
            ("[server]\nregoin = \"a\"\n", "regoin"),
            (
                "[[pools]]\nmodels=[\"m\"]\nworkers=[{url=\"http://h:1\"}]\n[pools.routing]\nmax_added_latency=3\n",
                "max_added_latency",
            ),
        ] {
            let e = check(text).unwrap_err().to_string();
            assert!(e.contains(key), "{key} not named in: {e}");
        }
    }

    #[test]
    fn without_regions_nothing_is_enforced() {
        // Region labels are free-form until regions are declared.
        let c = check(
            "[[pools]]\nmodels=[\"m\"]\nworkers=[{url=\"http://h:1\", labels={region=\"anywhere\"}}]\n",
        )
        .unwrap();
        assert!(c.global.regions.is_empty() && c.global.region.is_none());
    }
}
