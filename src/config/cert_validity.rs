//! The validity window of an X.509 certificate (`notBefore`, `notAfter`): a
//! certificate outside its window makes every client's handshake fail, so the
//! gateway refuses it at start, in `check-config` and on rotation, and exports
//! the chain's expiry as a metric. The DER is read by `x509-parser` (a kept
//! parser, no crypto); the signature is rustls' and the client's business.

use std::time::{SystemTime, UNIX_EPOCH};

use x509_parser::certificate::X509Certificate;
use x509_parser::prelude::FromDer;
use x509_parser::time::ASN1Time;

/// A certificate's validity window, in seconds since the Unix epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Validity {
    pub not_before: i64,
    pub not_after: i64,
}

impl Validity {
    /// Read the window from a certificate's DER.
    pub fn of_der(der: &[u8]) -> Result<Validity, String> {
        let (_, cert) = X509Certificate::from_der(der)
            .map_err(|e| format!("not an X.509 certificate ({e})"))?;
        let v = cert.validity();
        Ok(Validity {
            not_before: v.not_before.timestamp(),
            not_after: v.not_after.timestamp(),
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

/// `2025-03-01T12:00:00Z`.
pub fn show(unix: i64) -> String {
    let Ok(t) = ASN1Time::from_timestamp(unix) else {
        return format!("{unix} (Unix seconds)");
    };
    let t = t.to_datetime();
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
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
    fn show_prints_utc_and_survives_any_number() {
        assert_eq!(show(0), "1970-01-01T00:00:00Z");
        assert_eq!(show(1_582_934_400), "2020-02-29T00:00:00Z");
        assert!(show(i64::MAX).contains("Unix seconds"));
    }
}
