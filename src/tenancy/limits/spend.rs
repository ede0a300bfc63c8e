//! Spend against daily and monthly budgets (UTC), in nano-USD. A period's sum
//! starts again at zero when the day or month changes.

use parking_lot::Mutex;

const NANO: f64 = 1e9;
const DAY_S: u64 = 86_400;

/// A point in UTC: the day number and the month number, and the seconds
/// until each ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Calendar {
    pub day: u64,
    pub month: u64,
    pub day_left_s: u64,
    pub month_left_s: u64,
}

impl Calendar {
    /// The calendar at `unix_s` seconds since the epoch.
    pub fn at(unix_s: u64) -> Calendar {
        let day = unix_s / DAY_S;
        let (y, m, _) = civil(day as i64);
        let next = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
        let next_start = days_from_civil(next.0, next.1, 1) as u64 * DAY_S;
        Calendar {
            day,
            month: (y as u64) * 12 + (m as u64 - 1),
            day_left_s: DAY_S - unix_s % DAY_S,
            month_left_s: next_start.saturating_sub(unix_s),
        }
    }
}

/// (year, month, day) of a day number (Howard Hinnant's `civil_from_days`).
fn civil(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// Day number of a date (`days_from_civil`).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[derive(Default)]
struct Sums {
    day: u64,
    day_nano: u64,
    month: u64,
    month_nano: u64,
}

impl Sums {
    /// Start the day's or month's sum again when its period has changed.
    fn roll(&mut self, cal: Calendar) {
        if self.day != cal.day {
            (self.day, self.day_nano) = (cal.day, 0);
        }
        if self.month != cal.month {
            (self.month, self.month_nano) = (cal.month, 0);
        }
    }
}

/// One scope's spend.
#[derive(Default)]
pub struct Spend(Mutex<Sums>);

impl Spend {
    /// Spent so far today and this month (USD).
    pub fn spent(&self, cal: Calendar) -> (f64, f64) {
        let s = self.0.lock();
        let day = if s.day == cal.day { s.day_nano } else { 0 };
        let month = if s.month == cal.month {
            s.month_nano
        } else {
            0
        };
        (day as f64 / NANO, month as f64 / NANO)
    }

    /// Reserve `nano` (nano-USD) in today's and this month's sums if it fits
    /// both budgets (USD); else the budget refused and what it has spent or
    /// reserved (USD). A spent budget refuses even a free request.
    pub fn reserve(
        &self,
        cal: Calendar,
        nano: u64,
        (daily, monthly): (Option<f64>, Option<f64>),
    ) -> Result<(), (super::LimitKind, f64)> {
        let mut s = self.0.lock();
        s.roll(cal);
        let over = |spent: u64, budget: Option<f64>| {
            budget.is_some_and(|b| {
                let b = super::usd_to_nano(b);
                spent >= b || spent.saturating_add(nano) > b
            })
        };
        if over(s.day_nano, daily) {
            return Err((super::LimitKind::DailyBudget, s.day_nano as f64 / NANO));
        }
        if over(s.month_nano, monthly) {
            return Err((super::LimitKind::MonthlyBudget, s.month_nano as f64 / NANO));
        }
        s.day_nano = s.day_nano.saturating_add(nano);
        s.month_nano = s.month_nano.saturating_add(nano);
        Ok(())
    }

    /// Correct a reservation made at `cal` by `delta` nano-USD (a period
    /// that has ended since is left alone).
    pub fn adjust(&self, cal: Calendar, delta: i64) {
        let mut s = self.0.lock();
        let apply = |sum: &mut u64| *sum = sum.saturating_add_signed(delta);
        if s.day == cal.day {
            apply(&mut s.day_nano);
        }
        if s.month == cal.month {
            apply(&mut s.month_nano);
        }
    }

    /// Add `usd` to today's and this month's sums.
    pub fn add(&self, cal: Calendar, usd: f64) {
        if !(usd.is_finite() && usd > 0.0) {
            return;
        }
        let nano = (usd * NANO).round() as u64;
        let mut s = self.0.lock();
        s.roll(cal);
        s.day_nano = s.day_nano.saturating_add(nano);
        s.month_nano = s.month_nano.saturating_add(nano);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calendar_knows_month_lengths_and_what_is_left() {
        // 2024-02-29T23:00:00Z: a leap day, one hour before March.
        let c = Calendar::at(1_709_247_600);
        assert_eq!(c.day_left_s, 3_600);
        assert_eq!(c.month_left_s, 3_600);
        assert_eq!(civil(c.day as i64), (2024, 2, 29));
        // 2026-12-02T03:00:00Z: 29 days and 21 hours to January.
        let d = Calendar::at(1_796_180_400);
        assert_eq!(civil(d.day as i64), (2026, 12, 2));
        assert_eq!(d.month_left_s, 29 * 86_400 + 21 * 3_600);
    }

    #[test]
    fn spend_sums_restart_with_the_period() {
        let s = Spend::default();
        let c = Calendar::at(1_709_247_600);
        s.add(c, 0.25);
        s.add(c, 0.5);
        assert_eq!(s.spent(c), (0.75, 0.75));
        let next_day = Calendar::at(1_709_247_600 + 3_600);
        assert_eq!(s.spent(next_day), (0.0, 0.0));
        let later_same_month = Calendar::at(1_709_247_600 - 86_400);
        assert_eq!(s.spent(later_same_month).1, 0.75);
    }

    #[test]
    fn reservations_fit_the_budget_and_corrections_give_back() {
        let s = Spend::default();
        let c = Calendar::at(1_709_247_600);
        let day = (Some(1.0), None);
        s.reserve(c, 600_000_000, day).unwrap();
        // 0.6 reserved: another 0.6 would overspend the dollar.
        let (kind, spent) = s.reserve(c, 600_000_000, day).unwrap_err();
        assert_eq!((kind, spent), (super::super::LimitKind::DailyBudget, 0.6));
        // The first cost 0.1 in the end: 0.5 comes back, and 0.6 fits again.
        s.adjust(c, -500_000_000);
        s.reserve(c, 600_000_000, day).unwrap();
        assert_eq!(s.spent(c).0, 0.7);
        // A spent budget refuses even a free request.
        s.adjust(c, 300_000_000);
        assert!(s.reserve(c, 0, day).is_err());
    }
}
