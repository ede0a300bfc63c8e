//! The validity window of an X.509 certificate (`notBefore`, `notAfter`), read
//! from its DER: a certificate outside its window makes every client's
//! handshake fail, so the gateway refuses it at start, in `check-config` and on
//! rotation, and exports the chain's expiry as a metric. Only the path to the
//! `validity` field is walked (RFC 5280 §4.1); the signature is rustls' and the
//! client's business. A few dozen lines instead of a full X.509 parser in the tree.

use std::time::{SystemTime, UNIX_EPOCH};

/// A certificate's validity window, in seconds since the Unix epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Validity {
    pub not_before: i64,
    pub not_after: i64,
}

impl Validity {
    /// Read the window from a certificate's DER.
    pub fn of_der(der: &[u8]) -> Result<Validity, String> {
        let bad = |what: &str| format!("not an X.509 certificate ({what})");
        let (cert, _) = tlv(der, SEQUENCE).ok_or_else(|| bad("certificate"))?;
        let (mut tbs, _) = tlv(cert, SEQUENCE).ok_or_else(|| bad("tbsCertificate"))?;
        // [0] version is optional (absent: v1).
        if tbs.first() == Some(&0xa0) {
            tbs = tlv(tbs, 0xa0).ok_or_else(|| bad("version"))?.1;
        }
        for field in ["serialNumber", "signature", "issuer"] {
            tbs = skip(tbs).ok_or_else(|| bad(field))?;
        }
        let (validity, _) = tlv(tbs, SEQUENCE).ok_or_else(|| bad("validity"))?;
        let (not_before, rest) = time(validity).ok_or_else(|| bad("notBefore"))?;
        let (not_after, _) = time(rest).ok_or_else(|| bad("notAfter"))?;
        Ok(Validity {
            not_before,
            not_after,
        })
    }

    /// `Err` with both dates when `now` (Unix seconds) is outside the window.
    pub fn check(&self, now: i64) -> Result<(), String> {
        if now > self.not_after {
            return Err(format!(
                "expired: notAfter {} (now {})",
                show(self.not_after),
                show(now)
            ));
        }
        if now < self.not_before {
            return Err(format!(
                "not valid yet: notBefore {} (now {})",
                show(self.not_before),
                show(now)
            ));
        }
        Ok(())
    }
}

/// Now, in seconds since the Unix epoch (a certificate's clock is the wall clock).
pub fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// Every certificate of a chain inside its window at `now`; the earliest
/// `notAfter` (when the chain stops working) on success. `names` the file in errors.
pub fn check_chain(ders: &[&[u8]], now: i64, names: &str) -> Result<i64, String> {
    let mut earliest = i64::MAX;
    for (i, der) in ders.iter().enumerate() {
        let which = if i == 0 {
            "the certificate".to_string()
        } else {
            format!("chain certificate {}", i + 1)
        };
        let v = Validity::of_der(der).map_err(|e| format!("`{names}`: {which}: {e}"))?;
        v.check(now)
            .map_err(|e| format!("`{names}`: {which} is {e}"))?;
        earliest = earliest.min(v.not_after);
    }
    Ok(earliest)
}

const SEQUENCE: u8 = 0x30;
const UTC_TIME: u8 = 0x17;
const GENERALIZED_TIME: u8 = 0x18;

/// One DER element of tag `tag` at the start of `b`: its contents and what follows.
fn tlv(b: &[u8], tag: u8) -> Option<(&[u8], &[u8])> {
    let (&t, rest) = b.split_first()?;
    (t == tag).then_some(())?;
    let (&first, mut rest) = rest.split_first()?;
    let len = if first < 0x80 {
        usize::from(first)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, &x| (acc << 8) | usize::from(x));
        rest = &rest[n..];
        len
    };
    (rest.len() >= len).then(|| rest.split_at(len))
}

/// Skip one element, whatever its (single-byte) tag.
fn skip(b: &[u8]) -> Option<&[u8]> {
    let tag = *b.first()?;
    tlv(b, tag).map(|(_, rest)| rest)
}

/// A UTCTime (`YYMMDDHHMMSSZ`, 1950–2049) or GeneralizedTime (`YYYYMMDDHHMMSSZ`).
fn time(b: &[u8]) -> Option<(i64, &[u8])> {
    let (text, rest, year) = if let Some((t, rest)) = tlv(b, UTC_TIME) {
        let yy = digits(t.get(..2)?)?;
        (
            t.get(2..)?,
            rest,
            if yy < 50 { 2000 + yy } else { 1900 + yy },
        )
    } else {
        let (t, rest) = tlv(b, GENERALIZED_TIME)?;
        (t.get(4..)?, rest, digits(t.get(..4)?)?)
    };
    if text.len() != 11 || text[10] != b'Z' {
        return None;
    }
    let f = |i: usize| digits(&text[i..i + 2]);
    let (month, day, h, m, s) = (f(0)?, f(2)?, f(4)?, f(6)?, f(8)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || h > 23 || m > 59 || s > 60 {
        return None;
    }
    let days = days_from_civil(year, month, day);
    Some((days * 86_400 + h * 3600 + m * 60 + s, rest))
}

fn digits(b: &[u8]) -> Option<i64> {
    b.iter().try_fold(0i64, |acc, &c| {
        c.is_ascii_digit().then(|| acc * 10 + i64::from(c - b'0'))
    })
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The inverse of [`days_from_civil`].
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// `2025-03-01T12:00:00Z`.
pub fn show(unix: i64) -> String {
    let (y, mo, d) = civil_from_days(unix.div_euclid(86_400));
    let s = unix.rem_euclid(86_400);
    format!(
        "{y:04}-{mo:02}-{d:02}T{:02}:{:02}:{:02}Z",
        s / 3600,
        s / 60 % 60,
        s % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert(not_before: (i32, u8, u8), not_after: (i32, u8, u8)) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        p.not_before = rcgen::date_time_ymd(not_before.0, not_before.1, not_before.2);
        p.not_after = rcgen::date_time_ymd(not_after.0, not_after.1, not_after.2);
        p.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn reads_both_time_encodings() {
        // rcgen writes UTCTime before 2050 and GeneralizedTime from 2050 on.
        let v = Validity::of_der(&cert((2020, 2, 29), (2051, 12, 31))).unwrap();
        assert_eq!(show(v.not_before), "2020-02-29T00:00:00Z");
        assert_eq!(show(v.not_after), "2051-12-31T00:00:00Z");
        assert_eq!(v.not_before, 1_582_934_400);
    }

    #[test]
    fn check_names_the_date_that_is_out_of_range() {
        let v = Validity::of_der(&cert((2000, 1, 1), (2001, 1, 1))).unwrap();
        let e = v.check(unix_now()).unwrap_err();
        assert!(
            e.starts_with("expired: notAfter 2001-01-01T00:00:00Z"),
            "{e}"
        );
        let v = Validity::of_der(&cert((2090, 1, 1), (2091, 1, 1))).unwrap();
        let e = v.check(unix_now()).unwrap_err();
        assert!(e.starts_with("not valid yet: notBefore 2090-01-01"), "{e}");
        let v = Validity::of_der(&cert((2000, 1, 1), (2090, 1, 1))).unwrap();
        assert!(v.check(unix_now()).is_ok());
    }

    #[test]
    fn a_chain_fails_on_any_certificate_and_reports_the_earliest_expiry() {
        let (good, later) = (
            cert((2000, 1, 1), (2080, 1, 1)),
            cert((2000, 1, 1), (2090, 1, 1)),
        );
        let bad = cert((2000, 1, 1), (2001, 1, 1));
        let now = unix_now();
        let earliest = check_chain(&[&later, &good], now, "c.pem").unwrap();
        assert_eq!(show(earliest), "2080-01-01T00:00:00Z");
        let e = check_chain(&[&good, &bad], now, "c.pem").unwrap_err();
        assert!(e.contains("chain certificate 2 is expired"), "{e}");
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let good = cert((2000, 1, 1), (2090, 1, 1));
        for n in 0..good.len() {
            let _ = Validity::of_der(&good[..n]);
        }
        assert!(Validity::of_der(b"\x30\x84\xff\xff\xff\xff").is_err());
        assert!(Validity::of_der(b"").is_err());
    }

    #[test]
    fn civil_dates_round_trip() {
        for days in [-1, 0, 59, 60, 10_956, 11_016, 29_220, 47_482] {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
    }
}
