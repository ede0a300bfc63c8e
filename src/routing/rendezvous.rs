//! Rendezvous (highest-random-weight) hashing: every replica that sees the same key
//! and the same workers picks the same one, and removing a worker moves only its keys.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The weight of `worker_hash` for `key`; the highest weight wins.
#[inline]
pub fn weight(key: u64, worker_hash: u64) -> u64 {
    // Mix the pair with a seeded hash of the worker's hash bytes.
    xxh3_64_with_seed(&worker_hash.to_le_bytes(), key)
}

/// Index of the acceptable candidate with the highest weight for `key`.
pub fn pick<I>(key: u64, candidates: I) -> Option<usize>
where
    I: IntoIterator<Item = (usize, u64)>,
{
    candidates
        .into_iter()
        .max_by_key(|&(_, h)| weight(key, h))
        .map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removing_a_worker_moves_only_its_keys() {
        let hashes: Vec<u64> = (0..10u64)
            .map(|i| xxhash_rust::xxh3::xxh3_64(&i.to_le_bytes()))
            .collect();
        let before: Vec<usize> = (0..5000u64)
            .map(|k| pick(k, hashes.iter().copied().enumerate()).unwrap())
            .collect();
        let after: Vec<usize> = (0..5000u64)
            .map(|k| {
                pick(
                    k,
                    hashes.iter().copied().enumerate().filter(|&(i, _)| i != 3),
                )
                .unwrap()
            })
            .collect();
        for (b, a) in before.iter().zip(&after) {
            if *b != 3 {
                assert_eq!(a, b);
            }
        }
        let on3 = before.iter().filter(|&&b| b == 3).count();
        assert!((300..700).contains(&on3), "{on3} keys on worker 3 of 10");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// Removing one of N workers moves exactly the keys it owned, and it
        /// owned about 1/N of them.
        #[test]
        fn removal_moves_only_about_one_nth(n in 2usize..40, gone in 0usize..40, salt in 0u64..1000) {
            let gone = gone % n;
            let hashes: Vec<u64> = (0..n as u64)
                .map(|i| xxhash_rust::xxh3::xxh3_64(&(i ^ (salt << 8)).to_le_bytes()))
                .collect();
            let keys = 2000u64;
            let mut moved = 0u64;
            for k in 0..keys {
                let key = xxhash_rust::xxh3::xxh3_64(&(k + salt * keys).to_le_bytes());
                let before = pick(key, hashes.iter().copied().enumerate()).unwrap();
                let after = pick(key, hashes.iter().copied().enumerate().filter(|&(i, _)| i != gone)).unwrap();
                if before != gone {
                    proptest::prop_assert_eq!(before, after);
                } else {
                    moved += 1;
                }
            }
            // Binomial(keys, 1/n): within 6 standard deviations of keys/n.
            let p = 1.0 / n as f64;
            let mean = keys as f64 * p;
            let sd = (keys as f64 * p * (1.0 - p)).sqrt();
            proptest::prop_assert!((moved as f64 - mean).abs() <= 6.0 * sd + 1.0,
                "moved {moved} of {keys} keys with n = {n}");
        }
    }
}
