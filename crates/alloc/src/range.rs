//! The NodePort range (`--service-node-port-range`): parsing, display and membership.

use std::fmt;
use std::str::FromStr;

/// An inclusive range of TCP/UDP ports, such as kube-apiserver's `--service-node-port-range`.
///
/// Mirrors `PortRange` of `k8s.io/apimachinery/pkg/util/net/port_range.go`: a base port and a
/// size, displayed as `"<first>-<last>"` (the `Range` string of a Kubernetes `RangeAllocation`).
/// Unlike the Go type, a `PortRange` is never empty and never contains port 0: every value
/// that parses is a range a NodePort allocator can serve.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PortRange {
    base: u16,
    /// Number of ports, at least 1; `base + size - 1 <= 65535`.
    size: u32,
}

/// Why a port range was rejected. Every message names the value that was given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The text is empty or is not of the form `N-M`, `N+offset` or `N`.
    #[error("invalid port range {value:?}: expected \"N-M\", \"N+offset\" or \"N\"")]
    Syntax {
        /// The text as given.
        value: String,
    },
    /// One side of the range is not a decimal number.
    #[error("invalid port range {value:?}: {part:?} is not a port number")]
    NotANumber {
        /// The text as given.
        value: String,
        /// The part that is not a number.
        part: String,
    },
    /// A port of the range is above 65535 (apimachinery's wording).
    #[error("invalid port range {value:?}: the port range cannot be greater than 65535")]
    TooHigh {
        /// The text as given.
        value: String,
    },
    /// The range starts at port 0, which no Service can use.
    #[error("invalid port range {value:?}: ports start at 1")]
    PortZero {
        /// The text as given.
        value: String,
    },
    /// The last port is below the first (apimachinery's wording).
    #[error("invalid port range {value:?}: end port cannot be less than start port")]
    Reversed {
        /// The text as given.
        value: String,
    },
}

impl PortRange {
    /// The range `first..=last`. Fails when `first` is 0 or `last < first`.
    pub fn new(first: u16, last: u16) -> Result<Self, Error> {
        let value = format!("{first}-{last}");
        if first == 0 {
            return Err(Error::PortZero { value });
        }
        if last < first {
            return Err(Error::Reversed { value });
        }
        Ok(Self {
            base: first,
            size: u32::from(last - first) + 1,
        })
    }

    /// Parses a range as kube-apiserver parses `--service-node-port-range`
    /// (`ParsePortRange` in `k8s.io/apimachinery/pkg/util/net/port_range.go`):
    ///
    /// - `"N-M"`: ports N to M inclusive;
    /// - `"N+offset"`: ports N to N+offset inclusive;
    /// - `"N"`: the single port N.
    ///
    /// Surrounding white space is ignored. Stricter than the Go parser, which reads `""` as an
    /// empty range and accepts port 0 and signed numbers: those are errors here.
    pub fn parse(s: &str) -> Result<Self, Error> {
        let value = s.trim();
        let owned = || value.to_owned();
        let number = |part: &str| -> Result<u32, Error> {
            if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
                return Err(Error::NotANumber {
                    value: owned(),
                    part: part.to_owned(),
                });
            }
            // All digits: the only possible failure is overflow, which is "too high" anyway.
            part.parse::<u32>()
                .map_err(|_| Error::TooHigh { value: owned() })
        };

        let (low, high) = match (value.find('-'), value.find('+')) {
            _ if value.is_empty() => return Err(Error::Syntax { value: owned() }),
            (None, None) => {
                let port = number(value)?;
                (port, port)
            }
            (Some(hyphen), None) => (number(&value[..hyphen])?, number(&value[hyphen + 1..])?),
            (None, Some(plus)) => {
                let low = number(&value[..plus])?;
                let offset = number(&value[plus + 1..])?;
                (low, low.saturating_add(offset))
            }
            (Some(_), Some(_)) => return Err(Error::Syntax { value: owned() }),
        };

        if low > u32::from(u16::MAX) || high > u32::from(u16::MAX) {
            return Err(Error::TooHigh { value: owned() });
        }
        if low == 0 {
            return Err(Error::PortZero { value: owned() });
        }
        if high < low {
            return Err(Error::Reversed { value: owned() });
        }
        Ok(Self {
            // Both checked to be within 1..=65535 above.
            base: low as u16,
            size: high - low + 1,
        })
    }

    /// The first port of the range.
    pub fn base(&self) -> u16 {
        self.base
    }

    /// The number of ports in the range (1 to 65535).
    pub fn size(&self) -> u32 {
        self.size
    }

    /// The last port of the range (inclusive).
    pub fn last(&self) -> u16 {
        // size >= 1 and base + size - 1 <= 65535 by construction.
        (u32::from(self.base) + self.size - 1) as u16
    }

    /// Whether `port` lies inside the range.
    pub fn contains(&self, port: u16) -> bool {
        port >= self.base && u32::from(port - self.base) < self.size
    }
}

/// kube-apiserver's default `--service-node-port-range`, `30000-32767`
/// (`DefaultServiceNodePortRange` in `pkg/kubeapiserver/options/options.go`).
impl Default for PortRange {
    fn default() -> Self {
        Self {
            base: 30000,
            size: 2768,
        }
    }
}

/// `"<first>-<last>"`, as `PortRange.String()` prints it; a single port prints as `"N-N"`.
impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.base, self.last())
    }
}

impl FromStr for PortRange {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        Self::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(s: &str) -> (u16, u16) {
        let range = PortRange::parse(s).unwrap_or_else(|e| panic!("{s:?} should parse: {e}"));
        (range.base(), range.last())
    }

    #[test]
    fn hyphen_range_is_inclusive_at_both_ends() {
        assert_eq!(parsed("30000-32767"), (30000, 32767));
        assert_eq!(PortRange::parse("30000-32767").unwrap().size(), 2768);
        assert_eq!(parsed(" 1-65535 "), (1, 65535));
    }

    #[test]
    fn plus_notation_adds_an_offset_to_the_base() {
        assert_eq!(parsed("30000+2767"), (30000, 32767));
        assert_eq!(parsed("80+0"), (80, 80));
    }

    #[test]
    fn a_single_port_is_a_range_of_one() {
        let range = PortRange::parse("8080").unwrap();
        assert_eq!((range.base(), range.last(), range.size()), (8080, 8080, 1));
        assert_eq!(range.to_string(), "8080-8080");
    }

    #[test]
    fn default_is_kube_apiservers_30000_to_32767() {
        let range = PortRange::default();
        assert_eq!(range.to_string(), "30000-32767");
        assert_eq!(range, "30000-32767".parse().unwrap());
    }

    #[test]
    fn contains_checks_both_ends() {
        let range = PortRange::parse("10000-10200").unwrap();
        assert!(range.contains(10000));
        assert!(range.contains(10200));
        assert!(!range.contains(9999));
        assert!(!range.contains(10201));
        assert!(!range.contains(1));
        let top = PortRange::parse("65535").unwrap();
        assert!(top.contains(65535));
        assert!(!top.contains(65534));
    }

    #[test]
    fn bad_ranges_are_rejected_with_the_value_in_the_message() {
        let cases = [
            (
                "",
                "invalid port range \"\": expected \"N-M\", \"N+offset\" or \"N\"",
            ),
            (
                "   ",
                "invalid port range \"\": expected \"N-M\", \"N+offset\" or \"N\"",
            ),
            (
                "30000-2",
                "invalid port range \"30000-2\": end port cannot be less than start port",
            ),
            (
                "30000-70000",
                "invalid port range \"30000-70000\": the port range cannot be greater than 65535",
            ),
            (
                "65535+1",
                "invalid port range \"65535+1\": the port range cannot be greater than 65535",
            ),
            (
                "99999999999999999999",
                "invalid port range \"99999999999999999999\": the port range cannot be greater than 65535",
            ),
            ("0-100", "invalid port range \"0-100\": ports start at 1"),
            (
                "abc",
                "invalid port range \"abc\": \"abc\" is not a port number",
            ),
            (
                "30000-",
                "invalid port range \"30000-\": \"\" is not a port number",
            ),
            ("-5", "invalid port range \"-5\": \"\" is not a port number"),
            (
                "30000-+5",
                "invalid port range \"30000-+5\": expected \"N-M\", \"N+offset\" or \"N\"",
            ),
            (
                "1-2-3",
                "invalid port range \"1-2-3\": \"2-3\" is not a port number",
            ),
            (
                "30000 - 32767",
                "invalid port range \"30000 - 32767\": \"30000 \" is not a port number",
            ),
        ];
        for (input, message) in cases {
            let err = PortRange::parse(input).expect_err(input);
            assert_eq!(err.to_string(), message, "input {input:?}");
        }
    }

    #[test]
    fn new_rejects_port_zero_and_reversed_bounds() {
        assert_eq!(PortRange::new(30000, 32767).unwrap(), PortRange::default());
        assert!(matches!(PortRange::new(0, 10), Err(Error::PortZero { .. })));
        assert!(matches!(PortRange::new(10, 9), Err(Error::Reversed { .. })));
    }
}
