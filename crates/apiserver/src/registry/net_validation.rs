//! IP and CIDR validation of the fields kube 1.33 validates strictly (IPAddress names,
//! ServiceCIDR `spec.cidrs`), as apimachinery 1.33's `pkg/util/validation/ip.go` does it, with
//! its texts: Go's sloppy parser (`netutils.ParseIPSloppy`, `ParseCIDRSloppy`: IPv4 octets and
//! prefix lengths with leading zeros) decides whether a value is an address or CIDR at all; the
//! strict one (`netip.ParseAddr`, `ParsePrefix`) then refuses leading zeros and IPv4-mapped
//! IPv6; a CIDR may not have bits set beyond its prefix; and the value must be the canonical
//! form Go prints.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::error::{FieldError, GoValue};

/// `IsValidIP`'s text for a value that is not an address.
pub const IP_HINT: &str = "must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)";
/// `IsValidCIDR`'s text for a value that is not a CIDR.
pub const CIDR_HINT: &str = "must be a valid CIDR value, (e.g. 10.9.8.0/24 or 2001:db8::/64)";

/// Go's `dtoi` as the sloppy IPv4 parser uses it: all digits, any number of leading zeros.
fn sloppy_decimal(text: &str) -> Option<u32> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let trimmed = text.trim_start_matches('0');
    if trimmed.len() > 7 {
        return None;
    }
    Some(trimmed.parse().unwrap_or(0))
}

/// `netutils.ParseIPSloppy`: an IPv4 address whose octets may have leading zeros, or an IPv6
/// address (no zone).
pub fn parse_ip_sloppy(text: &str) -> Option<IpAddr> {
    if text.contains(':') {
        return text.parse::<Ipv6Addr>().ok().map(IpAddr::V6);
    }
    let parts: Vec<&str> = text.split('.').collect();
    if parts.len() != 4 {
        return None;
    }
    let mut octets = [0u8; 4];
    for (octet, part) in octets.iter_mut().zip(parts) {
        *octet = u8::try_from(sloppy_decimal(part)?).ok()?;
    }
    Some(IpAddr::V4(Ipv4Addr::from(octets)))
}

/// Go's `net.IP.String()` of an address: IPv4-mapped IPv6 prints as IPv4.
fn go_string(ip: IpAddr) -> String {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4.to_string(),
            None => v6.to_string(),
        },
        IpAddr::V4(v4) => v4.to_string(),
    }
}

fn is_4in6(ip: IpAddr) -> bool {
    matches!(ip, IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some())
}

/// `IsValidIP` (strict, for new fields): the problems of `value`, in kube's words.
pub fn ip_problems(value: &str) -> Vec<String> {
    let Some(ip) = parse_ip_sloppy(value) else {
        return vec![IP_HINT.to_owned()];
    };
    let mut problems = Vec::new();
    // `netip.ParseAddr` refuses what only the sloppy parser takes: leading zeros.
    if value.parse::<IpAddr>().is_err() {
        problems.push("must not have leading 0s".to_owned());
    }
    if is_4in6(ip) {
        problems.push("must not be an IPv4-mapped IPv6 address".to_owned());
    }
    if !problems.is_empty() {
        return problems;
    }
    let canonical = go_string(ip);
    if value != canonical {
        problems.push(format!("must be in canonical form ({canonical:?})"));
    }
    problems
}

/// `netutils.ParseCIDRSloppy`: the address as [`parse_ip_sloppy`], the prefix length digits
/// (leading zeros allowed) no longer than the address; the network and its length.
pub fn parse_cidr_sloppy(text: &str) -> Option<(IpAddr, u8)> {
    let (addr, len) = text.split_once('/')?;
    let ip = parse_ip_sloppy(addr)?;
    let len = sloppy_decimal(len)?;
    let max = if ip.is_ipv4() { 32 } else { 128 };
    (len <= max).then_some((ip, len as u8))
}

/// The address of `ip` with the bits beyond `len` cleared.
fn masked(ip: IpAddr, len: u8) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
            IpAddr::V4(Ipv4Addr::from(u32::from(v4) & mask))
        }
        IpAddr::V6(v6) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
            IpAddr::V6(Ipv6Addr::from(u128::from(v6) & mask))
        }
    }
}

/// Whether `ParsePrefix` takes the prefix length: digits, no leading zero.
fn strict_prefix_len(text: &str) -> bool {
    !text.is_empty()
        && text.bytes().all(|b| b.is_ascii_digit())
        && (text == "0" || !text.starts_with('0'))
}

/// `IsValidCIDR` (strict, for new fields): the problems of `value`, in kube's words.
pub fn cidr_problems(value: &str) -> Vec<String> {
    let Some((ip, len)) = parse_cidr_sloppy(value) else {
        return vec![CIDR_HINT.to_owned()];
    };
    let (addr, len_text) = value.split_once('/').expect("parsed above");
    // A Go IPNet of an IPv4-mapped address is IPv4: its length counts IPv4 bits.
    let (net_ip, net_len) = match ip {
        IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some() && len >= 96 => {
            (IpAddr::V4(v6.to_ipv4_mapped().expect("checked")), len - 96)
        }
        _ => (ip, len),
    };
    let network = masked(net_ip, net_len);
    let problem = if addr.parse::<IpAddr>().is_err() || !strict_prefix_len(len_text) {
        Some("must not have leading 0s in IP or prefix length")
    } else if is_4in6(ip) {
        Some("must not have an IPv4-mapped IPv6 address")
    } else if masked(ip, len) != ip {
        Some("must not have bits set beyond the prefix length")
    } else {
        None
    };
    if let Some(problem) = problem {
        return vec![problem.to_owned()];
    }
    let canonical = format!("{}/{net_len}", go_string(network));
    if value != canonical {
        return vec![format!("must be in canonical form ({canonical:?})")];
    }
    Vec::new()
}

/// `ValidateEndpointIP` (kube's `pkg/apis/core/validation`), which Service `externalIPs` and
/// EndpointSlice addresses go through once they parse: the address ranges a Service may not
/// claim, with kube's texts (`value` is the address as written). Without it a Service could
/// make every node's proxy take over `127.0.0.1:<port>`, or the metadata service's
/// 169.254.169.254 (the CVE-2020-8554 family).
pub fn special_ip_problems(value: &str, ip: IpAddr) -> Vec<String> {
    // Go's checks see an IPv4-mapped IPv6 address as the IPv4 address.
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    };
    let (unspecified, loopback, link_local, link_local_multicast) = match ip {
        IpAddr::V4(v4) => (
            v4.is_unspecified(),
            v4.is_loopback(),
            v4.is_link_local(),
            v4.octets()[..3] == [224, 0, 0],
        ),
        IpAddr::V6(v6) => {
            let o = v6.octets();
            (
                v6.is_unspecified(),
                v6.is_loopback(),
                o[0] == 0xfe && o[1] & 0xc0 == 0x80,
                o[0] == 0xff && o[1] & 0x0f == 0x02,
            )
        }
    };
    let mut problems = Vec::new();
    if unspecified {
        problems.push(format!("may not be unspecified ({value})"));
    }
    if loopback {
        problems.push("may not be in the loopback range (127.0.0.0/8, ::1/128)".to_owned());
    }
    if link_local {
        problems.push("may not be in the link-local range (169.254.0.0/16, fe80::/10)".to_owned());
    }
    if link_local_multicast {
        problems.push(
            "may not be in the link-local multicast range (224.0.0.0/24, ff02::/10)".to_owned(),
        );
    }
    problems
}

/// [`special_ip_problems`] as the field errors kube returns for `path`.
pub fn special_ip_errors(path: &str, value: &str, ip: IpAddr) -> Vec<FieldError> {
    special_ip_problems(value, ip)
        .into_iter()
        .map(|p| FieldError::invalid(path, GoValue::Str(value), p))
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn special_addresses_get_validate_endpoint_ips_texts_and_ordinary_ones_none() {
        let problems = |v: &str| special_ip_problems(v, parse_ip_sloppy(v).unwrap());
        assert_eq!(problems("0.0.0.0"), ["may not be unspecified (0.0.0.0)"]);
        assert_eq!(problems("::"), ["may not be unspecified (::)"]);
        for v in ["127.0.0.1", "127.255.0.9", "::1", "::ffff:127.0.0.1"] {
            assert_eq!(
                problems(v),
                ["may not be in the loopback range (127.0.0.0/8, ::1/128)"],
                "{v}"
            );
        }
        for v in ["169.254.169.254", "fe80::1", "febf::1"] {
            assert_eq!(
                problems(v),
                ["may not be in the link-local range (169.254.0.0/16, fe80::/10)"],
                "{v}"
            );
        }
        for v in ["224.0.0.1", "224.0.0.251", "ff02::1", "ff12::1"] {
            assert_eq!(
                problems(v),
                ["may not be in the link-local multicast range (224.0.0.0/24, ff02::/10)"],
                "{v}"
            );
        }
        for v in [
            "192.0.2.1",
            "224.0.1.1",
            "fec0::1",
            "ff05::1",
            "2001:db8::1",
            "10.96.0.1",
        ] {
            assert!(problems(v).is_empty(), "{v}");
        }
    }

    use super::*;

    // The cases of apimachinery 1.33's `ip_test.go` (`TestIsValidIP`, `TestIsValidCIDR`)
    // that this server meets, with their expected texts.

    #[test]
    fn ip_addresses_are_judged_as_kubes_is_valid_ip() {
        for ok in [
            "1.2.3.4",
            "0.0.0.0",
            "255.255.255.255",
            "2001:db8::ffff",
            "::",
            "::1",
        ] {
            assert_eq!(ip_problems(ok), Vec::<String>::new(), "{ok}");
        }
        for (bad, want) in [
            ("", IP_HINT),
            ("1.2.3", IP_HINT),
            ("1.2.3.256", IP_HINT),
            ("1.2.3.4/32", IP_HINT),
            ("fe80::1%eth0", IP_HINT),
            ("001.002.003.004", "must not have leading 0s"),
            ("1.2.3.04", "must not have leading 0s"),
            ("::ffff:1.2.3.4", "must not be an IPv4-mapped IPv6 address"),
            (
                "2001:DB8::FFFF",
                "must be in canonical form (\"2001:db8::ffff\")",
            ),
            (
                "2001:db8:0:0:0:0:0:1",
                "must be in canonical form (\"2001:db8::1\")",
            ),
        ] {
            assert_eq!(ip_problems(bad), vec![want.to_owned()], "{bad}");
        }
    }

    #[test]
    fn cidrs_are_judged_as_kubes_is_valid_cidr() {
        for ok in [
            "10.0.0.0/8",
            "0.0.0.0/0",
            "1.2.3.4/32",
            "2001:db8::/64",
            "::/0",
        ] {
            assert_eq!(cidr_problems(ok), Vec::<String>::new(), "{ok}");
        }
        for (bad, want) in [
            ("", CIDR_HINT),
            ("10.0.0.0", CIDR_HINT),
            ("10.0.0.0/33", CIDR_HINT),
            ("2001:db8::/129", CIDR_HINT),
            ("10.0.0.0/-1", CIDR_HINT),
            (
                "010.000.000.000/8",
                "must not have leading 0s in IP or prefix length",
            ),
            (
                "10.0.0.0/08",
                "must not have leading 0s in IP or prefix length",
            ),
            (
                "::ffff:10.0.0.0/104",
                "must not have an IPv4-mapped IPv6 address",
            ),
            (
                "10.0.0.1/8",
                "must not have bits set beyond the prefix length",
            ),
            (
                "2001:db8::1/64",
                "must not have bits set beyond the prefix length",
            ),
            (
                "2001:DB8::/64",
                "must be in canonical form (\"2001:db8::/64\")",
            ),
            (
                "2001:db8:0:0::/64",
                "must be in canonical form (\"2001:db8::/64\")",
            ),
        ] {
            assert_eq!(cidr_problems(bad), vec![want.to_owned()], "{bad}");
        }
    }
}
