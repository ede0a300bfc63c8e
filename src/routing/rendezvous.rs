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
}
